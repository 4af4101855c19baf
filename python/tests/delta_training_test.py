"""Delta versions from a real training loop: a small MLP trained with Adam
on fp32 master weights, its bf16 copy published after every step from
ferryd A (coordinator, --delta_shadow_mb) to an engine instance on ferryd
B (member; both on loopback with mutual TLS), so every byte crosses a TCP
channel between two daemons.

Checked per step: the engine's bf16 weights equal the published copy byte
for byte, and its logits on a fixed batch equal the trainer's bf16 model's
exactly. Reported per step (and checked from step 2 on): the fraction of
bf16 elements that changed (GetProgress: changed / patched bytes), and the
bytes saved on the wire. Adam's steps at RL's learning rates (1e-6) move most fp32
weights by less than half a bf16 step, so most bf16 weights do not change.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ferry  # noqa: E402
import ferryd_process  # noqa: E402

STEPS = 8
SHAPES = {"fc1.weight": (512, 256), "fc1.bias": (512,),
          "fc2.weight": (64, 512), "fc2.bias": (64,)}


class Engine(ferry.EngineCallbacks):
    def on_apply(self, v, fallback):
        assert not fallback


def forward(p, x):
    h = torch.relu(x @ p["fc1.weight"].float().t() + p["fc1.bias"].float())
    return h @ p["fc2.weight"].float().t() + p["fc2.bias"].float()


def main():
    ferryd = os.path.abspath(sys.argv[1])
    with ferryd_process.Certs({"a": "127.0.0.1", "b": "127.0.0.1"}) as certs:
        with ferryd_process.Ferryd(ferryd, "a", "--listen=127.0.0.1:0",
                                   "--delta_shadow_mb=64", *certs.flags("a")) as a:
            with ferryd_process.Ferryd(
                    ferryd, "b", "--listen=127.0.0.1:0",
                    "--coordinator=127.0.0.1:%d" % a.port(), *certs.flags("b")) as b:
                b.wait_joined()
                run(a, b)
    print("delta_training_test: OK")
    return 0


def run(a, b):
    torch.manual_seed(0)
    master = {n: torch.nn.Parameter(torch.randn(s) * 0.05) for n, s in SHAPES.items()}
    opt = torch.optim.Adam(master.values(), lr=1e-6)  # RL post-training
    x = torch.randn(128, 256)
    target = torch.randn(128, 64)

    conn_a, conn_b = ferry.connect(a.sock), ferry.connect(b.sock)
    src_arena = ferry.SharedTensorArena("pytest.delta-src", 2 << 20)
    pub = {n: src_arena.tensor(s, torch.bfloat16) for n, s in SHAPES.items()}
    src = ferry.SourceClient.register(conn_a, "policy", 0, 1, src_arena,
                                      [(t, ferry.Shard(n, t.shape)) for n, t in pub.items()])
    a.clients.append(src)
    dst_arena = ferry.SharedTensorArena("pytest.delta-dst", 2 << 20)
    live = {n: dst_arena.tensor(s, torch.bfloat16) for n, s in SHAPES.items()}
    b.clients.append(ferry.DestinationClient.register(
        conn_b, "engine", "policy", 0, 1, dst_arena,
        [ferry.EngineParam("m." + n, t, ferry.REPLICATED, consumes=[n])
         for n, t in live.items()], Engine()))
    total = sum(t.numel() * 2 for t in pub.values())
    print("step  changed  wire/bytes  (model %d bytes of bf16)" % total)
    for step in range(1, STEPS + 1):
        if step > 1:  # one Adam step on the fp32 master weights
            opt.zero_grad()
            loss = ((forward(master, x) - target) ** 2).mean()
            loss.backward()
            opt.step()
        with torch.no_grad():
            for n in SHAPES:
                pub[n].copy_(master[n])  # the bf16 weights the engines serve
        out = src.publish(step)
        assert out.all_committed(), out.summary()
        for n in SHAPES:
            assert np.array_equal(pub[n].view(torch.int16).numpy(),
                                  live[n].view(torch.int16).numpy()), (step, n)
        assert torch.equal(forward(pub, x), forward(live, x)), step
        p = conn_a.inspection.GetProgress(ferry.inspection_pb2.GetProgressRequest(
            stream="policy", version=step)).instances[0]
        wire = p.bytes_moved - p.patched_bytes + p.patch_bytes
        density = p.changed_bytes / p.patched_bytes if p.patched_bytes else 1.0
        print("%4d  %6.2f%%  %9.1f%%" % (step, 100 * density,
                                          100.0 * wire / p.bytes_moved))
        if step >= 2:
            # Adam at lr 1e-6 on weights of ~0.05 moves most fp32 values by
            # less than half a bf16 step: few bf16 elements change.
            assert p.patched_bytes > 0, p
            assert density < 0.1, (step, density)
            assert wire < p.bytes_moved, p


if __name__ == "__main__":
    sys.exit(main())
