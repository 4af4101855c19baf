"""A version of an FSDP trainer whose tensors span two nodes into an FP8
instance (issue 40, tensors split over trainer nodes), against the same
trainer with both ranks on one node, interleaved in one run.

    bazel run -c opt //bench/python:fp8_fsdp_bench -- [--tensors=8] [--runs=5]

Two real ferryd processes (this build's; A the coordinator, B a member,
mutual TLS on loopback). A bf16 trainer of 2 ranks, each holding a flat
shard (ferry.FlatShard) of every weight [4096, 4096] (32 MiB each), cut
at element 4096 * 1900 + 77: inside a 128-row block, so the blocks of
rows 1792-1919 have elements on both ranks. Stream "split": rank 0
registered through A, rank 1 through B (each node quantizes its part,
block amaxes combined through A). Stream "whole": both ranks through A (A
quantizes every tensor whole). Each feeds an FP8 TP 2 instance (e4m3,
128x128 blocks, column-parallel) on B. Begin to every rank committed, the
median and range of `runs` versions of each after one warm-up, the two
streams' versions alternating; memcpy of the trainer's bytes in the same
run. Every version's bytes are checked in the tests
(python/tests/fp8_fsdp_test.py), not here.
"""

import argparse
import os
import statistics
import sys
import threading
import time

import torch

import ferry

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "python", "tests"))
import ferryd_process  # noqa: E402

ROWS = COLS = 4096
CUT = 4096 * 1900 + 77


class Engine(ferry.EngineCallbacks):
    def on_apply(self, v, fallback):
        assert not fallback


def trainer(stream, conns, tensors):
    """Two ranks' flat shards of `tensors` weights; conns[r]: where rank r
    registers. Returns [(client, {name: 1-D tensor})]."""
    ranks = []
    n = ROWS * COLS
    for r in range(2):
        start, numel = (0, CUT) if r == 0 else (CUT, n - CUT)
        arena = ferry.SharedTensorArena("bench.fsdp-%s%d" % (stream, r),
                                        tensors * (numel * 2 + 4096) + (1 << 20))
        local, params = {}, []
        for t in range(tensors):
            name = "w%d" % t
            local[name] = arena.tensor((numel,), torch.bfloat16)
            local[name].copy_(torch.randn(numel) * 0.02)
            params.append((local[name], ferry.FlatShard(name, (ROWS, COLS), start, numel)))
        ranks.append((ferry.SourceClient.register(conns[r], stream, r, 2, arena, params),
                      arena))
    return ranks


def engine(stream, conn, tensors):
    clients = []
    for r in range(2):
        arena = ferry.SharedTensorArena("bench.fsdp-e%s%d" % (stream, r),
                                        (tensors * 9 << 20))
        params = []
        for t in range(tensors):
            w = arena.tensor((ROWS // 2, COLS), torch.uint8)
            s = arena.tensor((ROWS // 2 // 128, COLS // 128), torch.float32)
            params.append(ferry.EngineParam("w%d" % t, w, ferry.COLUMN, shard_dim=0,
                                            fp8=ferry.Fp8("w%d_scale_inv" % t)))
            params.append(ferry.EngineParam("w%d_scale_inv" % t, s, ferry.CUSTOM))
        clients.append(ferry.DestinationClient.register(
            conn, "fp8-" + stream, stream, r, 2, arena, params, Engine()))
    return clients


def version(ranks, v):
    """Begin to every rank committed, both ranks publishing at once."""
    out = [None, None]

    def publish(r):
        out[r] = ranks[r][0].publish(v)

    threads = [threading.Thread(target=publish, args=(r,)) for r in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    for o in out:
        assert o is not None and o.all_committed(), o and o.summary()
    return took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ferryd")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    ferryd = os.path.abspath(args.ferryd)
    with ferryd_process.Certs({"a": "127.0.0.1", "b": "127.0.0.1"}) as certs:
        with ferryd_process.Ferryd(ferryd, "a", "--listen=127.0.0.1:0",
                                   *certs.flags("a")) as a:
            with ferryd_process.Ferryd(
                    ferryd, "b", "--listen=127.0.0.1:0",
                    "--coordinator=127.0.0.1:%d" % a.port(),
                    *certs.flags("b")) as b:
                b.wait_joined()
                conn_a, conn_b = ferry.connect(a.sock), ferry.connect(b.sock)
                streams = {"split": trainer("split", [conn_a, conn_b], args.tensors),
                           "whole": trainer("whole", [conn_a, conn_a], args.tensors)}
                for s in streams:
                    b.clients.extend(engine(s, conn_b, args.tensors))
                for s, ranks in streams.items():
                    for c, _ in ranks:
                        (a if s == "whole" or c.rank == 0 else b).clients.append(c)
                times = {s: [] for s in streams}
                for v in range(1, args.runs + 2):
                    for s in streams:
                        took = version(streams[s], v)
                        if v > 1:  # the first version plans
                            times[s].append(took)
    nbytes = args.tensors * ROWS * COLS * 2
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    src.fill_(1)
    memcpy = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        memcpy.append(time.perf_counter() - t0)

    def fmt(xs):
        return "%.1f ms (%.1f-%.1f)" % (1e3 * statistics.median(xs), 1e3 * min(xs),
                                        1e3 * max(xs))

    print("fp8_fsdp_bench: %d bf16 weights [%d, %d] (%d MiB) from 2 FSDP ranks, "
          "into FP8 TP 2 on node b, %d versions each" % (
              args.tensors, ROWS, COLS, nbytes >> 20, args.runs))
    print("  memcpy of the trainer's bytes  %s" % fmt(memcpy))
    print("  ranks on a and b (split)       %s" % fmt(times["split"]))
    print("  both ranks on a (whole)        %s" % fmt(times["whole"]))
    print("  split / whole: %.2fx" % (statistics.median(times["split"]) /
                                       statistics.median(times["whole"])))


if __name__ == "__main__":
    main()
