"""torch helpers: put a module's parameters into registered shared memory and
describe them to ferry.

    arena = ferry.arena_for_module(model, "policy.r0")   # /dev/shm region
    ferry.move_to_arena(model, arena)   # params now view the arena (no copy later)
    src = ferry.SourceClient.from_module(conn, "policy", rank, world, model,
                                         sharding, arena)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ferry.arena import SLOT_ALIGNMENT, SharedTensorArena
from ferry.dtypes import torch_module

if TYPE_CHECKING:
    import torch


def bytes_needed(tensors: Iterable["torch.Tensor"]) -> int:
    """Arena bytes for these tensors, each in a slot of its own."""
    total = 0
    for t in tensors:
        total += (t.numel() * t.element_size() + SLOT_ALIGNMENT - 1) // SLOT_ALIGNMENT * SLOT_ALIGNMENT
    return max(total, SLOT_ALIGNMENT)


def arena_for_module(module: "torch.nn.Module", name_hint: str, region_id: int = 0,
                     extra_bytes: int = 0) -> SharedTensorArena:
    """A SharedTensorArena big enough for every parameter of ``module``."""
    return SharedTensorArena(name_hint, bytes_needed(module.parameters()) + extra_bytes,
                             region_id)


def move_to_arena(module: "torch.nn.Module",
                  arena: SharedTensorArena) -> "torch.nn.Module":
    """Re-homes every parameter of ``module`` into ``arena`` (copying its
    current value once): ``param.data`` becomes a tensor viewing the shared
    memory, so optimizers and forward passes work on registered memory and
    ferry reads/writes it in place. Create optimizers after this."""
    torch = torch_module()
    seen = {}
    with torch.no_grad():
        for _, p in module.named_parameters():
            if id(p) in seen:
                continue
            t = arena.tensor(p.shape, p.dtype)
            t.copy_(p.data)
            p.data = t
            seen[id(p)] = t
    return module
