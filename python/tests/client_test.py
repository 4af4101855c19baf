"""Python client against the real ferryd: one source rank, one TP-2 instance
whose ranks (threads here) receive a column-split weight directly, a
replicated norm directly, and a flagged bias as a fallback tensor through
staging. Two versions; every live byte is checked. Then the Lifecycle
calls: load options (read, a bad value refused), ReloadInPlace refused with
no peer, and SwapModel of both ranks to another stream, whose next version
lands. Also unit-checks pieces.

Usage: client_test.py FERRYD_BINARY
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import grpc
import torch

import ferry


def check_pieces():
    t = torch.zeros(6, 4)
    # A fused tensor: 4 rows of q then 2 rows of k, rank 1 of 2.
    pieces = ferry.layout.pieces_for_tensor(
        t, [ferry.Shard("q", (8, 4), dim=0, rank=1, world=2),
            ferry.Shard("k", (4, 4), dim=0, rank=1, world=2)], 3, 512)
    assert [p.parameter for p in pieces] == ["q", "k"]
    assert list(pieces[0].box.offset) == [4, 0] and list(pieces[0].box.extent) == [4, 4]
    assert list(pieces[1].box.offset) == [2, 0] and list(pieces[1].box.extent) == [2, 4]
    assert pieces[0].byte_offset == 512 and pieces[1].byte_offset == 512 + 4 * 4 * 4
    # Row parallel: a column block of a [4, 8] parameter.
    p, = ferry.layout.pieces_for_tensor(
        torch.zeros(4, 4), ferry.Shard("o", (4, 8), dim=1, rank=1, world=2), 0, 0)
    assert list(p.box.offset) == [0, 4] and list(p.strides) == [4, 1]
    try:
        ferry.layout.pieces_for_tensor(torch.zeros(3, 4), ferry.Shard("q", (8, 4), 0, 0, 2), 0, 0)
        raise AssertionError("a wrong local shape was accepted")
    except ValueError:
        pass


class Rank(ferry.EngineCallbacks):
    """Engine rank r of the TP-2 instance: its loader takes the fallback
    bias."""

    def __init__(self, r, live, loaded):
        self.r, self.live, self.loaded = r, live, loaded

    def on_apply(self, v, fallback):
        names = [n for n, _ in fallback]
        assert names == ["b"], names
        r = self.r
        self.live["b"].copy_(fallback[0][1][4 * r:4 * r + 4])  # the engine's loader
        self.loaded[(r, v)] = True


def check_api_offline():
    """Constructors validate and build, with no RPC (no daemon here);
    register()/open() do the call; the base callbacks' behaviour."""
    conn = ferry.Connection("/nonexistent/ferryd.sock")
    arena = ferry.SharedTensorArena("pytest.offline", 1 << 12)
    w = arena.tensor((4, 4))
    src = ferry.SourceClient(conn, "policy", 0, 1, arena, [(w, ferry.Shard("w", (4, 4)))])
    assert not src.registered and len(src.registration.pieces) == 1
    try:
        src.publish(1)
        raise AssertionError("publish before open() was accepted")
    except ferry.FerryError as e:
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
    dst = ferry.DestinationClient(conn, "inst", "policy", 0, 1, arena,
                                  [ferry.EngineParam("w", w, ferry.REPLICATED)])
    assert not dst.registered
    # A host rank's fallback tensors are staged in host memory; its live
    # tensors can be rebuilt at their registered places (after an onload).
    assert dst.registration.staging == ferry.registration_pb2.STAGING_PLACEMENT_HOST
    again = dst.live_tensor("w")
    assert again.data_ptr() == w.data_ptr() and again.shape == w.shape
    del again
    dst.close()  # never opened: nothing to deregister
    for staging, said in (("device", "staging 'device' needs"),
                          ("gpu", "is not auto, device or host")):
        try:
            ferry.DestinationClient(conn, "inst", "policy", 0, 1, arena,
                                    [ferry.EngineParam("w", w, ferry.REPLICATED)],
                                    staging=staging)
            raise AssertionError("staging %r accepted for host memory" % staging)
        except ValueError as e:
            assert said in str(e) and "instance inst tp rank 0" in str(e), e
    # Without a GPU, CUDA memory is unavailable and says why.
    from ferry import cuda as ferry_cuda
    ok, why = ferry_cuda.available()
    if not torch.cuda.is_available():
        assert not ok and "CUDA" in why, why
    for bad in (dict(tp_rank=2), dict(callbacks=lambda v: None)):
        args = dict(tp_rank=0, callbacks=None)
        args.update(bad)
        try:
            ferry.DestinationClient(conn, "inst", "policy", args["tp_rank"], 2, arena,
                                    [ferry.EngineParam("w", w, ferry.REPLICATED)],
                                    args["callbacks"])
            raise AssertionError("accepted %s" % bad)
        except (ValueError, TypeError):
            pass
    try:  # a tensor outside every arena
        ferry.SourceClient(conn, "policy", 0, 1, arena,
                           [(torch.zeros(4, 4), ferry.Shard("w", (4, 4)))])
        raise AssertionError("a tensor outside the arena was accepted")
    except ValueError as e:
        assert "not inside any registered arena" in str(e), e
    base = ferry.EngineCallbacks()
    assert base.on_pause(1) is None and base.on_apply(1, []) is None
    for call in (lambda: base.on_adapter_apply("a", 1, "{}", []),
                 lambda: base.on_adapter_unload("a")):
        try:
            call()
            raise AssertionError("the base class served an adapter")
        except NotImplementedError as e:
            assert "on_adapter_" in str(e), e
    del w
    conn.close()


