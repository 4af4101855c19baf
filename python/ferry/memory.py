"""The memory a rank registers, shared by SourceClient and DestinationClient:
its arenas as MemoryRegions with the rank's Device, and where a tensor lies
among them (region id and byte offset) for its pieces or engine parameters.

Host memory only for now: every arena is a SharedTensorArena (host shared
memory, DEVICE_KIND_HOST). GPU memory (CudaIpcRegion, DEVICE_KIND_CUDA)
enters here: an arena kind with ``describe()``, ``offset_of(tensor)`` and
``region_id``, and the device taken from the arenas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence, Tuple, Union

from ferry.v1 import types_pb2

if TYPE_CHECKING:
    import torch

    from ferry.arena import SharedTensorArena

Arenas = Union["SharedTensorArena", Sequence["SharedTensorArena"], None]


def as_arenas(arenas: Arenas) -> List["SharedTensorArena"]:
    """One arena, a list of them, or None, as a list."""
    if arenas is None:
        return []
    if not isinstance(arenas, (list, tuple)):
        return [arenas]
    return list(arenas)


def describe_memory(registration, arenas: Sequence["SharedTensorArena"]) -> None:
    """Sets a Source- or DestinationRegistration's device and regions."""
    registration.device.kind = types_pb2.DEVICE_KIND_HOST
    for a in arenas:
        registration.regions.append(a.describe())


def locate(tensor: "torch.Tensor", arenas: Sequence["SharedTensorArena"],
           what: str) -> Tuple["SharedTensorArena", int]:
    """The arena holding ``tensor``'s first element and its byte offset
    there; ValueError naming ``what`` if none does."""
    for a in arenas:
        off = a.offset_of(tensor)
        if off is not None:
            return a, off
    raise ValueError("%s: the tensor is not inside any registered arena "
                     "(allocate it with SharedTensorArena.tensor or "
                     "ferry.torch_utils.move_to_arena)" % what)
