"""One version of a bf16 trainer into an FP8 instance, begin to committed,
against the same into a bf16 instance and memcpy of the trainer's bytes,
in the same run (issue 40's benchmark).

    bazel run -c opt //bench/python:fp8_update_bench -- [--tensors=8] [--runs=7]

A real ferryd (this build's) on a unix socket; one bf16 trainer rank with
`tensors` weights of [4096, 4096] (32 MiB each) in shared memory; an
instance of TP 4 (each weight column-parallel, 1024 rows a rank), first in
bf16 (every byte direct), then in FP8 e4m3 with 128x128 block scales
(quantized in flight on ferryd's node). Median and range of `runs`
versions each, after one warm-up version.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

import ferry

# The tests' ferryd launcher (python/tests/ferryd_process.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "python", "tests"))
import ferryd_process  # noqa: E402


class Engine(ferry.EngineCallbacks):
    def on_apply(self, v, fallback):
        assert not fallback


def instance(conn, name, tp, tensors, fp8):
    clients = []
    for r in range(tp):
        arena = ferry.SharedTensorArena("bench.%s%d" % (name, r), (tensors * 32 // tp + 4) << 20)
        params = []
        for t in range(tensors):
            if fp8:
                w = arena.tensor((4096 // tp, 4096), torch.uint8)
                s = arena.tensor((4096 // tp // 128, 32), torch.float32)
                params.append(ferry.EngineParam("w%d" % t, w, ferry.COLUMN, shard_dim=0,
                                                fp8=ferry.Fp8("w%d_scale_inv" % t)))
                params.append(ferry.EngineParam("w%d_scale_inv" % t, s, ferry.CUSTOM))
            else:
                w = arena.tensor((4096 // tp, 4096), torch.bfloat16)
                params.append(ferry.EngineParam("w%d" % t, w, ferry.COLUMN, shard_dim=0))
        clients.append(ferry.DestinationClient.register(conn, name, "policy", r, tp, arena,
                                                        params, Engine()))
    return clients


def timed(src, first, runs):
    times = []
    for v in range(first, first + runs + 1):
        t0 = time.perf_counter()
        out = src.publish(v)
        took = time.perf_counter() - t0
        assert out.all_committed(), out.summary()
        if v > first:
            times.append(took * 1e3)
    return times


def line(what, times, base):
    med = statistics.median(times)
    return "  %-26s median %7.1f ms (%.1f-%.1f)%s" % (
        what, med, min(times), max(times),
        "" if base is None else ", %.2fx of memcpy's time" % (med / base))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ferryd")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tp", type=int, default=4)
    a = ap.parse_args()
    with ferryd_process.Ferryd(a.ferryd, "bench") as d:
        clients = d.clients
        conn = ferry.connect(d.sock)
        arena = ferry.SharedTensorArena("bench.src", (a.tensors * 32 + 4) << 20)
        ws = [arena.tensor((4096, 4096), torch.bfloat16) for _ in range(a.tensors)]
        for w in ws:
            w.copy_(torch.randn(4096, 4096) * 0.02)
        src = ferry.SourceClient.register(conn, "policy", 0, 1, arena,
                                          [(w, ferry.Shard("w%d" % t, (4096, 4096)))
                                           for t, w in enumerate(ws)])
        clients.append(src)
        total = a.tensors * 4096 * 4096 * 2
        buf = np.empty(total, np.uint8)
        srcbuf = np.ones(total, np.uint8)
        mem = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            np.copyto(buf, srcbuf)
            mem.append((time.perf_counter() - t0) * 1e3)
        base = statistics.median(mem)
        dsts = instance(conn, "bf16", a.tp, a.tensors, fp8=False)
        bf16 = timed(src, 1, a.runs)
        for d in dsts:
            d.close()
        dsts = instance(conn, "fp8", a.tp, a.tensors, fp8=True)
        clients.extend(dsts)
        fp8 = timed(src, 100, a.runs)
        print("fp8_update_bench: %d bf16 weights [4096, 4096] (%d MiB) -> TP %d, %d versions"
              % (a.tensors, total >> 20, a.tp, a.runs))
        print(line("memcpy of the trainer's", mem, None))
        print(line("bf16 -> bf16 instance", bf16, base))
        print(line("bf16 -> FP8 instance", fp8, base))
        print("  FP8 / bf16: %.2fx" % (statistics.median(fp8) / statistics.median(bf16)))


if __name__ == "__main__":
    main()
