"""torch helpers: put a module's parameters into registered shared memory and
describe them to ferry.

    arena = ferry.arena_for_module(model, "policy.r0")   # /dev/shm region
    ferry.move_to_arena(model, arena)   # params now view the arena (no copy later)
    src = ferry.SourceClient.from_module(conn, "policy", rank, world, model,
                                         sharding, arena)
"""

import torch

from ferry.arena import SLOT_ALIGNMENT, SharedTensorArena


def bytes_needed(tensors):
    total = 0
    for t in tensors:
        total += (t.numel() * t.element_size() + SLOT_ALIGNMENT - 1) // SLOT_ALIGNMENT * SLOT_ALIGNMENT
    return max(total, SLOT_ALIGNMENT)


def arena_for_module(module, name_hint, region_id=0, extra_bytes=0):
    """A SharedTensorArena big enough for every parameter of ``module``."""
    return SharedTensorArena(name_hint, bytes_needed(module.parameters()) + extra_bytes,
                             region_id)


@torch.no_grad()
def move_to_arena(module, arena):
    """Re-homes every parameter of ``module`` into ``arena`` (copying its
    current value once): ``param.data`` becomes a tensor viewing the shared
    memory, so optimizers and forward passes work on registered memory and
    ferry reads/writes it in place. Create optimizers after this."""
    seen = {}
    for _, p in module.named_parameters():
        if id(p) in seen:
            continue
        t = arena.tensor(p.shape, p.dtype)
        t.copy_(p.data)
        p.data = t
        seen[id(p)] = t
    return module
