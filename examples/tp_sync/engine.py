"""One rank of a vLLM-style inference engine instance (TP over gloo), fed by
ferry. Live weights (fused qkv_proj / gate_up_proj) sit in a ferry
SharedTensorArena; ferry writes them in place while the rank is paused.

Serving here is a forward pass on a fixed batch of prompts after each
committed version (rank 0 saves the logits as report.<instance>.v<v>.pt).
A rank that saw a dirty ABORT refuses to serve until the next COMMIT, and
re-forms its TP group (generation + 1), because a dirty abort may mean a peer
rank died; a restarted rank joins that next generation with --gen.

--late: an engine that joins a running fleet; ferry bootstraps it from a
running instance (docs/api.md, "Bootstrap and reload"), so its first COMMIT
is the stream's latest version, which it serves like any other.
--linger_until FILE: stay registered (a peer for late joiners) after the
last version until FILE exists.
--lora_versions N: the LoRA run (run 5): the rank serves LoRA adapters
(docs/api.md, "LoRA adapters"). Each adapter APPLY's shares (lora_A whole,
lora_B the rank's rows of q or of its kv heads) are copied out of staging
and become the adapter at COMMIT, never before. After each COMMIT of
adapter "sql" the rank serves the prompts with and without it (rank 0
saves report.<instance>.lora.v<v>.pt); every adapter COMMIT also saves the
rank's shares (adapter.<instance>.<rank>.<name>.pt), and UNLOAD_ADAPTER
leaves adapter.<instance>.<rank>.<name>.unloaded. The rank ends after
adapter version N.
"""

import argparse
import datetime
import json
import logging
import os
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ferry  # noqa: E402
import model as M  # noqa: E402


class NotServing(RuntimeError):
    pass


class ServingGate:
    """Forward passes vs weight updates: pause() returns once no forward pass
    is in flight (ferry's safe point); a dirty gate refuses to serve."""

    def __init__(self):
        self._cond = threading.Condition()
        self._serving = True
        self._dirty = False
        self._in_flight = 0

    def pause(self):
        with self._cond:
            self._serving = False
            self._cond.wait_for(lambda: self._in_flight == 0)

    def resume(self):
        with self._cond:
            self._serving, self._dirty = True, False
            self._cond.notify_all()

    def mark_dirty(self):
        with self._cond:
            self._serving, self._dirty = False, True

    def serve(self, fn, *args):
        with self._cond:
            if self._dirty:
                raise NotServing("weights are half-written (dirty abort)")
            self._cond.wait_for(lambda: self._serving)
            self._in_flight += 1
        try:
            return fn(*args)
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()