def check_tcp_needs_tls():
    try:
        ferry.Connection("127.0.0.1:1")
        raise AssertionError("a TCP connection without TLS files was opened")
    except ferry.FerryError as e:
        assert "mutual TLS" in str(e), str(e)


def check_socket_rule(ferryd, tmp):
    """ferryd started without --socket listens where connect() with no
    address looks, by $FERRY_SOCKET and else by $XDG_RUNTIME_DIR: the one
    rule (common/socket_path.h) that Python mirrors."""
    saved = {k: os.environ.get(k) for k in ("FERRY_SOCKET", "XDG_RUNTIME_DIR")}
    cases = [({"FERRY_SOCKET": os.path.join(tmp, "by-env.sock"),
               "XDG_RUNTIME_DIR": os.path.join(tmp, "unused")},
              os.path.join(tmp, "by-env.sock")),
             ({"FERRY_SOCKET": None, "XDG_RUNTIME_DIR": os.path.join(tmp, "xdg")},
              os.path.join(tmp, "xdg", "ferry", "ferryd.sock"))]
    try:
        for env, where in cases:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            daemon = subprocess.Popen([ferryd, "--listen=", "--node=pytest-env"],
                                      stderr=subprocess.DEVNULL)
            try:
                assert ferry.default_socket_path() == where, ferry.default_socket_path()
                conn = ferry.connect(timeout_s=20)  # no address: the rule
                health = conn.call("GetHealth", conn.inspection.GetHealth,
                                   ferry.inspection_pb2.GetHealthRequest())
                assert health.node == "pytest-env", health
                assert os.path.exists(where), where
                conn.close()
            finally:
                daemon.send_signal(signal.SIGTERM)
                daemon.wait(10)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    check_pieces()
    check_api_offline()
    check_tcp_needs_tls()
    ferryd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="ferry-py-", dir="/tmp")
    check_socket_rule(ferryd, tmp)
    sock = os.path.join(tmp, "ferryd.sock")
    daemon = subprocess.Popen([ferryd, "--socket=" + sock, "--listen=", "--node=pytest",
                               "--lease_ms=5000", "--ack_timeout_ms=20000",
                               "--version_timeout_ms=40000", "--logtostderr"])
    clients = []
    try:
        conn = ferry.connect(sock)
        w_src = ferry.SharedTensorArena("pytest.src", 1 << 16)
        W = w_src.tensor((8, 4))
        norm = w_src.tensor((4,))
        bias = w_src.tensor((8,))
        src = ferry.SourceClient.register(conn, "policy", 0, 1, w_src, [
            (W, ferry.Shard("w", (8, 4))), (norm, ferry.Shard("norm", (4,))),
            (bias, ferry.Shard("b", (8,)))])
        clients.append(src)
        loaded = {}
        ranks = []
        swap_args = []
        for r in range(2):
            arena = ferry.SharedTensorArena("pytest.dst%d" % r, 1 << 16)
            live = dict(w=arena.tensor((4, 4)), norm=arena.tensor((4,)),
                        b=arena.tensor((4,)))

            params = [
                ferry.EngineParam("m.w", live["w"], ferry.COLUMN, shard_dim=0,
                                  consumes=["w"]),
                ferry.EngineParam("n.norm", live["norm"], ferry.REPLICATED,
                                  consumes=["norm"]),
                ferry.EngineParam("x.b", live["b"], ferry.COLUMN,
                                  flags=[ferry.TRANSFORMED], consumes=["b"]),
            ]
            dst = ferry.DestinationClient.register(conn, "inst", "policy", r, 2, arena,
                                                   params, Rank(r, live, loaded))
            clients.append(dst)
            ranks.append((dst, live))
            swap_args.append((arena, params))
        for v in (1, 2):
            W.copy_(torch.arange(32, dtype=torch.float32).view(8, 4) * v)
            norm.fill_(v + 0.5)
            bias.copy_(torch.arange(8, dtype=torch.float32) - v)
            out = src.publish(v)
            assert out.all_committed(), out.summary()
            for r, (dst, live) in enumerate(ranks):
                dst.wait_committed(v, 20)
                assert torch.equal(live["w"], W[4 * r:4 * r + 4]), (v, r, live["w"])
                assert torch.equal(live["norm"], norm)
                assert torch.equal(live["b"], bias[4 * r:4 * r + 4])
                assert loaded.get((r, v))
            st = ranks[0][0].wait_for_version(v, 10)
            assert st.state == ferry.COMMITTED and st.committed_version == v, st
        streams = conn.list_streams()
        assert len(streams) == 1 and streams[0].latest_committed_version == 2

        # Load options: every key with its value; a bad value is refused.
        assert conn.get_config("inst") == {"load_format": "auto",
                                           "serve_as_peer": "true"}
        try:
            conn.update_config("inst", {"load_format": "sometimes"})
            raise AssertionError("a bad load_format was accepted")
        except ferry.FerryError as e:
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e
            assert "load_format" in e.details, e
        # No other instance holds version 2: nothing to reload from.
        try:
            conn.reload_in_place("inst")
            raise AssertionError("a reload without a peer was accepted")
        except ferry.FerryError as e:
            assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
            assert "no instance holds version 2" in e.details, e

        # SwapModel: both ranks move to stream "ref" (its own versions).
        r_src = ferry.SharedTensorArena("pytest.ref", 1 << 16)
        RW = r_src.tensor((8, 4))
        rnorm = r_src.tensor((4,))
        rbias = r_src.tensor((8,))
        ref_params = [(RW, ferry.Shard("w", (8, 4))), (rnorm, ferry.Shard("norm", (4,))),
                      (rbias, ferry.Shard("b", (8,)))]
        # A `with` block deregisters on exit: the same rank then registers
        # again without replace_existing.
        with ferry.SourceClient(conn, "ref", 0, 1, r_src, ref_params) as ref:
            assert ref.registered
        assert not ref.registered
        ref = ferry.SourceClient.register(conn, "ref", 0, 1, r_src, ref_params)
        clients.append(ref)
        errors = []

        def swap(dst, arena, params):
            try:
                dst.swap("ref", arena, params)
            except Exception as e:  # reported on the main thread
                errors.append(e)
        threads = [threading.Thread(target=swap, args=(d, a, p))
                   for (d, _), (a, p) in zip(ranks, swap_args)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        RW.copy_(torch.arange(32, dtype=torch.float32).view(8, 4) * 10)
        rnorm.fill_(7.25)
        rbias.copy_(torch.arange(8, dtype=torch.float32) * 3)
        out = ref.publish(5)
        assert out.all_committed() and len(out.instances) == 1, out.summary()
        for r, (dst, live) in enumerate(ranks):
            assert dst.stream == "ref"
            dst.wait_committed(5, 20)
            assert torch.equal(live["w"], RW[4 * r:4 * r + 4]), (r, live["w"])
            assert torch.equal(live["norm"], rnorm)
            assert torch.equal(live["b"], rbias[4 * r:4 * r + 4])
        print("client_test: OK")
    finally:
        for c in reversed(clients):
            c.close()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
