"""FP8 in flight from Python (issue 40), against the real ferryd.

A bf16 trainer rank and an FP8 engine instance (TP 2, the weight column-
parallel) that declares its live FP8 weight with ferry.Fp8 (held as uint8
where this torch has no float8 dtype). A declaration that breaks the rules
is refused at registration with INVALID_ARGUMENT naming the parameter. A
valid one commits every version with every FP8 byte and scale as the rule
says: the oracle here is the rule written again with numpy (each byte's
value decoded from the format, the nearest one searched, ties to the even
byte), applied to the trainer's whole tensor; the dequantized weights are
within the format's rounding of the trainer's; ExplainPlan says
RESOLUTION_QUANTIZED and the engine's loader is never called. A replica
registered late commits the next version with the same bytes (relayed:
FP8 bytes and scales forwarded)."""

import sys

import grpc
import numpy as np
import torch

import ferry
import ferryd_process
from fp8_oracle import e4m3_values, oracle


class Engine(ferry.EngineCallbacks):
    def on_apply(self, v, fallback):
        # Nothing reaches the engine's loader: the FP8 weight is quantized
        # in flight, straight into live memory.
        assert not fallback, "fell back: %s" % [n for n, _ in fallback]


class Loader(ferry.EngineCallbacks):
    """An engine whose loader transforms its FP8 weight (as vLLM's MLA
    does kv_b_proj): it is handed the FP8 tensor and its scales whole."""

    def __init__(self):
        self.loaded = {}

    def on_apply(self, v, fallback):
        self.loaded = {n: t.clone() for n, t in fallback}


def fp8_tensor(arena, shape):
    dtype = getattr(torch, "float8_e4m3fn", None) or torch.uint8
    return arena.tensor(shape, dtype)


def check_proto():
    """The declaration on the wire: scale name and block; uint8 storage
    declares the format's dtype."""
    arena = ferry.SharedTensorArena("pytest.fp8proto", 1 << 20)
    w = arena.tensor((256, 256), torch.uint8)
    p = ferry.EngineParam("m.w", w, ferry.REPLICATED, consumes=["w"],
                          fp8=ferry.Fp8("m.w_scale_inv", block=(128, 64),
                                        format="e5m2")).to_proto(1, 0, 1)
    assert p.dtype == ferry.types_pb2.DTYPE_F8_E5M2, p
    assert p.fp8.scale_parameter == "m.w_scale_inv", p
    assert (p.fp8.block_rows, p.fp8.block_cols) == (128, 64), p
    for bad in (dict(scale=""), dict(scale="s", block=(0, 128)),
                dict(scale="s", format="e3m4")):
        try:
            ferry.Fp8(**bad)
            raise AssertionError("ferry.Fp8(%s) was accepted" % bad)
        except ValueError:
            pass


