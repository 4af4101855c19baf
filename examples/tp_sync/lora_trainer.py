"""One trainer rank of the LoRA run (run 5 of run_e2e.py): Megatron-style TP
over gloo; the base model is frozen and published once (stream "policy",
version 1); a LoRA adapter on q_proj and v_proj is trained on the fixed
corpus and published after every step as a version of its own stream
("policy-lora"), lora_A replicated on both ranks and lora_B split along its
output dim, as Megatron holds them.

Files in --dir: lora-registered (the adapter stream's sources are up; the
controller loads the adapter on the engines, then writes adapters-loaded),
trainer.base.pt (logits of the base model), trainer.lora.v<v>.pt (logits
with the adapter after step v). Before its last step the trainer waits for
b-done (the controller's second-adapter checks).
"""

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ferry  # noqa: E402
import model as M  # noqa: E402
from trainer import wait_files  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--instances", default="tp1,tp2")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--device", default=os.environ.get("FERRY_EXAMPLE_DEVICE", "cpu"),
                    help="cpu (arenas) or cuda[:N] (CUDA tensors as they are)")
    args = ap.parse_args()
    device = M.device_of(args.device)
    logging.basicConfig(level=logging.INFO,
                        format="%%(asctime)s [lora trainer %d] %%(message)s" % args.rank)
    torch.set_num_threads(1)
    d = args.dir
    dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "pg.trainer"),
                            rank=args.rank, world_size=args.world)
    tp = M.TP(args.rank, args.world)
    shapes = M.checkpoint_shapes()
    net = M.TrainerModel(M.base_checkpoint(), tp).to(device)
    for p in net.parameters():
        p.requires_grad_(False)  # the base is frozen
    lora = M.TrainerLora(M.lora_init(), tp).to(device)

    base_arena = lora_arena = None
    if device.type == "cpu":
        base_arena = ferry.arena_for_module(net, "lora-trainer.base.r%d" % args.rank)
        ferry.move_to_arena(net, base_arena)
        lora_arena = ferry.arena_for_module(lora, "lora-trainer.lora.r%d" % args.rank)
        ferry.move_to_arena(lora, lora_arena)
    opt = torch.optim.Adam(lora.parameters(), lr=args.lr)

    conn = ferry.connect(args.daemon)

    def base_sharding(name, p):
        ck = M.TrainerModel.checkpoint_name(name)
        return ferry.Shard(ck, shapes[ck], M.split_dim(ck), args.rank, args.world)

    lora_shapes = M.lora_shapes()

    def lora_sharding(name, p):
        ck = M.TrainerModel.checkpoint_name(name)
        return ferry.Shard(ck, lora_shapes[ck], lora.split_dim(ck), args.rank,
                           args.world)

    base_src = ferry.SourceClient.from_module(conn, "policy", args.rank, args.world,
                                              net, base_sharding, base_arena)
    lora_src = ferry.SourceClient.from_module(conn, "policy-lora", args.rank,
                                              args.world, lora, lora_sharding,
                                              lora_arena)
    instances = args.instances.split(",")
    prompts = M.prompts().to(device)
    inputs, targets = (t.to(device) for t in M.corpus())

    with torch.no_grad():
        base_logits = net(prompts)
    if args.rank == 0:
        torch.save(base_logits.cpu(), os.path.join(d, "trainer.base.pt"))
    conn.wait_instances("policy", instances, timeout_s=120)
    dist.barrier()
    outcome = base_src.publish(1)  # the base, once
    logging.info("base published: %s", outcome.summary())
    if args.rank == 0:
        wait_files([os.path.join(d, "report.%s.v1.pt" % i) for i in instances], 60)
        open(os.path.join(d, "lora-registered"), "w").close()
        wait_files([os.path.join(d, "adapters-loaded")], 120)
    dist.barrier()

    for v in range(1, args.versions + 1):
        if v == args.versions and args.rank == 0:
            wait_files([os.path.join(d, "b-done")], 180)
        dist.barrier()
        logits = M.trainer_forward_lora(net, inputs, lora)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        lora.sync_grads()
        opt.step()
        with torch.no_grad():
            served = M.trainer_forward_lora(net, prompts, lora)
        if args.rank == 0:
            torch.save(served.cpu(), os.path.join(d, "trainer.lora.v%d.pt" % v))
        t0 = time.monotonic()
        outcome = lora_src.publish(v)
        logging.info("step %d loss %.4f; adapter v%d: %s (%.3f s)", v, loss.item(),
                     v, outcome.summary(), time.monotonic() - t0)
        if args.rank == 0:
            with open(os.path.join(d, "lora-outcome.v%d.json" % v), "w") as fh:
                json.dump({s.base_instance_id: ferry.types_pb2.InstanceState.Name(s.state)
                           for s in outcome.instances}, fh)
            # An attachment names its instance and adapter apart.
            assert all(s.adapter_name == "sql" for s in outcome.instances), \
                [ferry.instance_label(s) for s in outcome.instances]
            committed = [s.base_instance_id for s in outcome.instances
                         if s.state == ferry.COMMITTED]
            wait_files([os.path.join(d, "report.%s.lora.v%d.pt" % (i, v))
                        for i in committed], 60)
        dist.barrier()
    lora_src.close()
    base_src.close()
    for arena in (lora_arena, base_arena):
        if arena is not None:
            arena.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    logging.info("done")
