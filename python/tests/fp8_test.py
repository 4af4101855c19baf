"""FP8 in flight from Python (issue 40), against the real ferryd.

An engine rank declares its live FP8 weight with ferry.Fp8 (the weight held
as uint8 where this torch has no float8 dtype): a declaration that breaks
the rules is refused at registration with INVALID_ARGUMENT naming the
parameter; a valid one registers, and, since ferryd resolves FP8 in flight
but does not move quantized bytes yet, the instance is aborted at the
version with that reason and none of its bytes is written."""

import os
import shutil
import subprocess
import sys
import tempfile

import grpc
import torch

import ferry


class Engine(ferry.EngineCallbacks):
    def on_apply(self, v, fallback):
        raise AssertionError("nothing falls back here: %s" % [n for n, _ in fallback])


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
    tmp = tempfile.mkdtemp(prefix="ferry-fp8-", dir="/tmp")
    sock = os.path.join(tmp, "ferryd.sock")
    daemon = subprocess.Popen([ferryd, "--socket=" + sock, "--listen=",
                               "--node=pytest-fp8", "--logtostderr"])
    clients = []
    try:
        conn = ferry.connect(sock)
        src_arena = ferry.SharedTensorArena("pytest.fp8src", 1 << 20)
        W = src_arena.tensor((256, 256), torch.bfloat16)
        W.copy_(torch.randn(256, 256) * 0.02)
        src = ferry.SourceClient.register(conn, "policy", 0, 1, src_arena,
                                          [(W, ferry.Shard("w", (256, 256)))])
        clients.append(src)

        arena = ferry.SharedTensorArena("pytest.fp8dst", 1 << 20)
        weight = fp8_tensor(arena, (256, 256))
        good_scale = arena.tensor((2, 2), torch.float32)
        bad_scale = arena.tensor((2, 1), torch.float32)

        def params(scale):
            return [ferry.EngineParam("m.w", weight, ferry.REPLICATED, consumes=["w"],
                                      fp8=ferry.Fp8("m.w_scale_inv")),
                    ferry.EngineParam("m.w_scale_inv", scale, ferry.CUSTOM)]

        try:
            ferry.DestinationClient.register(conn, "fp8", "policy", 0, 1, arena,
                                             params(bad_scale), Engine())
            raise AssertionError("a scale tensor of the wrong shape was accepted")
        except ferry.FerryError as e:
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e
            assert "engine parameter m.w (FP8, scales in m.w_scale_inv)" in e.details, e
            assert "has shape [2, 1]" in e.details and "need [2, 2]" in e.details, e

        dst = ferry.DestinationClient.register(conn, "fp8", "policy", 0, 1, arena,
                                               params(good_scale), Engine())
        clients.append(dst)
        before = weight.view(torch.uint8).clone(), good_scale.clone()
        out = src.publish(1)
        status = out.by_instance()["fp8"]
        assert status.state == ferry.ABORTED, out.summary()
        assert "m.w on tp rank 0 resolves quantized: bf16 -> fp8 e4m3, 128x128 " \
               "blocks" in status.abort_reason, status.abort_reason
        assert "does not move quantized bytes yet" in status.abort_reason, status
        assert torch.equal(weight.view(torch.uint8), before[0])
        assert torch.equal(good_scale, before[1])
        print("fp8_test: OK")
    finally:
        for c in reversed(clients):
            c.close()
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
