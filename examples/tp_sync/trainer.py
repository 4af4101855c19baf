"""One trainer rank: Megatron-style TP over gloo, Adam on a fixed synthetic
corpus, and after every step the new weights published through ferryd.

With --device=cpu (the default) the parameters live in a ferry
SharedTensorArena (registered once); with --device=cuda they are the
model's own CUDA tensors, registered as they are (each CUDA allocation
once). Either way the optimizer updates them in place and ferry reads them
during CommitVersion.
After each version the rank waits for the engines' reports of that version
(an RL trainer waits for its rollouts the same way) before the next step.
"""

import argparse
import json
import logging
import os
import struct
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ferry  # noqa: E402
import model as M  # noqa: E402


def wait_files(paths, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError("missing %s" % [p for p in paths if not os.path.exists(p)])
        time.sleep(0.02)


def save_safetensors(path, tensors):
    """A .safetensors file (the format's own layout: 8-byte little-endian
    header length, a JSON header, the data), F32, tensors in order."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().to(torch.float32).cpu().contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)))
        fh.write(h)
        for b in blobs:
            fh.write(b)
    os.rename(tmp, path)  # complete or absent


def gather_full(net, shapes, world):
    """Every checkpoint tensor whole, gathered from the TP ranks' shards."""
    out = {}
    for name in shapes:
        local = net.w(name).detach()
        dim = M.split_dim(name)
        if dim is None or world == 1:
            out[name] = local.clone()
            continue
        out[name] = torch.cat(M.all_gather(local), dim)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--instances", default="tp1,tp2")
    ap.add_argument("--save_checkpoint", default="",
                    help="write the full model as safetensors (F32) here ...")
    ap.add_argument("--save_after", type=int, default=1,
                    help="... right after this version is published")
    ap.add_argument("--hold_after", type=int, default=0,
                    help="after publishing this version, wait for --hold_until "
                         "to exist before the next step (a joiner's turn)")
    ap.add_argument("--hold_until", default="")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default=os.environ.get("FERRY_EXAMPLE_DEVICE", "cpu"),
                    help="cpu (parameters in a ferry arena) or cuda[:N] (the "
                    "model's CUDA tensors as they are)")
    args = ap.parse_args()
    device = M.device_of(args.device)
    logging.basicConfig(level=logging.INFO,
                        format="%%(asctime)s [trainer %d] %%(message)s" % args.rank)
    torch.set_num_threads(1)
    d = args.dir
    dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "pg.trainer"),
                            rank=args.rank, world_size=args.world)
    tp = M.TP(args.rank, args.world)
    shapes = M.checkpoint_shapes()
    net = M.TrainerModel(M.base_checkpoint(), tp).to(device)

    # Weights where ferry reads them in place: the GPU tensors as they
    # are, or host memory moved into a registered arena.
    arena = None
    if device.type == "cpu":
        arena = ferry.arena_for_module(net, "trainer.r%d" % args.rank)
        ferry.move_to_arena(net, arena)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)

    def sharding(name, p):
        ck = M.TrainerModel.checkpoint_name(name)
        return ferry.Shard(ck, shapes[ck], M.split_dim(ck), args.rank, args.world)

    conn = ferry.connect(args.daemon)
    src = ferry.SourceClient.from_module(conn, "policy", args.rank, args.world, net,
                                         sharding, arena)
    instances = args.instances.split(",")
    prompts = M.prompts().to(device)
    inputs, targets = (t.to(device) for t in M.corpus())

    def save_logits(v):
        with torch.no_grad():
            logits = net(prompts)
        if args.rank == 0:
            torch.save(logits.cpu(), os.path.join(d, "trainer.v%d.pt" % v))

    save_logits(0)
    conn.wait_instances("policy", instances, timeout_s=120)
    dist.barrier()
    for v in range(1, args.versions + 1):
        t0 = time.monotonic()
        loss = M.train_step(net, opt, inputs, targets)
        save_logits(v)
        t1 = time.monotonic()
        # An engine rank that restarted must be back before v begins.
        conn.wait_instances("policy", instances, timeout_s=120)
        outcome = src.publish(v)
        t2 = time.monotonic()
        logging.info("step %d loss %.4f (%.2f s); publish v%d: %s (%.3f s)", v,
                     loss.item(), t1 - t0, v, outcome.summary(), t2 - t1)
        committed = [s.instance_id for s in outcome.instances
                     if s.state == ferry.COMMITTED]
        if args.rank == 0:
            with open(os.path.join(d, "outcome.v%d.json" % v), "w") as fh:
                json.dump({s.instance_id: dict(state=ferry.types_pb2.InstanceState.Name(s.state),
                                               dirty=s.dirty, reason=s.abort_reason,
                                               committed_version=s.committed_version)
                           for s in outcome.instances}, fh)
            # Rollouts: wait until every committed instance served v.
            wait_files([os.path.join(d, "report.%s.v%d.pt" % (i, v)) for i in committed], 60)
        if v == args.hold_after and args.hold_until:
            wait_files([args.hold_until], 120)
        if args.save_checkpoint and v == args.save_after:
            full = gather_full(net, shapes, args.world)  # collective
            if args.rank == 0:
                save_safetensors(args.save_checkpoint, full)
                logging.info("saved the model after version %d to %s", v,
                             args.save_checkpoint)
        dist.barrier()
    src.close()
    if arena is not None:
        arena.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    logging.info("done")
