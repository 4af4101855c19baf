"""ferryd's Prometheus endpoint (--metrics_address), scraped over HTTP
during real versions and parsed with a real Prometheus text parser
(python3-prometheus-client's): a source rank and a TP-2 instance (the
Python clients, the real ferryd); two versions commit, a third aborts
because a rank's loader fails. The counters must have moved by exactly
what the versions did.

Usage: metrics_test.py FERRYD_BINARY
"""

import re
import socket
import sys
import time
import urllib.error
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

import ferry
import ferryd_process


def scrape(port):
    """{(sample name, frozenset(labels)): value} of one scrape."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        assert r.status == 200, r.status
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("ferry_"), family.name
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def check_garbage(port):
    """Whatever reaches the endpoint, it answers /metrics afterwards."""
    req = urllib.request.Request("http://127.0.0.1:%d/metrics" % port, data=b"x",
                                 method="POST")
    try:
        urllib.request.urlopen(req, timeout=5)
        raise AssertionError("a POST was served")
    except urllib.error.HTTPError as e:
        assert e.code == 405, e.code
    try:
        urllib.request.urlopen("http://127.0.0.1:%d/other" % port, timeout=5)
        raise AssertionError("a path other than /metrics was served")
    except urllib.error.HTTPError as e:
        assert e.code == 404, e.code
    for junk in (b"\x00\xff garbage\r\n\r\n", b"GET /metrics HTTP/1.1\r\n" +
                 b"X: " + b"a" * 200000 + b"\r\n\r\n", b"GET"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                s.recv(4096)
            except OSError:
                pass  # the server may close on us: that is fine
    assert scrape(port), "no metrics after garbage"


def metrics_port(log_path):
    """The port ferryd logged for its metrics endpoint."""
    for _ in range(100):
        with open(log_path) as f:
            m = re.search(r"metrics on http://\S+ \(port (\d+)\)", f.read())
        if m:
            return int(m.group(1))
        time.sleep(0.1)
    raise AssertionError("ferryd logged no metrics port")


class Loader(ferry.EngineCallbacks):
    """Rank r's loader takes the fallback bias; rank 1's fails at version
    ``fail_at``."""

    def __init__(self, r, live, fail_at):
        self.r, self.live, self.fail_at = r, live, fail_at

    def on_apply(self, v, fallback):
        r = self.r
        if v == self.fail_at and r == 1:
            raise RuntimeError("loader out of memory")
        self.live["b"].copy_(fallback[0][1][4 * r:4 * r + 4])


def main():
    with ferryd_process.Ferryd(sys.argv[1], "metrics",
                               "--metrics_address=127.0.0.1:0",
                               "--ack_timeout_ms=20000",
                               "--version_timeout_ms=40000") as d:
        sock, daemon, clients = d.sock, d.process, d.clients
        port = metrics_port(d.log_path)
        conn = ferry.connect(sock)
        before = scrape(port)
        assert value(before, "ferry_participants", role="source") == 0

        w_src = ferry.SharedTensorArena("metrics.src", 1 << 16)
        W = w_src.tensor((8, 4))
        bias = w_src.tensor((8,))
        src = ferry.SourceClient.register(conn, "policy", 0, 1, w_src, [
            (W, ferry.Shard("w", (8, 4))), (bias, ferry.Shard("b", (8,)))])
        clients.append(src)
        fail_at = [3]
        ranks = []
        for r in range(2):
            arena = ferry.SharedTensorArena("metrics.dst%d" % r, 1 << 16)
            live = dict(w=arena.tensor((4, 4)), b=arena.tensor((4,)))

            params = [
                ferry.EngineParam("m.w", live["w"], ferry.COLUMN, shard_dim=0,
                                  consumes=["w"]),
                ferry.EngineParam("x.b", live["b"], ferry.COLUMN,
                                  flags=[ferry.TRANSFORMED], consumes=["b"]),
            ]
            dst = ferry.DestinationClient.register(conn, "inst", "policy", r, 2,
                                                   arena, params,
                                                   Loader(r, live, fail_at[0]))
            clients.append(dst)
            ranks.append((dst, live))

        s = scrape(port)
        assert value(s, "ferry_participants", role="source") == 1, s
        assert value(s, "ferry_participants", role="destination") == 2, s

        per_version = None
        for v in (1, 2, 3):
            W.copy_(torch.arange(32, dtype=torch.float32).view(8, 4) * v)
            bias.copy_(torch.arange(8, dtype=torch.float32) - v)
            out = src.publish(v)
            s = scrape(port)
            moved = value(s, "ferry_transferred_bytes_total", stream="policy",
                          transport="local", route="source", form="dense")
            if v == 1:
                per_version = moved
                # w: 8x4 f32 direct (128 bytes over both ranks); b: the
                # whole 8 floats into each rank's staging (2 x 32).
                assert per_version == 128 + 64, per_version
            # Every version's bytes landed, the aborted one's too (it
            # failed at APPLY, after the transfer).
            assert moved == v * per_version, (v, moved, per_version)
            assert value(s, "ferry_versions_begun_total", stream="policy",
                         kind="version") == v
            assert value(s, "ferry_version_duration_seconds_count",
                         stream="policy", kind="version") == v
            assert value(s, "ferry_version_phase_seconds_count", stream="policy",
                         phase="transfer") == v
            if v < 3:
                assert out.all_committed(), out.summary()
                assert value(s, "ferry_instance_versions_total", stream="policy",
                             instance="inst", outcome="committed", cause="none") == v
                assert value(s, "ferry_instance_committed_version",
                             stream="policy", instance="inst") == v
                assert value(s, "ferry_version_phase_seconds_count",
                             stream="policy", phase="apply") == v
            else:
                assert not out.all_committed(), out.summary()
                assert value(s, "ferry_instance_versions_total", stream="policy",
                             instance="inst", outcome="aborted",
                             cause="rank_failed") == 1, s
                # Still version 2: an aborted version is never committed.
                assert value(s, "ferry_instance_committed_version",
                             stream="policy", instance="inst") == 2
                # It never reached COMMIT: no third apply duration.
                assert value(s, "ferry_version_phase_seconds_count",
                             stream="policy", phase="apply") == 2
        # The histograms' buckets are cumulative and end at the count.
        inf = value(s, "ferry_version_duration_seconds_bucket", stream="policy",
                    kind="version", le="+Inf")
        assert inf == 3, inf
        lookups = (value(s, "ferry_plan_cache_lookups_total", result="hit") +
                   value(s, "ferry_plan_cache_lookups_total", result="miss"))
        assert lookups >= 3, lookups
        assert value(s, "ferry_staging_bytes", state="limit") > 0
        check_garbage(port)
        assert daemon.poll() is None, "ferryd died"
        print("metrics_test: 3 versions counted as they went")

if __name__ == "__main__":
    main()
