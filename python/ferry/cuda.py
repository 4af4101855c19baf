"""CUDA memory for ferry: CUDA tensors registered with ferryd, and the
device staging ferryd exports to GPU engine ranks.

ferry registers allocations, not tensors, on the GPU as on the host: every
distinct CUDA allocation that holds a registered tensor (for PyTorch's
caching allocator, the segment ``cudaMalloc`` returned, which may hold many
tensors) becomes one ``CudaIpcRegion``: the allocation's
``cudaIpcMemHandle_t``, where the region starts in it, and the GPU's UUID.
ferryd opens each handle once and reads (source) or writes (destination)
the tensors in place: no copy into host memory.

Why the driver API and not ``storage._share_cuda_()``: that call also hands
the storage to torch's IPC reference counting, which keeps its memory
alive until a consumer that never comes releases it (so an offloaded
engine would not get its memory back). Here the handle is taken with
``cuIpcGetMemHandle`` and the allocation found with
``cuMemGetAddressRange``, with no side effect on the tensor.

Memory that cannot be exported this way is refused, naming the tensor:
PyTorch's ``expandable_segments`` (virtual-memory allocations have no
legacy IPC handle), managed memory, and a tensor whose storage was freed.

Everything here needs a CUDA driver (``libcuda.so.1``); without one,
``available()`` says why and registering a CUDA tensor raises.
"""

import ctypes
import functools
import logging
import threading
from typing import Dict, List, Optional, Tuple

import torch

from ferry.v1 import types_pb2

log = logging.getLogger("ferry")

# cuda.h
_CUDA_SUCCESS = 0
_ATTR_MEMORY_TYPE = 2
_ATTR_IS_MANAGED = 8
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_MEMORYTYPE_DEVICE = 2
_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_IPC_HANDLE_BYTES = 64

STAGING_BIT = 1 << 31
# Region ids this module gives CUDA allocations: above the ids arenas
# usually take (0, 1, ...), below the staging bit.
FIRST_REGION_ID = 1 << 20


class CudaMemoryError(ValueError):
    """A tensor whose memory cannot be registered with ferryd."""


class _IpcHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes."""
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


class _Driver:
    """The few CUDA driver calls ferry makes, through ctypes."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        self._lock = threading.Lock()
        self._contexts: Dict[int, ctypes.c_void_p] = {}

    def _check(self, result, what):
        if result != _CUDA_SUCCESS:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError("%s failed: %s (%d)" % (
                what, name.value.decode() if name.value else "?", result))

    def _context(self, ordinal):
        """The device's primary context (the one PyTorch uses), retained."""
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                dev = ctypes.c_int()
                self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal),
                            "cuDeviceGet(%d)" % ordinal)
                ctx = ctypes.c_void_p()
                self._check(self.lib.cuDevicePrimaryCtxRetain(
                    ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
                self._contexts[ordinal] = ctx
            return ctx

    def on(self, ordinal, fn):
        """Runs fn() with the device's primary context current."""
        self._check(self.lib.cuCtxPushCurrent_v2(self._context(ordinal)),
                    "cuCtxPushCurrent")
        try:
            return fn()
        finally:
            popped = ctypes.c_void_p()
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def attribute(self, attr, ptr):
        value = ctypes.c_ulonglong(0)
        # Attributes are ints or pointers; 8 bytes hold either.
        result = self.lib.cuPointerGetAttribute(
            ctypes.byref(value), attr, ctypes.c_ulonglong(ptr))
        return result, value.value

    def address_range(self, ptr):
        base = ctypes.c_ulonglong()
        size = ctypes.c_size_t()
        self._check(self.lib.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_ulonglong(ptr)),
            "cuMemGetAddressRange")
        return base.value, size.value

    def ipc_handle(self, base):
        handle = _IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(
            ctypes.byref(handle), ctypes.c_ulonglong(base)), "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), _IPC_HANDLE_BYTES)

    def open_handle(self, handle):
        if len(handle) != _IPC_HANDLE_BYTES:
            raise RuntimeError("a CUDA IPC handle is %d bytes, not %d"
                               % (_IPC_HANDLE_BYTES, len(handle)))
        raw = _IpcHandle.from_buffer_copy(handle)
        ptr = ctypes.c_ulonglong()
        # CUipcMemHandle is passed by value: a Structure, not an array
        # (which ctypes would pass as a pointer).
        self._check(self.lib.cuIpcOpenMemHandle_v2(
            ctypes.byref(ptr), raw, ctypes.c_uint(_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)),
            "cuIpcOpenMemHandle")
        return ptr.value

    def close_handle(self, ptr):
        self._check(self.lib.cuIpcCloseMemHandle(ctypes.c_ulonglong(ptr)),
                    "cuIpcCloseMemHandle")

    def uuid(self, ordinal):
        """The GPU's UUID as nvidia-smi prints it (and ferryd compares)."""
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal),
                    "cuDeviceGet(%d)" % ordinal)
        raw = (ctypes.c_ubyte * 16)()
        self._check(self.lib.cuDeviceGetUuid_v2(ctypes.byref(raw), dev),
                    "cuDeviceGetUuid")
        h = bytes(raw).hex()
        return "GPU-%s-%s-%s-%s-%s" % (h[0:8], h[8:12], h[12:16], h[16:20],
                                       h[20:32])


