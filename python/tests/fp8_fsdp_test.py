"""FP8 in flight from an FSDP trainer sharded over two nodes (issue 40),
against two real ferryd processes (A the coordinator, B a member, mutual
TLS on loopback).

The bf16 trainer has 2 ranks, rank 0 registered on A and rank 1 on B, each
holding a flat shard of every parameter (ferry.FlatShard: a 1-D tensor of
elements [start, start + numel) in row-major order, as FSDP keeps them),
cut mid-row inside a 128-row block: the blocks of that block row have
elements on both nodes. "w" [256, 384] is mostly on B, "v" [256, 256]
mostly on A, so each node keeps one tensor's scales. Two FP8 instances:
TP 1 on A, TP 2 (column-parallel) on B.

Checked for 3 versions: every FP8 byte and scale of both instances is the
rule's (numpy, tests/fp8_oracle.py, not ferry's routine) over the whole
trainer tensor; no bf16 crosses (ExplainPlan: FP8 bytes and scales only,
"split over trainer nodes"); the engines' loaders are never called. Also
FlatShard's boxes tile each shard exactly (a numpy check)."""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ferry  # noqa: E402
import ferryd_process  # noqa: E402
from fp8_oracle import oracle  # noqa: E402

SHAPES = {"w": (256, 384), "v": (256, 256)}
# Rank 0's elements of each: [0, cut); rank 1's the rest.
CUTS = {"w": 40017, "v": 45001}


class Engine(ferry.EngineCallbacks):
    def on_apply(self, v, fallback):
        assert not fallback, "fell back: %s" % [n for n, _ in fallback]


def check_flat_boxes():
    """Each FlatShard box, read from the 1-D shard at its first element
    row-major, is that box of the whole tensor; together they are the
    shard's elements, once each."""
    for shape in ((256, 384), (5, 7, 3), (10,)):
        n = int(np.prod(shape))
        full = np.arange(n).reshape(shape)
        mid = min(22, n - 1)
        for start, numel in ((0, n), (13 % n, n - 13 % n), (1, 1),
                             (mid, min(40, n - mid)), (n - 5, 5)):
            flat = full.reshape(-1)[start:start + numel]
            seen = 0
            for off, ext, first in ferry.FlatShard("x", shape, start, numel).boxes():
                count = int(np.prod(ext))
                got = flat[first:first + count].reshape(ext)
                want = full[tuple(slice(o, o + e) for o, e in zip(off, ext))]
                assert np.array_equal(got, want), (shape, start, numel, off, ext)
                seen += count
            assert seen == numel, (shape, start, numel, seen)
            assert len(ferry.FlatShard("x", shape, start, numel).boxes()) <= (
                2 * len(shape) - 1)
    # What the docs promise: a ValueError for a range outside the parameter,
    # and for a local tensor that is not the shard's 1-D elements.
    for start, numel in ((-1, 4), (0, 0), (100, 1)):
        try:
            ferry.FlatShard("x", (10, 10), start, numel)
            raise AssertionError("FlatShard(%d, %d) accepted" % (start, numel))
        except ValueError as e:
            assert "outside the 100 of (10, 10)" in str(e), e
    shard = ferry.FlatShard("x", (10, 10), 5, 20)
    for bad in (torch.zeros(4, 5), torch.zeros(21), torch.zeros(40)[::2]):
        try:
            ferry.layout.pieces_for_tensor(bad, shard, 0, 0)
            raise AssertionError("a local tensor of %s accepted" % (tuple(bad.shape),))
        except ValueError as e:
            assert "must be 1-D, contiguous and hold its 20 elements" in str(e), e
    try:
        ferry.layout.pieces_for_tensor(torch.zeros(20), [shard, shard], 0, 0)
        raise AssertionError("a FlatShard as one of several parts accepted")
    except ValueError as e:
        assert "describes its local tensor alone" in str(e), e


def fp8_tensor(arena, shape):
    dtype = getattr(torch, "float8_e4m3fn", None) or torch.uint8
    return arena.tensor(shape, dtype)


def main():
    check_flat_boxes()
    ferryd = os.path.abspath(sys.argv[1])
    with ferryd_process.Certs({"a": "127.0.0.1", "b": "127.0.0.1"}) as certs:
        with ferryd_process.Ferryd(ferryd, "a", "--listen=127.0.0.1:0",
                                   *certs.flags("a")) as a:
            with ferryd_process.Ferryd(
                    ferryd, "b", "--listen=127.0.0.1:0",
                    "--coordinator=127.0.0.1:%d" % a.port(), *certs.flags("b")) as b:
                b.wait_joined()
                run(a, b)
    print("fp8_fsdp_test: OK")


