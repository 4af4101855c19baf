"""The vLLM backend without vLLM (ferry.vllm.WorkerCore, TrainerCore),
against the real ferryd, with the PyTorch example's model: the trainer core
publishes from a WeightSource-like iterable of the trainer's (checkpoint
name, parameter) pairs; a client shaped like vLLM's weight-sync client
(init_weight_transfer_engine, start_weight_update, update_weights,
finish_weight_update) drives the worker core in this process, as vLLM's
engine client drives its workers.

- Three rounds of send_weights: after each the engine's logits equal the
  trainer's (<= 1e-5); model.norm.weight is forced through the model's
  load_weights (init_info "fallback").
- update_weights outside start/finish is refused, naming the calls.
- A version published with no start_weight_update (generation never
  paused) aborts clean, its reason naming start_weight_update, and the
  engine's weights stay at the version before.

Usage: vllm_core_test.py FERRYD_BINARY
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "tp_sync"))
sys.path.insert(0, HERE)

import ferry  # noqa: E402
import ferryd_process  # noqa: E402
import model as M  # noqa: E402
from ferry.vllm import FerryInitFields, FerryUpdateFields, TrainerCore, WorkerCore  # noqa: E402

TOL = 1e-5


class Client:
    """vLLM's weight-sync control plane, reduced to one worker here."""

    def __init__(self, worker, arenas):
        self.worker, self.arenas = worker, arenas
        self.calls = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")
        self.worker.init(FerryInitFields(**init_info), arenas=self.arenas)

    def start_weight_update(self):
        self.calls.append("start")
        self.worker.start_weight_update()

    def update_weights(self, update_info):
        self.calls.append("update %d" % update_info["version"])
        self.worker.update_weights(FerryUpdateFields(**update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish %s" % weight_version)
        self.worker.finish_weight_update()


class ModuleSource:
    """(checkpoint name, parameter) pairs of the trainer, re-iterable."""

    def __init__(self, net):
        self.net = net

    def __iter__(self):
        for name, p in self.net.named_parameters():
            yield M.TrainerModel.checkpoint_name(name), p.data


def main():
    ferryd = sys.argv[1]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with ferryd_process.Ferryd(ferryd, "vllm-core", "--lease_ms=5000", "--ack_timeout_ms=20000",
                               "--version_timeout_ms=40000") as d:
        run(d)


def run(d):
    """The test against ferryd `d`; clients and memory to close go in
    d.clients."""
    sock = d.sock
    tp = M.TP(0, 1)
    net = M.TrainerModel(M.base_checkpoint(), tp)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    shapes = M.checkpoint_shapes()
    nbytes = sum(4 * torch.Size(s).numel() for s in shapes.values()) + (1 << 20)
    e_arena = ferry.SharedTensorArena("vllm-core.engine", nbytes)
    d.clients.append(e_arena)
    engine = M.EngineModel(M.base_checkpoint(), tp, lambda shape: e_arena.tensor(shape))
    worker = WorkerCore(engine.params, M.hf_config(), 0, 1,
                        load_weights=engine.load_weights)
    d.clients.append(worker)
    client = Client(worker, e_arena)
    trainer = TrainerCore(ModuleSource(net), client, socket=sock, init_info={
        "instance_id": "vllm-0", "socket": sock,
        "fallback": ["model.norm.weight"], "pause_timeout_s": 3.0})
    d.clients.append(trainer)
    ferry.connect(sock).wait_instances("policy", ["vllm-0"], sources=True)

    prompts = M.prompts()
    inputs, targets = M.corpus()

    def diff():
        with torch.no_grad():
            return (engine.forward(prompts) - net(prompts)).abs().max().item()

    for v in (1, 2, 3):
        M.train_step(net, opt, inputs, targets)
        out = trainer.send_weights()
        assert out.all_committed(), out.summary()
        d = diff()
        assert d <= TOL, "round %d: logits differ by %.3g" % (v, d)
        assert worker.adapter.loaded == ["model.norm.weight"], worker.adapter.loaded
    assert client.calls[:5] == ["init", "start", "update 1", "finish 1", "start"], \
        client.calls

    try:
        worker.update_weights(FerryUpdateFields(version=4))
        raise AssertionError("update_weights outside the window was accepted")
    except RuntimeError as e:
        assert "outside start_weight_update" in str(e), e

    # Generation never paused: ferry's PAUSE waits for the window, then
    # the version aborts clean and the weights stay at version 3.
    before = diff()
    with torch.no_grad():
        v3 = engine.forward(prompts)
        for p in net.parameters():
            p.add_(0.01)
    for name, t in ModuleSource(net):
        trainer._registered[name].copy_(t)
    out = trainer.src.publish(4)
    st = out.by_instance()["vllm-0"]
    assert st.state == ferry.ABORTED and not st.dirty, st
    assert "start_weight_update" in st.abort_reason, st.abort_reason
    with torch.no_grad():
        assert torch.equal(engine.forward(prompts), v3)  # still version 3
    assert before <= TOL
    print("vllm_core_test: OK")


if __name__ == "__main__":
    main()
