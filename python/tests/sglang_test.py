"""ferry.sglang against the real ferryd, calling its loader as SGLang's
update_weights_from_tensor calls a --custom-weight-loader (loader(model,
named_tensors) in the worker), with the PyTorch example's engine model as
an nn.Module named as vLLM/SGLang name their parameters, and its config.

- Version 0 attaches: the worker registers with ferryd and returns.
- ferry.sglang.publish (pause, publish while the loader waits, resume)
  lands three versions: the engine's logits equal the trainer's (<= 1e-5).
- A loader call with anything but the one version tensor is refused,
  naming what it takes.

Usage: sglang_test.py FERRYD_BINARY
"""

import os
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "tp_sync"))
sys.path.insert(0, HERE)

import ferry  # noqa: E402
import ferryd_process  # noqa: E402
import ferry.sglang  # noqa: E402
import model as M  # noqa: E402

TOL = 1e-5


class Config(dict):
    """A Hugging Face config, as much as the loader reads of one."""

    def to_dict(self):
        return dict(self)


def as_module(engine):
    """The engine's live tensors as an nn.Module whose named_parameters()
    are the engine's names ("model.layers.0.self_attn.qkv_proj.weight"),
    with the model's config and load_weights, as an SGLang model has."""
    root = torch.nn.Module()
    for name, t in engine.params.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    root.config = Config(M.hf_config())

    def load_weights(weights):
        engine.load_weights(weights)
    root.load_weights = load_weights
    return root


def main():
    ferryd = sys.argv[1]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with ferryd_process.Ferryd(ferryd, "sglang", "--lease_ms=5000", "--ack_timeout_ms=20000",
                               "--version_timeout_ms=40000") as d:
        run(d)


def run(d):
    """The test against ferryd `d`; clients and memory to close go in
    d.clients."""
    sock = d.sock
    os.environ.update(FERRY_SOCKET=sock, FERRY_INSTANCE_ID="sglang-0",
                      FERRY_TP_RANK="0", FERRY_TP_SIZE="1")
    tp = M.TP(0, 1)
    net = M.TrainerModel(M.base_checkpoint(), tp)
    arena = ferry.arena_for_module(net, "sglang-test.trainer")
    ferry.move_to_arena(net, arena)
    d.clients.append(arena)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    shapes = M.checkpoint_shapes()

    def sharding(name, p):
        ck = M.TrainerModel.checkpoint_name(name)
        return ferry.Shard(ck, shapes[ck])
    conn = ferry.connect(sock)
    src = ferry.SourceClient.from_module(conn, "policy", 0, 1, net, sharding, arena)
    d.clients.append(src)

    engine = M.EngineModel(M.base_checkpoint(), tp, lambda shape: torch.zeros(shape))
    module = as_module(engine)
    d.clients.append(types.SimpleNamespace(close=lambda: ferry.sglang.detach(module)))

    def update(named_tensors):  # SGLang's worker, calling the loader
        ferry.sglang.load_weights(module, named_tensors)
    update(ferry.sglang.version_tensors(0))  # attach: registers the rank
    # The loader moved the module's CPU parameters into an arena: the
    # engine reads them there.
    engine.params.update({n: p.data for n, p in module.named_parameters()})
    conn.wait_instances("policy", ["sglang-0"], sources=True)

    prompts = M.prompts()
    inputs, targets = M.corpus()
    events = []
    for v in (1, 2, 3):
        M.train_step(net, opt, inputs, targets)
        out = ferry.sglang.publish(src, v, update=update,
                                   pause=lambda: events.append("pause"),
                                   resume=lambda: events.append("resume"))
        assert out.all_committed(), out.summary()
        with torch.no_grad():
            diff = (engine.forward(prompts) - net(prompts)).abs().max().item()
        assert diff <= TOL, "version %d: logits differ by %.3g" % (v, diff)
    assert events == ["pause", "resume"] * 3, events

    try:
        ferry.sglang.load_weights(module, [("model.norm.weight", torch.zeros(4))])
        raise AssertionError("a loader call without the version was accepted")
    except ValueError as e:
        assert ferry.sglang.VERSION_TENSOR in str(e), e
    print("sglang_test: OK")


if __name__ == "__main__":
    main()
