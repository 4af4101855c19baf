"""SharedTensorArena: the host memory a rank registers with ferryd.

Mirrors client/shared_tensor_arena.h. ferry registers allocations, not
tensors: a rank puts all its host tensors in one POSIX shared-memory object
(/dev/shm/<name>), registers it once as a region, and its pieces (source) or
engine parameters (destination) point into it by byte offset. Tensors handed
out by ``tensor()`` and ``view()`` are torch tensors viewing that memory
(mmap + torch.frombuffer): what the daemon reads or writes is exactly what
torch computes with, nothing is copied.

Each such tensor is made from a memoryview of the mapping of its own, which
the tensor's storage keeps alive (torch.frombuffer holds the object it was
given): the mapping counts one export per live tensor, shared by every view,
slice or reshape of it, and refuses to be closed while any is alive. That is
what makes ``release()`` safe: it cannot unmap memory a tensor still points
at.

Lifetime: the arena must outlive every client registered with it (the daemon
keeps the region mapped until deregistration). ``close()`` unlinks the name;
tensors viewing the arena keep the mapping alive until they are freed.

Offload (docs/api.md, "Offload and onload"): ``release()`` unmaps and
unlinks the memory once no tensor views it; ``reallocate()`` makes a fresh
region of the same size (a new name, zeros) in which the same offsets hold
the same tensors, to be registered again with Registry.UpdateRegions (the
DestinationClient does both on OFFLOAD and ONLOAD).
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from typing import TYPE_CHECKING, Optional, Sequence

from ferry.dtypes import torch_module
from ferry.v1 import types_pb2

if TYPE_CHECKING:
    import torch

SLOT_ALIGNMENT = 256  # as kTensorSlotAlignment in the C++ arena
STAGING_BIT = 1 << 31

_counter = itertools.count()
# Differs between processes that may share a pid (other pid namespaces).
_NONCE = os.urandom(4).hex()


def _sanitize(hint: str) -> str:
    out = "".join(c if (c.isalnum() or c in "._-") else "_" for c in hint)
    return out[:80] or "arena"


class SharedTensorArena:
    """A /dev/shm region of ``capacity_bytes`` registered as ``region_id``."""

    def __init__(self, name_hint: str, capacity_bytes: int,
                 region_id: int = 0) -> None:
        self._create(name_hint, capacity_bytes, region_id)

    def _create(self, name_hint: str, capacity_bytes: int, region_id: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("SharedTensorArena: capacity must be > 0 bytes, "
                             "got %d" % capacity_bytes)
        if region_id & STAGING_BIT or region_id < 0:
            raise ValueError("SharedTensorArena: region id %d has the top bit "
                             "set, which names daemon staging; use an id < 2^31"
                             % region_id)
        self.region_id = region_id
        self.capacity = int(capacity_bytes)
        # pid + counter keep names unique among live processes of one pid
        # namespace; the per-process nonce keeps processes of different pid
        # namespaces that share /dev/shm (containers of one pod, sandboxed
        # tests: the same small pids) apart; O_EXCL + retry covers a file
        # left by a dead process.
        for _ in range(16):
            self.name = "/ferry.%s.%d.%s.%d" % (_sanitize(name_hint), os.getpid(),
                                               _NONCE, next(_counter))
            path = "/dev/shm" + self.name
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             0o600)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError("SharedTensorArena: no free /dev/shm name for "
                                  "%r after 16 tries" % name_hint)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, self.capacity)
            self._map = mmap.mmap(fd, self.capacity, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self._path = path
        self._hint = name_hint
        self._lock = threading.Lock()
        self._next = 0
        self._closed = False
        self._released = False

    def allocate(self, nbytes: int) -> int:
        """A fresh slot of ``nbytes``; returns its byte offset (256-aligned)."""
        if nbytes < 0:
            raise ValueError("SharedTensorArena: slot of %d bytes" % nbytes)
        with self._lock:
            offset = (self._next + SLOT_ALIGNMENT - 1) // SLOT_ALIGNMENT * SLOT_ALIGNMENT
            if offset + nbytes > self.capacity:
                raise MemoryError(
                    "SharedTensorArena region %d: a slot of %d bytes does not "
                    "fit (%d of %d bytes used)" % (self.region_id, nbytes,
                                                   self._next, self.capacity))
            self._next = offset + nbytes
            return offset

    def view(self, byte_offset: int, shape: Sequence[int],
             dtype: "torch.dtype") -> "torch.Tensor":
        """The torch tensor (row-major) at ``byte_offset`` of the arena."""
        torch = torch_module()
        shape = tuple(int(d) for d in shape)
        count = 1
        for d in shape:
            count *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if byte_offset < 0 or byte_offset + count * itemsize > self.capacity:
            raise ValueError("SharedTensorArena region %d: bytes [%d, +%d) are "
                             "not inside its %d bytes" % (
                                 self.region_id, byte_offset, count * itemsize,
                                 self.capacity))
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._export(), dtype=dtype, count=count,
                                offset=byte_offset)
        return flat.view(shape)

    def _export(self) -> memoryview:
        """A memoryview of the whole mapping, for one tensor to hold: while
        it lives, the mapping refuses close() (see the module doc)."""
        if self._released:
            raise ValueError("SharedTensorArena %s is released (offloaded): "
                             "reallocate() it first" % self.name)
        return memoryview(self._map)

    def tensor(self, shape: Sequence[int],
               dtype: Optional["torch.dtype"] = None) -> "torch.Tensor":
        """Allocates a slot and returns a zeroed tensor viewing it (float32
        unless ``dtype``)."""
        torch = torch_module()
        if dtype is None:
            dtype = torch.float32
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for d in shape:
            count *= int(d)
        t = self.view(self.allocate(count * itemsize), shape, dtype)
        t.zero_()
        return t

    def offset_of(self, tensor: "torch.Tensor") -> Optional[int]:
        """Byte offset of ``tensor``'s first element in this arena, or None."""
        base = self.base_address()
        addr = tensor.data_ptr()
        if base <= addr < base + self.capacity:
            return addr - base
        return None

    def base_address(self) -> int:
        """The address of the arena's first byte in this process."""
        if self._closed:
            raise ValueError("SharedTensorArena is closed")
        torch = torch_module()
        probe = torch.frombuffer(self._export(), dtype=torch.uint8, count=1)
        return probe.data_ptr()

    def describe(self) -> types_pb2.MemoryRegion:
        """This arena as a ferry.v1.MemoryRegion."""
        r = types_pb2.MemoryRegion(region_id=self.region_id,
                                   size_bytes=self.capacity)
        r.shared_memory.shm_name = self.name
        r.shared_memory.file_offset_bytes = 0
        return r

    def used(self) -> int:
        with self._lock:
            return self._next

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Lets go of the memory: unmapped here and its /dev/shm name
        unlinked, so it is freed once ferryd unmapped it too (Offload).
        Every tensor viewing the arena (and every view, slice or reshape of
        one) must be gone first: raises BufferError naming the arena
        otherwise, and keeps the memory, mapped and usable. Tensors caught
        in reference cycles count until the garbage collector frees them
        (gc.collect())."""
        if self._released:
            return
        try:
            self._map.close()
        except BufferError:
            raise BufferError(
                "SharedTensorArena %s: tensors viewing it are still alive; drop "
                "them (the engine's parameters, views of them) before it is "
                "released" % self.name) from None
        self.close()
        self._released = True

    def reallocate(self) -> None:
        """A fresh region of the same capacity and region id (zeros, a new
        /dev/shm name); allocations keep their offsets, so ``view()`` at an
        offset gives the tensor that lived there. For Onload: register it
        with Registry.UpdateRegions (``describe()``)."""
        if not self._released:
            raise ValueError("SharedTensorArena %s: reallocate() after release() "
                             "only" % self.name)
        used = self._next
        self._create(self._hint, self.capacity, self.region_id)
        self._next = used

    def close(self) -> None:
        """Unlinks the /dev/shm name (after the client deregistered)."""
        if self._closed:
            return
        self._closed = True
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SharedTensorArena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