def main():
    check_proto()
    ferryd = sys.argv[1]
    with ferryd_process.Ferryd(ferryd, "pytest-fp8") as d:
        clients = d.clients
        conn = ferry.connect(d.sock)
        src_arena = ferry.SharedTensorArena("pytest.fp8src", 1 << 20)
        W = src_arena.tensor((256, 256), torch.bfloat16)
        W.copy_(torch.randn(256, 256) * 0.02)
        src = ferry.SourceClient.register(conn, "policy", 0, 1, src_arena,
                                          [(W, ferry.Shard("w", (256, 256)))])
        clients.append(src)

        arenas = [ferry.SharedTensorArena("pytest.fp8dst%d" % r, 1 << 20)
                  for r in range(2)]
        weights = [fp8_tensor(a, (128, 256)) for a in arenas]
        scales = [a.tensor((1, 2), torch.float32) for a in arenas]
        bad_scale = arenas[0].tensor((2, 1), torch.float32)

        def params(r, scale):
            return [ferry.EngineParam("m.w", weights[r], ferry.COLUMN, shard_dim=0,
                                      consumes=["w"], fp8=ferry.Fp8("m.w_scale_inv")),
                    ferry.EngineParam("m.w_scale_inv", scale, ferry.CUSTOM)]

        try:
            ferry.DestinationClient.register(conn, "fp8", "policy", 0, 2, arenas[0],
                                             params(0, bad_scale), Engine())
            raise AssertionError("a scale tensor of the wrong shape was accepted")
        except ferry.FerryError as e:
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e
            assert "engine parameter m.w (FP8, scales in m.w_scale_inv)" in e.details, e
            assert "has shape [2, 1]" in e.details and "need [1, 2]" in e.details, e

        dsts = [ferry.DestinationClient.register(conn, "fp8", "policy", r, 2, arenas[r],
                                                 params(r, scales[r]), Engine())
                for r in range(2)]
        clients.extend(dsts)
        values = e4m3_values()
        for v in (1, 2):
            W.copy_(torch.randn(256, 256) * 0.02 * v)
            W[3, 5] = 5.0 * v  # one block with an outlier
            W[200, 1] = 0.0
            out = src.publish(v)
            assert out.all_committed(), out.summary()
            want_q, want_s = oracle(W.float().numpy())
            for r in range(2):
                got_q = weights[r].view(torch.uint8).numpy()
                assert np.array_equal(got_q, want_q[128 * r:128 * (r + 1)]), (
                    v, r, int((got_q != want_q[128 * r:128 * (r + 1)]).sum()))
                assert np.array_equal(scales[r].numpy(), want_s[r:r + 1]), (v, r)
                # Dequantized: within e4m3's rounding of the trainer's bf16.
                codes = got_q.astype(np.int64)
                mag = values[np.minimum(codes & 0x7F, len(values) - 1)]
                deq = np.where(codes & 0x80, -mag, mag) * np.repeat(
                    np.repeat(scales[r].numpy(), 128, 0), 128, 1)
                x = W.float().numpy()[128 * r:128 * (r + 1)]
                bound = np.maximum(np.abs(x) / 16,
                                   np.repeat(np.repeat(scales[r].numpy(), 128, 0),
                                             128, 1) * 2.0 ** -10) * 1.0001
                assert (np.abs(deq - x) <= bound).all(), (v, r)
        # A replica registered late is bootstrapped from "fp8", which holds
        # version 2: FP8 bytes and scales for FP8 bytes and scales (the
        # donor holds no bf16, and the plan covers what it holds). In
        # version 3 it is relayed from "fp8" or fed by the quantizer; both
        # then hold the rule's bytes.
        want_q, want_s = oracle(W.float().numpy())  # still version 2
        arenas_b = [ferry.SharedTensorArena("pytest.fp8b%d" % r, 1 << 20)
                    for r in range(2)]
        weights_b = [fp8_tensor(a, (128, 256)) for a in arenas_b]
        scales_b = [a.tensor((1, 2), torch.float32) for a in arenas_b]
        for r in range(2):
            p = [ferry.EngineParam("m.w", weights_b[r], ferry.COLUMN, shard_dim=0,
                                   consumes=["w"], fp8=ferry.Fp8("m.w_scale_inv")),
                 ferry.EngineParam("m.w_scale_inv", scales_b[r], ferry.CUSTOM)]
            clients.append(ferry.DestinationClient.register(
                conn, "fp8b", "policy", r, 2, arenas_b[r], p, Engine()))
        late = clients[-2:]
        for r, c in enumerate(late):
            c.wait_committed(2, 20)
            assert np.array_equal(weights_b[r].view(torch.uint8).numpy(),
                                  want_q[128 * r:128 * (r + 1)]), r
            assert np.array_equal(scales_b[r].numpy(), want_s[r:r + 1]), r
        W.copy_(torch.randn(256, 256) * 0.03)
        out = src.publish(3)
        assert out.all_committed() and len(out.instances) == 2, out.summary()
        want_q, want_s = oracle(W.float().numpy())
        for ws, ss in ((weights, scales), (weights_b, scales_b)):
            for r in range(2):
                assert np.array_equal(ws[r].view(torch.uint8).numpy(),
                                      want_q[128 * r:128 * (r + 1)]), r
                assert np.array_equal(ss[r].numpy(), want_s[r:r + 1]), r
        # An instance whose loader transforms the weight: FP8 elements and
        # scales of the whole tensor reach its loader, quantized by the
        # rule, under the checkpoint's and the scale tensor's names.
        arena_t = ferry.SharedTensorArena("pytest.fp8t", 1 << 20)
        loader = Loader()
        clients.append(ferry.DestinationClient.register(
            conn, "fp8t", "policy", 0, 1, arena_t,
            [ferry.EngineParam("m.w", fp8_tensor(arena_t, (256, 256)),
                               ferry.REPLICATED, consumes=["w"],
                               flags=[ferry.TRANSFORMED],
                               fp8=ferry.Fp8("m.w_scale_inv")),
             ferry.EngineParam("m.w_scale_inv",
                               arena_t.tensor((2, 2), torch.float32),
                               ferry.CUSTOM)], loader))
        W.copy_(torch.randn(256, 256) * 0.01)
        W[130, 7] = -3.0
        out = src.publish(4)
        assert out.all_committed() and len(out.instances) == 3, out.summary()
        want_q, want_s = oracle(W.float().numpy())
        assert sorted(loader.loaded) == ["m.w_scale_inv", "w"], sorted(loader.loaded)
        got = loader.loaded["w"]
        assert tuple(got.shape) == (256, 256) and got.element_size() == 1, got
        g = got.view(torch.uint8).numpy()
        assert np.array_equal(g, want_q), (int((g != want_q).sum()), g[:2, :8], want_q[:2, :8], loader.loaded["m.w_scale_inv"], want_s)
        assert loader.loaded["m.w_scale_inv"].dtype == torch.float32
        assert np.array_equal(loader.loaded["m.w_scale_inv"].numpy(), want_s)
        row = {p.name: p for p in conn.explain_plan("fp8t").parameters}["m.w"]
        assert row.resolution == ferry.inspection_pb2.RESOLUTION_QUANTIZED, row
        assert row.reason.startswith(
            "quantized, through the engine's loader: bf16 -> fp8 e4m3, "
            "128x128 blocks, the whole tensor ("), row.reason
        assert row.bytes == 256 * 256 + 4 * 4, row
        plan = conn.explain_plan("fp8")
        rows = {(p.name, p.tp_rank): p for p in plan.parameters}
        for r in range(2):
            w = rows[("m.w", r)]
            assert w.resolution == ferry.inspection_pb2.RESOLUTION_QUANTIZED, w
            assert w.reason.startswith("quantized: bf16 -> fp8 e4m3, 128x128 blocks; "
                                       "column shard of dim 0"), w.reason
            assert w.reason.endswith("; quantized on node pytest-fp8"), w.reason
            # FP8 bytes and scales, not bf16: 128 x 256 bytes and 2 floats.
            assert w.bytes == 128 * 256 + 2 * 4, w
        print("fp8_test: OK")


if __name__ == "__main__":
    main()
