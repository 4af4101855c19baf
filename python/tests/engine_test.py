"""ferry.engine.EngineAdapter against the real ferryd, with the PyTorch
example's engine model (examples/tp_sync/model.py, host memory here; CUDA
on a GPU machine): a TP-1 trainer trains and publishes, and the adapter
binds vLLM's table for the model's config.json onto the engine's live
tensors by name.

- Versions land: the engine's logits equal the trainer's (max abs
  difference <= 1e-5) after every version.
- A forced fallback parameter (model.norm.weight, fallback=) and a
  parameter the table does not know (model.extra.weight, which the trainer
  declares) reach the engine's own load_weights, and ExplainPlan names each
  with its reason; lm_head padded by 64 vocabulary rows (not the table's
  shape) is still written directly (ferry proves the rows land right);
  everything else is direct.
- A second instance whose live down_proj has 8 padding columns (a shape
  ferry cannot write directly) gets it through its loader: explain names
  the shapes, the loaded columns equal the trainer's, the padding stays 0.
- The serving gate: a forward pass in flight holds PAUSE (the version
  cannot land under it), and the version lands once the pass ends.
- Offload with a host copy, then onload: the adapter hands the engine its
  fresh tensors and the logits are still the trainer's.

With --device=cuda (tests/gpu/device_check.sh, on a GPU machine) every
tensor of the trainer and both engines is a CUDA tensor on one GPU, with no
arena; the fallback tensors then arrive in device staging.

Usage: engine_test.py FERRYD_BINARY [--device=cpu|cuda]
"""

import os
import sys
import threading

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "tp_sync"))
sys.path.insert(0, HERE)

import ferry  # noqa: E402
import ferryd_process  # noqa: E402
import model as M  # noqa: E402
from ferry.engine import EngineAdapter  # noqa: E402

TOL = 1e-5
EXTRA = "model.extra.weight"


def main():
    ferryd = sys.argv[1]
    device = torch.device("cpu")
    for a in sys.argv[2:]:
        if a.startswith("--device="):
            device = M.device_of(a.split("=", 1)[1])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with ferryd_process.Ferryd(ferryd, "engine", "--lease_ms=5000", "--ack_timeout_ms=20000",
                               "--version_timeout_ms=40000") as d:
        run(d, device)