_driver: Optional[_Driver] = None
_driver_error: Optional[str] = None
_driver_lock = threading.Lock()


def _get_driver() -> _Driver:
    global _driver, _driver_error
    with _driver_lock:
        if _driver is None and _driver_error is None:
            try:
                _driver = _Driver()
            except (OSError, RuntimeError, AttributeError) as e:
                _driver_error = str(e)
        if _driver is None:
            raise CudaMemoryError(
                "CUDA tensors need the CUDA driver (libcuda.so.1): %s"
                % _driver_error)
        return _driver


def available() -> Tuple[bool, str]:
    """(True, "") when CUDA tensors can be registered here, else (False,
    why not)."""
    try:
        _get_driver()
    except CudaMemoryError as e:
        return False, str(e)
    return True, ""


def is_cuda(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_cuda


@functools.lru_cache(maxsize=None)
def device_uuid(ordinal: int) -> str:
    """The UUID of GPU ``ordinal`` (this process's numbering); asked of the
    driver once per GPU (every region's describe() and every staging
    region an APPLY opens name it)."""
    d = _get_driver()
    return d.uuid(ordinal)


def device_proto(ordinal: int):
    """A ferry.v1.Device for GPU ``ordinal`` of this process."""
    dev = types_pb2.Device(kind=types_pb2.DEVICE_KIND_CUDA,
                           cuda_uuid=device_uuid(ordinal),
                           cuda_ordinal=ordinal)
    return dev


class CudaRegion:
    """One CUDA allocation registered as a ferry region: ``region_id``, the
    allocation's base and size, its IPC handle, its GPU.

    A region made by ``CudaRegions.locate`` does not own its memory (the
    tensors in it do). After ``release()`` (Offload) and ``reallocate()``
    (Onload) it owns a fresh buffer of the same size, and ``view()`` gives
    the tensors at their old offsets, as ``SharedTensorArena.view`` does.
    """

    def __init__(self, region_id: int, ordinal: int, base: int, size: int,
                 handle: bytes, allocation_offset: int = 0):
        self.region_id = region_id
        self.ordinal = ordinal
        self.base = base        # device address of the region's first byte
        self.capacity = size
        self.handle = handle
        self.allocation_offset = allocation_offset
        self._buffer: Optional[torch.Tensor] = None  # owned after reallocate
        self.released = False

    def describe(self):
        """This region as a ferry.v1.MemoryRegion (cuda_ipc)."""
        r = types_pb2.MemoryRegion(region_id=self.region_id,
                                   size_bytes=self.capacity)
        r.cuda_ipc.ipc_handle = self.handle
        r.cuda_ipc.allocation_offset_bytes = self.allocation_offset
        r.cuda_ipc.device.CopyFrom(device_proto(self.ordinal))
        return r

    def offset_of(self, tensor) -> Optional[int]:
        if not is_cuda(tensor) or tensor.device.index != self.ordinal:
            return None
        addr = tensor.data_ptr()
        if self.base <= addr < self.base + self.capacity:
            return addr - self.base
        return None

    def release(self):
        """Lets the memory go (Offload): the engine has dropped its tensors;
        the caching allocator's free segments go back to the driver. A
        warning when the allocation is still there: some tensor still uses
        it (an engine tensor kept, or another tensor the caching allocator
        put in the same segment), so the GPU memory was not given back."""
        self._buffer = None
        self.released = True
        torch.cuda.empty_cache()
        d = _get_driver()
        result, _ = d.on(self.ordinal,
                         lambda: d.attribute(_ATTR_MEMORY_TYPE, self.base))
        if result == _CUDA_SUCCESS:
            log.warning(
                "CUDA region %d: its allocation (%d bytes on cuda:%d) is still "
                "alive after the offload: some tensor still uses it, so its "
                "memory was not given back", self.region_id, self.capacity,
                self.ordinal)

    def reallocate(self):
        """A fresh buffer of the same size on the same GPU (Onload), which
        this region now owns; register it again with ``describe()``."""
        if not self.released:
            raise ValueError("CudaRegion %d: reallocate() after release() only"
                             % self.region_id)
        buf = torch.empty(self.capacity, dtype=torch.uint8,
                          device="cuda:%d" % self.ordinal)
        d = _get_driver()
        base, _ = d.on(self.ordinal, lambda: d.address_range(buf.data_ptr()))
        self.handle = d.on(self.ordinal, lambda: d.ipc_handle(base))
        self.allocation_offset = buf.data_ptr() - base
        self.base = buf.data_ptr()
        self._buffer = buf
        self.released = False

    def view(self, byte_offset: int, shape, dtype) -> torch.Tensor:
        """The tensor at ``byte_offset`` of a region this object owns (after
        ``reallocate()``)."""
        if self._buffer is None:
            raise ValueError("CudaRegion %d: view() needs memory it owns "
                             "(after reallocate())" % self.region_id)
        return _typed(self._buffer, byte_offset, tuple(shape), dtype)


def _storage_nbytes(tensor) -> int:
    if hasattr(tensor, "untyped_storage"):  # torch >= 2.0
        return tensor.untyped_storage().nbytes()
    return tensor.storage().nbytes()


def _typed(raw: torch.Tensor, byte_offset: int, shape, dtype) -> torch.Tensor:
    count = 1
    for s in shape:
        count *= int(s)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = count * itemsize
    if byte_offset < 0 or byte_offset + nbytes > raw.numel():
        raise ValueError("bytes [%d, +%d) are not inside %d bytes"
                         % (byte_offset, nbytes, raw.numel()))
    if byte_offset % itemsize:
        raise ValueError("byte offset %d is not aligned to %s"
                         % (byte_offset, dtype))
    return raw[byte_offset:byte_offset + nbytes].view(dtype).view(shape)


class CudaRegions:
    """The CUDA allocations one rank registers, one region each, found from
    its tensors. Region ids count up from ``first_region_id``."""

    def __init__(self, first_region_id: int = FIRST_REGION_ID):
        self._next_id = first_region_id
        self.regions: List[CudaRegion] = []

    def locate(self, tensor: torch.Tensor, what: str) -> Tuple[CudaRegion, int]:
        """The region holding ``tensor`` (made on first sight of its
        allocation) and the tensor's byte offset in it. Raises
        CudaMemoryError naming ``what`` for memory ferryd cannot open."""
        for r in self.regions:
            off = r.offset_of(tensor)
            if off is not None:
                return r, off
        region = self._new_region(tensor, what)
        self.regions.append(region)
        return region, tensor.data_ptr() - region.base

    def _new_region(self, tensor, what) -> CudaRegion:
        if _storage_nbytes(tensor) == 0 or tensor.data_ptr() == 0:
            raise CudaMemoryError(
                "%s: the tensor has no memory (its storage was freed or "
                "resized to 0); register it while it holds its weights" % what)
        if not tensor.is_contiguous():
            raise CudaMemoryError(
                "%s: the tensor is not contiguous (strides %s); register the "
                "contiguous parameter it views" % (what, tuple(tensor.stride())))
        d = _get_driver()
        ordinal = tensor.device.index
        ptr = tensor.data_ptr()

        def probe():
            res, managed = d.attribute(_ATTR_IS_MANAGED, ptr)
            if res == _CUDA_SUCCESS and managed:
                raise CudaMemoryError(
                    "%s: the tensor is in CUDA managed memory, which has no "
                    "IPC handle; allocate it with the ordinary allocator"
                    % what)
            res, capable = d.attribute(_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
            if res == _CUDA_SUCCESS and not capable:
                raise CudaMemoryError(
                    "%s: the tensor's memory cannot be exported with "
                    "cudaIpcGetMemHandle: PyTorch's expandable_segments (or "
                    "another virtual-memory allocator) made it. Run with "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" % what)
            base, size = d.address_range(ptr)
            try:
                handle = d.ipc_handle(base)
            except RuntimeError as e:
                raise CudaMemoryError(
                    "%s: the tensor's allocation cannot be exported over CUDA "
                    "IPC (%s); PyTorch's expandable_segments memory cannot, "
                    "run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
                    % (what, e)) from None
            return base, size, handle

        base, size, handle = d.on(ordinal, probe)
        region = CudaRegion(self._next_id, ordinal, base, size, handle)
        self._next_id += 1
        return region

    def describe(self) -> list:
        return [r.describe() for r in self.regions]

    def by_id(self) -> Dict[int, CudaRegion]:
        return {r.region_id: r for r in self.regions}

    def ordinals(self) -> List[int]:
        return sorted({r.ordinal for r in self.regions})


class _Mapping:
    """An opened IPC handle; closed when collected (no tensor views it)."""

    def __init__(self, handle: bytes, ordinal: int):
        self.ordinal = ordinal
        self.base = None
        d = _get_driver()
        self.base = d.on(ordinal, lambda: d.open_handle(handle))

    def __del__(self):
        base, self.base = self.base, None
        if base is None or _driver is None:
            return
        try:
            _driver.on(self.ordinal, lambda: _driver.close_handle(base))
        except Exception:  # interpreter shutdown, or the context is gone
            pass


class _ArrayInterface:
    """What torch.as_tensor wraps without a copy; the tensors keep it (and
    through it the mapping) alive."""

    def __init__(self, mapping: _Mapping, ptr: int, size: int):
        self.mapping = mapping
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (ptr, False),
            "version": 3, "strides": None, "stream": None,
        }


class _OpenedStaging:
    """A device staging region ferryd exported, opened in this process
    (cuIpcOpenMemHandle). The handle is closed once this object and every
    tensor from ``tensor()`` are gone."""

    def __init__(self, region, ordinal: int):
        self.size = region.size_bytes
        self.handle = region.cuda_ipc.ipc_handle
        self.offset = region.cuda_ipc.allocation_offset_bytes
        self.ordinal = ordinal
        mapping = _Mapping(self.handle, ordinal)
        self._raw = torch.as_tensor(
            _ArrayInterface(mapping, mapping.base + self.offset, self.size),
            device="cuda:%d" % ordinal)

    def tensor(self, byte_offset: int, shape, dtype) -> torch.Tensor:
        return _typed(self._raw, byte_offset, tuple(shape), dtype)


def open_staging(region, local_ordinal_of) -> "_OpenedStaging":
    """Opens a cuda_ipc staging region of an APPLY. ``local_ordinal_of``
    maps the region's GPU UUID to this process's ordinal (None: not a GPU
    this process sees)."""
    uuid = region.cuda_ipc.device.cuda_uuid
    ordinal = local_ordinal_of(uuid)
    if ordinal is None:
        raise CudaMemoryError(
            "staging region %d is on GPU %s, which this process does not see"
            % (region.region_id, uuid))
    return _OpenedStaging(region, ordinal)


def ordinal_of_uuid(uuid: str) -> Optional[int]:
    """This process's ordinal of the GPU with ``uuid``, or None."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None