def run(a, b):
    conn = {"a": ferry.connect(a.sock), "b": ferry.connect(b.sock)}
    # The trainer: rank 0 through A, rank 1 through B.
    shards = []  # by rank: {name: 1-D bf16 tensor}
    for rank, node, d in ((0, "a", a), (1, "b", b)):
        arena = ferry.SharedTensorArena("pytest.fsdp-src%d" % rank, 1 << 20)
        local, params = {}, []
        for name, shape in SHAPES.items():
            n = int(np.prod(shape))
            start, numel = (0, CUTS[name]) if rank == 0 else (CUTS[name], n - CUTS[name])
            local[name] = arena.tensor((numel,), torch.bfloat16)
            params.append((local[name], ferry.FlatShard(name, shape, start, numel)))
        src = ferry.SourceClient.register(conn[node], "policy", rank, 2, arena, params)
        d.clients.append(src)
        shards.append((src, local))

    # TP 1 on A (both weights), TP 2 on B (column-parallel halves).
    engines = {}  # instance -> [(rank, {name: (weight, scale)})]
    for inst, node, d, tp in (("fp8-a", "a", a, 1), ("fp8-b", "b", b, 2)):
        for r in range(tp):
            arena = ferry.SharedTensorArena("pytest.fsdp-%s%d" % (inst, r), 1 << 20)
            held, params = {}, []
            for name, (rows, cols) in SHAPES.items():
                w = fp8_tensor(arena, (rows // tp, cols))
                s = arena.tensor((rows // tp // 128, cols // 128), torch.float32)
                held[name] = (w, s)
                params += [ferry.EngineParam("m." + name, w, ferry.COLUMN if tp > 1
                                             else ferry.REPLICATED, shard_dim=0,
                                             consumes=[name],
                                             fp8=ferry.Fp8("m.%s_scale_inv" % name)),
                           ferry.EngineParam("m.%s_scale_inv" % name, s, ferry.CUSTOM)]
            d.clients.append(ferry.DestinationClient.register(
                conn[node], inst, "policy", r, tp, arena, params, Engine()))
            engines.setdefault(inst, []).append((r, tp, held))

    gen = torch.Generator().manual_seed(7)
    for version in (1, 2, 3):
        whole = {}
        for name, shape in SHAPES.items():
            x = torch.randn(shape, generator=gen) * 0.02 * version
            x[3, 5] = 4.0 * version       # an outlier in block row 0
            x[100, 200 % shape[1]] = -0.0
            whole[name] = x.to(torch.bfloat16)
            flat = whole[name].reshape(-1)
            shards[0][1][name].copy_(flat[:CUTS[name]])
            shards[1][1][name].copy_(flat[CUTS[name]:])
        outcomes = [None, None]

        def publish(rank):
            outcomes[rank] = shards[rank][0].publish(version)

        threads = [threading.Thread(target=publish, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for out in outcomes:
            assert out is not None and out.all_committed(), (
                version, out and out.summary())
            assert len(out.instances) == 2, out.summary()
        for name in SHAPES:
            want_q, want_s = oracle(whole[name].float().numpy())
            for inst, ranks in engines.items():
                for r, tp, held in ranks:
                    w, s = held[name]
                    rows = SHAPES[name][0] // tp
                    got = w.view(torch.uint8).numpy()
                    want = want_q[rows * r:rows * (r + 1)]
                    assert np.array_equal(got, want), (
                        version, inst, r, name, int((got != want).sum()))
                    assert np.array_equal(
                        s.numpy(), want_s[rows * r // 128:rows * (r + 1) // 128]), (
                        version, inst, r, name)

    plan = conn["a"].explain_plan("fp8-b")
    rows = {(p.name, p.tp_rank): p for p in plan.parameters}
    for name, (nrows, cols) in SHAPES.items():
        for r in range(2):
            row = rows[("m." + name, r)]
            assert row.resolution == ferry.inspection_pb2.RESOLUTION_QUANTIZED, row
            assert "; split over trainer nodes, quantized on a, b with block " \
                   "amaxes combined, scales on %s" % ("b" if name == "w" else "a") \
                   in row.reason, row.reason
            # FP8 bytes and scales only: no bf16 of the trainer crossed.
            assert row.bytes == nrows // 2 * cols + (nrows // 2 // 128) * (cols // 128) * 4, row


if __name__ == "__main__":
    main()