def run(d, device):
    """The test against ferryd `d`; clients and memory to close go in
    d.clients."""
    on_gpu = device.type == "cuda"
    sock = d.sock
    conn = ferry.connect(sock)
    tp = M.TP(0, 1)
    shapes = M.checkpoint_shapes()

    # The trainer: TP 1, its parameters plus one the vLLM table lacks.
    net = M.TrainerModel(M.base_checkpoint(), tp)
    net.params[EXTRA.replace(".", "__")] = torch.nn.Parameter(torch.randn(8))
    net.to(device)
    arena = None
    if not on_gpu:
        arena = ferry.arena_for_module(net, "engine-test.trainer")
        ferry.move_to_arena(net, arena)
        d.clients.append(arena)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    def sharding(name, p):
        ck = M.TrainerModel.checkpoint_name(name)
        return ferry.Shard(ck, tuple(p.shape) if ck == EXTRA else shapes[ck])
    src = ferry.SourceClient.from_module(conn, "policy", 0, 1, net, sharding, arena)
    d.clients.append(src)

    # The engine: the example's model, lm_head padded by 64 vocabulary
    # rows (as engines pad to a multiple), and an extra parameter.
    cfg = M.CONFIG
    nbytes = sum(4 * torch.Size(s).numel() for s in shapes.values()) * 2 + (1 << 20)
    def arena_or_gpu(hint):
        """An allocator of live tensors, and the arena it uses (None on
        a GPU: CUDA tensors are registered as they are)."""
        if on_gpu:
            return (lambda shape: torch.zeros(shape, device=device)), None
        a = ferry.SharedTensorArena(hint, nbytes)
        d.clients.append(a)
        return (lambda shape: a.tensor(shape)), a
    alloc, e_arena = arena_or_gpu("engine-test.engine")
    lm_shape = (cfg["vocab"] + 64, cfg["hidden"])
    engine = M.EngineModel(M.base_checkpoint(), tp, alloc)
    lm = alloc(lm_shape)
    lm[:cfg["vocab"]].copy_(engine.params["lm_head.weight"])
    engine.params["lm_head.weight"] = lm
    del lm  # the engine's dict is the one owner (offload drops it)
    engine.params[EXTRA] = alloc((8,))
    extra_seen = []
    base_load = engine.load_weights

    def load_weights(weights):
        rest = []
        for name, t in weights:
            if name == EXTRA:
                engine.params[EXTRA].copy_(t)
                extra_seen.append(t.clone())
            else:
                rest.append((name, t))
        base_load(rest)

    adapter = EngineAdapter(conn, "eng", 0, 1, engine.params, M.hf_config(),
                            arenas=e_arena, load_weights=load_weights,
                            fallback=["model.norm.weight"])
    placed = {n: p.kind for n, p in adapter.placement.items() if p.kind != "table"}
    assert placed == {"model.norm.weight": "forced", "lm_head.weight": "differs",
                      EXTRA: "unknown"}, placed
    # A second instance: layer 1's down_proj padded by 8 columns.
    DOWN = "model.layers.1.mlp.down_proj.weight"
    p_alloc, p_arena = arena_or_gpu("engine-test.padded")
    padded_engine = M.EngineModel(M.base_checkpoint(), tp, p_alloc)
    padded_engine.params[DOWN] = p_alloc((cfg["hidden"], cfg["intermediate"] + 8))
    padded = EngineAdapter(conn, "eng-pad", 0, 1, padded_engine.params,
                           M.hf_config(), arenas=p_arena,
                           load_weights=padded_engine.load_weights)
    assert padded.placement[DOWN].kind == "differs", padded.placement[DOWN]
    padded.open()
    d.clients.append(padded)
    adapter.open()
    d.clients.append(adapter)
    conn.wait_instances("policy", ["eng", "eng-pad"], sources=True)

    prompts = M.prompts().to(device)
    inputs, targets = (t.to(device) for t in M.corpus())

    def logits_diff():
        with torch.no_grad():
            want = net(prompts)
        with adapter.gate.serving(timeout_s=30):
            got = engine.forward(prompts)[..., :cfg["vocab"]]
        return (got - want).abs().max().item()

    def step():
        M.train_step(net, opt, inputs, targets)

    for v in (1, 2):
        step()
        out = src.publish(v)
        assert out.all_committed(), out.summary()
        adapter.wait_committed(v, 20)
        diff = logits_diff()
        assert diff <= TOL, "version %d: logits differ by %.3g" % (v, diff)
        assert sorted(adapter.loaded) == sorted([EXTRA, "model.norm.weight"]), \
            adapter.loaded
        assert torch.equal(extra_seen[-1], net.w(EXTRA).detach()), v
        padded.wait_committed(v, 20)
        assert padded.loaded == ["model.layers.1.mlp.down_proj.weight"], padded.loaded
        live = padded_engine.params[DOWN]
        assert torch.equal(live[:, :cfg["intermediate"]], net.w(DOWN).detach()), v
        assert not live[:, cfg["intermediate"]:].any()

    explain = adapter.explain()
    fallback = {n: r for n, (res, r) in explain.items() if res == "RESOLUTION_FALLBACK"}
    assert set(fallback) == {"model.norm.weight", EXTRA}, explain
    assert "fallback=" in fallback["model.norm.weight"], fallback
    assert "has no " + EXTRA in fallback[EXTRA], fallback
    assert explain["lm_head.weight"][0] == "RESOLUTION_DIRECT", explain["lm_head.weight"]
    direct = [n for n, (res, _) in explain.items()
              if res in ("RESOLUTION_DIRECT", "RESOLUTION_FUSED")]
    assert len(direct) == len(explain) - 2, explain
    down = padded.explain()[DOWN]
    assert down[0] == "RESOLUTION_FALLBACK", down
    assert "[256, 520]" in down[1] and "vLLM's table (256, 512)" in down[1], down

    # The gate: a forward pass in flight holds PAUSE, so the version
    # cannot land under it; it lands once the pass ends.
    entered, release = threading.Event(), threading.Event()

    def long_pass():
        with adapter.gate.serving():
            entered.set()
            release.wait(30)
    t = threading.Thread(target=long_pass)
    t.start()
    assert entered.wait(10)
    step()
    outcome = []
    pub = threading.Thread(target=lambda: outcome.append(src.publish(3)))
    pub.start()
    while adapter.gate.is_open:  # PAUSE arrived: the gate closes first
        threading.Event().wait(0.01)
    # pause() waits for the pass: PAUSE is not acked, nothing moves.
    assert adapter.committed == 2 and pub.is_alive()
    release.set()
    pub.join(30)
    t.join(10)
    assert outcome and outcome[0].all_committed(), outcome
    assert logits_diff() <= TOL

    # Offload with a host copy, then onload: fresh tensors, same values.
    st = conn.offload("eng", keep_host_copy=True)
    assert st.state == ferry.types_pb2.INSTANCE_STATE_OFFLOADED, st
    assert not engine.params  # the engine let go of every tensor
    try:
        with adapter.gate.serving(timeout_s=1):
            raise AssertionError("an offloaded engine served")
    except ferry.engine.NotServing:
        pass
    st = conn.onload("eng")
    assert st.state == ferry.COMMITTED, st
    assert set(engine.params) >= {"lm_head.weight", EXTRA}
    assert logits_diff() <= TOL
    print("engine_test: OK")


if __name__ == "__main__":
    main()
