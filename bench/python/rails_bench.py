"""Rails with real shaped links (issue 41): one version between two real
ferryd processes in their own network namespaces, joined by 4 veth pairs
shaped with tc to `--mbit` each (python/tests/netns_rails.py), on 1, 2
and 4 rails, against its bound: the version's bytes over the rails' summed
rate.

    bazel run -c opt //bench/python:rails_bench -- [--mib=96] [--mbit=400] [--runs=5]

A trainer rank on A with float32 tensors of 4 MiB (`mib` in all), one
engine instance on B (TP 1), --bucket_mb=4; for each rail count a fresh
daemon pair with --rails naming that many rails, one warm-up version, then
`runs` versions, each timed from publish to every instance committed and
checked byte for byte. Beside it, in the same run, the physical limit:
raw TCP streams of the same bytes, one per rail in parallel, each bound to
its rail's addresses (plain Python sockets, sender in A, receiver in B,
timed from the first byte to every receiver's acknowledgement), and the
nominal bound, the bytes over the rails' summed shaped rate (tbf counts
Ethernet frames: at MTU 1500 about 4% of the rate is headers). Needs root.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

import ferry

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "python", "tests"))
import netns_rails  # noqa: E402


class Engine(ferry.EngineCallbacks):
    def on_apply(self, v, fallback):
        assert not fallback


def change(W, v, density):
    """Version v's weights: all new (density None), or `density` of the
    elements (every 1/density-th, from an offset that moves) bumped."""
    if density is None:
        for w in W:
            w.fill_(float(v))
        return
    if density == 0:
        return
    stride = max(1, int(round(1 / density)))
    for w in W:
        flat = w.view(-1)
        flat[v % stride::stride] += 1


def wire_bytes(conn, v):
    """The bytes version v put on the wire: patches, and dense buckets."""
    p = conn.inspection.GetProgress(
        ferry.inspection_pb2.GetProgressRequest(stream="policy", version=v))
    return sum(i.bytes_moved - i.patched_bytes + i.patch_bytes
               for i in p.instances)


def one_count(ferryd, net, rails, mib, runs, density=None, wire=None):
    flags = ["--bucket_mb=4", "--version_timeout_ms=120000"]
    if density is not None:
        flags.append("--delta_shadow_mb=%d" % (2 * mib + 16))
    n = mib // 4
    shape = (1024, 1024)
    with net.ferryd(ferryd, "a", flags, rails=rails) as a:
        with net.ferryd(ferryd, "b", flags, coordinator=a, rails=rails) as b:
            b.wait_joined()
            conn_a, conn_b = ferry.connect(a.sock), ferry.connect(b.sock)
            sa = ferry.SharedTensorArena("bench.rails-src", (mib + 1) << 20)
            W = [sa.tensor(shape, torch.float32) for _ in range(n)]
            src = ferry.SourceClient.register(
                conn_a, "policy", 0, 1, sa,
                [(w, ferry.Shard("w%d" % i, shape)) for i, w in enumerate(W)])
            a.clients.append(src)
            da = ferry.SharedTensorArena("bench.rails-dst", (mib + 1) << 20)
            D = [da.tensor(shape, torch.float32) for _ in range(n)]
            b.clients.append(ferry.DestinationClient.register(
                conn_b, "inst", "policy", 0, 1, da,
                [ferry.EngineParam("m.w%d" % i, d, ferry.REPLICATED,
                                   consumes=["w%d" % i]) for i, d in enumerate(D)],
                Engine()))
            times = []
            for w in W:
                w.copy_(torch.randn(w.shape))
            for v in range(1, runs + 2):
                change(W, v, density)
                t0 = time.perf_counter()
                out = src.publish(v)
                dt = time.perf_counter() - t0
                assert out.all_committed(), out.summary()
                for w, d in zip(W, D):
                    assert np.array_equal(w.numpy(), d.numpy()), v
                if v > 1:
                    times.append(dt)
                    if wire is not None:
                        wire.append(wire_bytes(conn_a, v))
            return times


RECEIVER = r'''
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((host, port)); ls.listen(1); print("ready", flush=True)
c, _ = ls.accept(); buf = bytearray(1 << 20); got = 0
while got < n:
    k = c.recv_into(buf)
    if not k: sys.exit(1)
    got += k
c.sendall(b"k")
'''

SENDER = r'''
import socket, sys, threading, time
pairs = [p.split("/") for p in sys.argv[2:]]
n = int(sys.argv[1]); data = bytes(1 << 20); socks = []
for local, remote, port in pairs:
    s = socket.socket(); s.bind((local, 0)); s.connect((remote, int(port)))
    socks.append(s)
def send(s):
    left = n
    while left > 0:
        left -= s.send(data[:min(left, len(data))])
    assert s.recv(1) == b"k"
t0 = time.perf_counter()
ts = [threading.Thread(target=send, args=(s,)) for s in socks]
[t.start() for t in ts]; [t.join() for t in ts]
print(time.perf_counter() - t0)
'''


def raw_seconds(net, rails, total):
    """Raw TCP streams, one per rail at once, `total` bytes in all."""
    import subprocess
    per = total // rails
    receivers = []
    for i in range(rails):
        r = subprocess.Popen(net.run("b") + ["/usr/bin/python3", "-c", RECEIVER,
                                             "10.77.%d.2" % (i + 1), str(5100 + i),
                                             str(per)],
                             stdout=subprocess.PIPE, text=True)
        assert r.stdout.readline().strip() == "ready"
        receivers.append(r)
    out = subprocess.run(net.run("a") + ["/usr/bin/python3", "-c", SENDER, str(per)] +
                         ["10.77.%d.1/10.77.%d.2/%d" % (i + 1, i + 1, 5100 + i)
                          for i in range(rails)],
                         check=True, capture_output=True, text=True).stdout
    for r in receivers:
        assert r.wait(30) == 0
    return float(out.strip())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ferryd")
    p.add_argument("--mib", type=int, default=96)
    p.add_argument("--mbit", type=int, default=400)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rails", default="1,2,4")
    p.add_argument("--delta_densities", default="",
                   help="delta versions (issue 42): after the rail counts, "
                        "on --delta_rails rails, versions changing each "
                        "fraction of the elements (e.g. 0.01,0.05,1), "
                        "against a dense run in the same invocation")
    p.add_argument("--delta_rails", type=int, default=1)
    args = p.parse_args()
    why = netns_rails.unavailable()
    if why:
        sys.exit("rails_bench: " + why)
    ferryd = os.path.abspath(args.ferryd)
    counts = [int(x) for x in args.rails.split(",")]
    print("rails_bench: %d MiB a version, rails of %d Mbit/s (tc tbf), "
          "median of %d versions" % (args.mib, args.mbit, args.runs))
    print("%6s %10s %10s %10s %10s %10s %10s %10s" % (
        "rails", "median s", "min s", "max s", "raw s", "vs raw", "bound s",
        "vs bound"))
    with netns_rails.RailNet(rails=max(counts), mbit=args.mbit) as net:
        for k in counts:
            times = one_count(ferryd, net, k, args.mib, args.runs)
            raw = statistics.median(
                [raw_seconds(net, k, args.mib << 20) for _ in range(3)])
            bound = (args.mib << 20) * 8 / (k * args.mbit * 1e6)
            med = statistics.median(times)
            print("%6d %10.3f %10.3f %10.3f %10.3f %9.2fx %10.3f %9.2fx" % (
                k, med, min(times), max(times), raw, med / raw, bound,
                med / bound))
            sys.stdout.flush()
        densities = [float(x) for x in args.delta_densities.split(",") if x]
        if densities:
            k = args.delta_rails
            dense = statistics.median(one_count(ferryd, net, k, args.mib, args.runs))
            print("delta versions on %d rail(s): dense %.3f s a version" % (k, dense))
            print("%9s %10s %10s %10s %12s %10s" % ("density", "median s", "min s",
                                                   "max s", "wire MiB", "vs dense"))
            for d in densities:
                wire = []
                times = one_count(ferryd, net, k, args.mib, args.runs, d, wire)
                med = statistics.median(times)
                print("%8.1f%% %10.3f %10.3f %10.3f %12.1f %9.2fx" % (
                    d * 100, med, min(times), max(times),
                    statistics.median(wire) / (1 << 20), med / dense))
                sys.stdout.flush()


if __name__ == "__main__":
    main()
