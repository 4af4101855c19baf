"""The daemon's staging memory as a destination rank sees it at APPLY.

An APPLY event (version.proto ApplyDetail) lists the staging regions the
daemon exported to the rank (region ids with the top bit set) and the
tensors in them: for the base model, whole checkpoint tensors the engine's
own loader consumes (fallback parameters); for a LoRA adapter, this rank's
share of each lora_A / lora_B. ``StagingMaps.map_apply`` maps the regions
(keeping a mapping from one APPLY to the next while the daemon names the
same memory) and returns torch tensors viewing them, valid during the
callback only: the daemon may reuse staging afterwards.

Region kinds: host shared memory (``HostStaging``: a /dev/shm name or a
memfd, mmap'ed here), and GPU memory ferryd allocated on the rank's own GPU
(``DeviceStaging``: a CUDA IPC handle opened here, for a GPU rank that
asked for device staging; its tensors are CUDA tensors, so the engine's
loader copies device to device). ``open_staging`` picks the class by the
region's ``memory`` field; each has ``size``, ``matches(region)`` and
``tensor(...)``.
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, Union

from ferry import dtypes
from ferry.v1 import types_pb2, version_pb2

if TYPE_CHECKING:
    import torch

# (offsets, extents) of an adapter tensor's global shape that the rank holds.
Share = Tuple[Tuple[int, ...], Tuple[int, ...]]
FallbackTensor = Tuple[str, "torch.Tensor"]
AdapterShare = Tuple[str, "torch.Tensor", Optional[Share]]


class HostStaging:
    """A daemon staging region in host shared memory, mapped here."""

    def __init__(self, region: types_pb2.MemoryRegion) -> None:
        self.region_id = region.region_id
        self.size = region.size_bytes
        self.offset = region.shared_memory.file_offset_bytes
        self.path = HostStaging.path_of(region)
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self.map = mmap.mmap(fd, self.offset + self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    @staticmethod
    def path_of(region: types_pb2.MemoryRegion) -> str:
        shm = region.shared_memory
        if shm.WhichOneof("memory") == "memfd":
            return "/proc/%d/fd/%d" % (shm.memfd.pid, shm.memfd.fd)
        return "/dev/shm" + shm.shm_name

    def matches(self, region: types_pb2.MemoryRegion) -> bool:
        """Whether ``region`` names the memory mapped here. Region ids are
        per registration: after a swap, a daemon restart or a new
        registration the same id names another file."""
        return (region.WhichOneof("memory") == "shared_memory" and
                self.size == region.size_bytes and
                self.offset == region.shared_memory.file_offset_bytes and
                self.path == HostStaging.path_of(region))

    def tensor(self, byte_offset: int, shape: Sequence[int],
               dtype: "torch.dtype") -> "torch.Tensor":
        """The row-major tensor at ``byte_offset`` of the region."""
        torch = dtypes.torch_module()
        count = 1
        for d in shape:
            count *= d
        return torch.frombuffer(self.map, dtype=dtype, count=count,
                                offset=self.offset + byte_offset).view(tuple(shape))


class DeviceStaging:
    """A daemon staging region in GPU memory (a GPU rank that asked for
    device staging), opened here over CUDA IPC; its tensors are CUDA
    tensors on this process's ordinal of that GPU. The handle is closed
    once this object and every tensor viewing it are gone."""

    def __init__(self, region: types_pb2.MemoryRegion) -> None:
        from ferry import cuda
        self.region_id = region.region_id
        self.size = region.size_bytes
        self.handle = region.cuda_ipc.ipc_handle
        self.offset = region.cuda_ipc.allocation_offset_bytes
        self._opened = cuda.open_staging(region, cuda.ordinal_of_uuid)

    def matches(self, region: types_pb2.MemoryRegion) -> bool:
        """Whether ``region`` names the allocation opened here."""
        return (region.WhichOneof("memory") == "cuda_ipc" and
                self.size == region.size_bytes and
                self.handle == region.cuda_ipc.ipc_handle and
                self.offset == region.cuda_ipc.allocation_offset_bytes)

    def tensor(self, byte_offset: int, shape: Sequence[int],
               dtype: "torch.dtype") -> "torch.Tensor":
        """The row-major CUDA tensor at ``byte_offset`` of the region."""
        return self._opened.tensor(byte_offset, shape, dtype)


Staging = Union[HostStaging, DeviceStaging]


def open_staging(region: types_pb2.MemoryRegion) -> Staging:
    """Maps one staging region, by its kind."""
    kind = region.WhichOneof("memory")
    if kind == "shared_memory":
        return HostStaging(region)
    if kind == "cuda_ipc":
        return DeviceStaging(region)
    raise ValueError("staging region %d names no memory" % region.region_id)


class StagingMaps:
    """The staging regions a destination rank has mapped, by adapter name
    ("" for the base model; each adapter keeps its own set, as the base
    model does), then by region id."""

    def __init__(self, who: str) -> None:
        self.who = who
        self._maps: Dict[str, Dict[int, Staging]] = {}

    def map_apply(self, apply: version_pb2.ApplyDetail, adapter: str = ""
                  ) -> Union[List[FallbackTensor], List[AdapterShare]]:
        """The APPLY's tensors: (name, tensor) for the base model; (name,
        tensor, share) for an adapter, share None for a whole tensor.
        Mappings of regions the APPLY no longer lists are dropped (unmapped
        once no tensor views them)."""
        mapped = self._maps.get(adapter, {})
        kept: Dict[int, Staging] = {}
        for r in apply.staging_regions:
            old = mapped.get(r.region_id)
            if old is not None and old.matches(r):
                kept[r.region_id] = old
                continue
            kept[r.region_id] = open_staging(r)
        self._maps[adapter] = kept
        out: list = []
        for t in apply.fallback_tensors:
            m = kept.get(t.region_id)
            if m is None:
                raise ValueError("fallback tensor %s is in region %d, which the APPLY "
                                 "event does not list" % (t.parameter, t.region_id))
            if t.byte_offset < 0 or t.size_bytes < 0 or t.byte_offset + t.size_bytes > m.size:
                raise ValueError("fallback tensor %s bytes [%d, +%d) are outside staging "
                                 "region %d (%d bytes)" % (t.parameter, t.byte_offset,
                                                           t.size_bytes, t.region_id, m.size))
            dtype = dtypes.view_dtype(t.dtype)
            share: Optional[Share] = None
            shape = tuple(t.shape)
            if t.HasField("share"):
                share = (tuple(t.share.offset), tuple(t.share.extent))
                shape = share[1]
                if (len(shape) != len(t.shape) or any(
                        o < 0 or e < 0 or o + e > d
                        for o, e, d in zip(share[0], shape, t.shape))):
                    raise ValueError("%s: share %s of %s lies outside its shape %s"
                                     % (self.who, share, t.parameter,
                                        tuple(t.shape)))
            if adapter:
                count = 1
                for d in shape:
                    count *= d
                row = dtypes.lookup(t.dtype)
                if count * row.itemsize != t.size_bytes:
                    raise ValueError("%s: tensor %s of shape %s is not %d bytes"
                                     % (self.who, t.parameter, shape, t.size_bytes))
            tensor = m.tensor(t.byte_offset, shape, dtype)
            out.append((t.parameter, tensor, share) if adapter else
                       (t.parameter, tensor))
        return out

    def drop(self, adapter: str) -> None:
        """Forgets an adapter's mappings (unloaded: the daemon released its
        staging)."""
        self._maps.pop(adapter, None)

    def clear(self) -> None:
        """Forgets every mapping (offload, close)."""
        self._maps = {}
