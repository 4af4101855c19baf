"""The memory a rank registers, shared by SourceClient and DestinationClient:
its regions as MemoryRegions with the rank's Device, and where a tensor lies
among them (region id and byte offset) for its pieces or engine parameters.

Two kinds of region, one interface (``region_id``, ``describe()``,
``offset_of(tensor)``, ``released``, ``release()``, ``reallocate()``,
``view(offset, shape, dtype)``):

- host: the SharedTensorArenas the caller passes (/dev/shm);
- GPU: the CUDA allocations holding the rank's CUDA tensors, found from the
  tensors themselves (ferry.cuda.CudaRegions: one region per allocation,
  ids from ferry.cuda.FIRST_REGION_ID), so a module on ``cuda:N`` is
  registered as it is, with no arena and no copy.

A rank's CUDA tensors must all be on one GPU (its Device); host arenas may
sit beside them (a GPU rank's host-side buffers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

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


class RankMemory:
    """Every region one rank registers. ``locate`` every tensor first, then
    ``describe`` the registration (the CUDA regions are found by
    ``locate``)."""

    def __init__(self, arenas: Arenas, who: str) -> None:
        self.arenas = as_arenas(arenas)
        self.who = who
        self._cuda: Any = None  # ferry.cuda.CudaRegions, on the first CUDA tensor

    @property
    def cuda_regions(self) -> list:
        return list(self._cuda.regions) if self._cuda is not None else []

    @property
    def regions(self) -> list:
        return self.arenas + self.cuda_regions

    @property
    def on_gpu(self) -> bool:
        return bool(self.cuda_regions)

    def locate(self, tensor: "torch.Tensor", what: str) -> Tuple[int, int]:
        """(region id, byte offset) of ``tensor``'s first element: in an
        arena, or (a CUDA tensor) in its allocation. ValueError naming
        ``what`` for a host tensor outside the arenas, CudaMemoryError for
        GPU memory that cannot be exported."""
        if tensor.is_cuda:
            from ferry import cuda
            if self._cuda is None:
                taken = {a.region_id for a in self.arenas}
                first = cuda.FIRST_REGION_ID
                while any(first <= t < first + (1 << 16) for t in taken):
                    first += 1 << 16
                self._cuda = cuda.CudaRegions(first)
            for r in self._cuda.regions:
                if r.ordinal != tensor.device.index:
                    raise ValueError(
                        "%s: the tensor is on %s, but this rank's tensors are "
                        "on cuda:%d; a rank registers the memory of one GPU"
                        % (what, tensor.device, r.ordinal))
            region, off = self._cuda.locate(tensor, what)
            return region.region_id, off
        for a in self.arenas:
            off = a.offset_of(tensor)
            if off is not None:
                return a.region_id, off
        raise ValueError("%s: the tensor is not inside any registered arena "
                         "(allocate it with SharedTensorArena.tensor or "
                         "ferry.torch_utils.move_to_arena), nor on a GPU" % what)

    def describe(self, registration) -> None:
        """Sets a Source- or DestinationRegistration's device and regions."""
        cuda = self.cuda_regions
        if cuda:
            from ferry import cuda as cuda_module
            registration.device.CopyFrom(cuda_module.device_proto(cuda[0].ordinal))
        else:
            registration.device.kind = types_pb2.DEVICE_KIND_HOST
        del registration.regions[:]
        for r in self.regions:
            registration.regions.append(r.describe())

    def of(self, region_ids: Sequence[int]) -> list:
        """The regions with these ids; ValueError naming the unknown ones."""
        by_id: Dict[int, Any] = {r.region_id: r for r in self.regions}
        missing = [i for i in region_ids if i not in by_id]
        if missing:
            raise ValueError("%s: regions %s are not this client's memory"
                             % (self.who, missing))
        return [by_id[i] for i in region_ids]

    def view(self, region_id: int, byte_offset: int, shape: Sequence[int],
             dtype: "torch.dtype") -> "torch.Tensor":
        """The tensor at ``byte_offset`` of a region (an arena, or a CUDA
        region this client allocated anew at an onload)."""
        region, = self.of([region_id])
        return region.view(byte_offset, shape, dtype)

    def synchronize(self) -> None:
        """Waits for every kernel queued on the rank's GPU (every stream):
        CUDA work is asynchronous, so what this process wrote (a trainer's
        step, an engine's loader) or still reads (a forward pass) must be
        finished before ferryd reads or writes the memory from its own
        process. A no-op for host memory."""
        cuda = self.cuda_regions
        if cuda:
            import torch
            torch.cuda.synchronize(cuda[0].ordinal)