def init_group(d, instance, gen, rank, size):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(
        d, "pg.%s.%d" % (instance, gen)), rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=90))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--instance", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--gen", type=int, default=1)
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--last_version", type=int, required=True)
    ap.add_argument("--replace", action="store_true",
                    help="a restarted rank: take the registration over")
    ap.add_argument("--hang_in_apply", type=int, default=0,
                    help="at this version, announce and hang in APPLY (to be killed)")
    ap.add_argument("--late", action="store_true",
                    help="joins a running fleet: no report of the base weights")
    ap.add_argument("--linger_until", default="",
                    help="after the last version, stay registered until this file exists")
    ap.add_argument("--lora_versions", type=int, default=0,
                    help="serve LoRA adapters; end after adapter sql's version N")
    ap.add_argument("--device", default=os.environ.get("FERRY_EXAMPLE_DEVICE", "cpu"),
                    help="cpu (live weights in a ferry arena) or cuda[:N] (CUDA "
                    "tensors, registered as they are)")
    args = ap.parse_args()
    device = M.device_of(args.device)
    who = "%s.%d" % (args.instance, args.rank)
    logging.basicConfig(level=logging.INFO, format="%%(asctime)s [engine %s] %%(message)s" % who)
    torch.set_num_threads(1)
    d = args.dir
    gen = args.gen
    if args.tp > 1:
        init_group(d, args.instance, gen, args.rank, args.tp)
    tp = M.TP(args.rank, args.tp)

    # Live weights, loaded from the base checkpoint: CUDA tensors, or
    # registered shared memory on the host.
    arena = None
    if device.type == "cuda":
        engine = M.EngineModel(M.base_checkpoint(), tp,
                               lambda shape: torch.zeros(shape, device=device))
    else:
        shapes = M.checkpoint_shapes()
        nbytes = (sum(4 * torch.Size(s).numel() for s in shapes.values()) // args.tp * 2
                  + (1 << 20))
        arena = ferry.SharedTensorArena("engine." + who, nbytes)
        engine = M.EngineModel(M.base_checkpoint(), tp, lambda shape: arena.tensor(shape))
    gate = ServingGate()
    events = queue.Queue()

    class Engine(ferry.EngineCallbacks):
        """The rank's side of each version: pause serving, load nothing
        (every parameter is direct), resume at COMMIT or a clean ABORT."""

        def on_pause(self, v):
            gate.pause()

        def on_apply(self, v, fallback):
            if args.hang_in_apply == v:
                open(os.path.join(d, "hanging.%s" % who), "w").close()
                time.sleep(600)
            if fallback:
                raise ValueError("no loader for fallback tensors %s"
                                 % [n for n, _ in fallback])

        def on_commit(self, v):
            gate.resume()
            if args.late:
                # A late joiner's bootstrap is followed at once by the
                # trainer's next version: report what it serves at v now,
                # before this callback returns and the next PAUSE can be
                # handled, so the report cannot show the next version.
                # (One rank: no collective runs on this thread.)
                events.put(("commit", v, snapshot(v)))
            else:
                events.put(("commit", v))

        def on_abort(self, v, reason, dirty):
            if dirty:
                gate.mark_dirty()
                events.put(("dirty", v, reason))
            else:
                gate.resume()

    # LoRA adapters: name -> (scale, {(layer, module): (A, B)}); an APPLY's
    # shares wait in `pending` until the adapter's COMMIT.
    adapters, pending = {}, {}
    adapter_lock = threading.Lock()

    class LoraEngine(Engine):
        """Engine, serving LoRA adapters too (run 5)."""

        def on_adapter_apply(self, name, v, config_json, shares):
            cfg = json.loads(config_json)
            parts = {}
            for tensor_name, t, share in shares:
                layer, module, ab = M.lora_key(tensor_name)
                parts.setdefault((layer, module), {})[ab] = (t.to(device, copy=True), share)
            pending[name] = (cfg, parts)

        def on_adapter_commit(self, name, v):
            cfg, parts = pending.pop(name)
            pairs = {k: (p["A"][0], p["B"][0]) for k, p in parts.items()}
            with adapter_lock:
                adapters[name] = (cfg["lora_alpha"] / cfg["r"], pairs)
            path = os.path.join(d, "adapter.%s.%d.%s.pt" % (args.instance, args.rank, name))
            torch.save(dict(version=v, config=cfg,
                            shares={"%d.%s.%s" % (k[0], k[1], ab): (t.cpu(), s)
                                    for k, p in parts.items()
                                    for ab, (t, s) in p.items()}),
                       path + ".tmp")
            os.rename(path + ".tmp", path)  # whole or absent for the reader
            if name == "sql":
                events.put(("lora", v))

        def on_adapter_unload(self, name):
            with adapter_lock:
                adapters.pop(name, None)
            open(os.path.join(d, "adapter.%s.%d.%s.unloaded" % (args.instance, args.rank,
                                                              name)), "w").close()

    prompts = M.prompts().to(device)
    registered = threading.Event()  # set once dst below is assigned
    conn = ferry.connect(args.daemon)
    dst = ferry.DestinationClient.register(
        conn, args.instance, "policy", args.rank, args.tp, arena, engine.ferry_table(),
        LoraEngine() if args.lora_versions else Engine(),
        replace_existing=args.replace)
    registered.set()

    def snapshot(v):
        registered.wait()  # a COMMIT may come before register() returned
        return dict(version=v, committed_version=dst.committed_version,
                    logits=gate.serve(engine.forward, prompts).cpu())

    def report(v, taken=None):
        rep = taken if taken is not None else snapshot(v)
        if args.rank == 0:
            torch.save(rep, os.path.join(d, "report.%s.v%d.pt" % (args.instance, v)))

    if not args.replace and not args.late:
        report(0)  # the base weights, before any version
    def report_lora(v):
        with adapter_lock:
            scale, pairs = adapters["sql"]
        with_adapter = gate.serve(M.engine_forward_lora, engine, prompts, pairs, scale).cpu()
        without = gate.serve(engine.forward, prompts).cpu()
        if args.rank == 0:
            torch.save(dict(version=v, lora=with_adapter, base=without),
                       os.path.join(d, "report.%s.lora.v%d.pt" % (args.instance, v)))

    while True:
        item = events.get(timeout=180)
        if item[0] == "commit":
            report(item[1], item[2] if len(item) > 2 else None)
            if item[1] >= args.last_version and not args.lora_versions:
                break
        elif item[0] == "lora":
            report_lora(item[1])
            if item[1] >= args.lora_versions:
                break
        elif item[0] == "dirty":
            try:
                gate.serve(lambda: None)
                refused = False
            except NotServing:
                refused = True
            with open(os.path.join(d, "dirty.%s.v%d.json" % (who, item[1])), "w") as fh:
                json.dump(dict(version=item[1], reason=item[2], refused=refused,
                               committed_version=dst.committed_version), fh)
            if args.tp > 1:  # a peer may be gone: the group's next generation
                dist.destroy_process_group()
                gen += 1
                init_group(d, args.instance, gen, args.rank, args.tp)
    if args.linger_until:
        deadline = time.monotonic() + 180
        while not os.path.exists(args.linger_until) and time.monotonic() < deadline:
            time.sleep(0.05)
    dst.close()
    if arena is not None:
        arena.close()
    if args.tp > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    logging.info("done")
