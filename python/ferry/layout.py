"""Layouts: which boxes of which checkpoint parameters a rank's tensors hold.

Sources describe each local tensor with ``Shard``s (core/piece.h pieces);
destinations describe their live parameters with ``EngineParam``s (an engine
parameter table, core/layout_resolution.h), which the daemon resolves into
direct, fused or fallback pieces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, Union

from ferry import dtypes
from ferry.v1 import registration_pb2, types_pb2

if TYPE_CHECKING:
    import torch

# Loader kinds (registration.proto LoaderKind).
REPLICATED = registration_pb2.LOADER_KIND_REPLICATED
COLUMN = registration_pb2.LOADER_KIND_COLUMN
ROW = registration_pb2.LOADER_KIND_ROW
VOCAB_PARALLEL = registration_pb2.LOADER_KIND_VOCAB_PARALLEL
FUSED = registration_pb2.LOADER_KIND_FUSED
CUSTOM = registration_pb2.LOADER_KIND_CUSTOM

# Loader flags: any of them makes the parameter fallback.
PACKED = registration_pb2.LOADER_FLAG_PACKED
TRANSPOSED = registration_pb2.LOADER_FLAG_TRANSPOSED
PRE_SHARDED = registration_pb2.LOADER_FLAG_PRE_SHARDED
WRAPPED_LOADER = registration_pb2.LOADER_FLAG_WRAPPED_LOADER
TRANSFORMED = registration_pb2.LOADER_FLAG_TRANSFORMED


class Shard:
    """The box of checkpoint parameter ``name`` (global ``shape``) that a local
    tensor, or one part of it, holds.

    ``dim=None``: the whole parameter (replicated: norms, DP replicas).
    ``dim=d``: rows ``[offset, offset + extent)`` along d, the full extent
    along every other dim. By default an even split: ``extent = shape[d] //
    world`` and ``offset = rank * extent`` (Megatron column parallel: d=0,
    row parallel: d=1, vocab parallel: d=0).
    """

    def __init__(self, name: str, shape: Sequence[int], dim: Optional[int] = None,
                 rank: int = 0, world: int = 1, offset: Optional[int] = None,
                 extent: Optional[int] = None) -> None:
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dim = dim
        if dim is None:
            self.offset, self.extent = 0, None
            return
        if not 0 <= dim < len(self.shape):
            raise ValueError("Shard %s: dim %d outside shape %s" % (name, dim, self.shape))
        if extent is None:
            if self.shape[dim] % world:
                raise ValueError(
                    "Shard %s: %d rows along dim %d do not split evenly over %d "
                    "ranks; give offset and extent" % (name, self.shape[dim], dim, world))
            extent = self.shape[dim] // world
        self.extent = int(extent)
        self.offset = int(rank * extent if offset is None else offset)

    def box_extent(self) -> List[int]:
        ext = list(self.shape)
        if self.dim is not None:
            ext[self.dim] = self.extent
        return ext

    def box_offset(self) -> List[int]:
        off = [0] * len(self.shape)
        if self.dim is not None:
            off[self.dim] = self.offset
        return off


class FlatShard:
    """Elements ``[start, start + numel)`` of checkpoint parameter ``name``
    (global ``shape``) in row-major order, held by a 1-D local tensor: an
    FSDP flat parameter's shard (its slice of one original parameter).
    Declared as at most 2 x ndim - 1 boxes, each contiguous in the local
    tensor."""

    def __init__(self, name: str, shape: Sequence[int], start: int,
                 numel: int) -> None:
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.start, self.numel = int(start), int(numel)
        total = 1
        for d in self.shape:
            total *= d
        if self.start < 0 or self.numel <= 0 or self.start + self.numel > total:
            raise ValueError("FlatShard %s: elements [%d, %d) outside the %d of %s"
                             % (name, self.start, self.start + self.numel, total,
                                self.shape))

    def boxes(self) -> List[Tuple[List[int], List[int], int]]:
        """(offset, extent, first element's index in the local tensor)."""
        return [(off, ext, first - self.start) for off, ext, first in
                _flat_boxes(list(self.shape), self.start, self.start + self.numel)]


def _flat_boxes(shape: List[int], start: int, end: int
                ) -> List[Tuple[List[int], List[int], int]]:
    """Row-major elements [start, end) of ``shape`` as boxes, each with the
    flat index of its first element: a partial first slice of dim 0, whole
    slices, a partial last slice (the partial ones split the same way)."""
    if start >= end:
        return []
    if len(shape) == 1:
        return [([start], [end - start], start)]
    inner = 1
    for d in shape[1:]:
        inner *= d
    zeros = [0] * (len(shape) - 1)
    out = []
    if start % inner:
        row = start // inner
        stop = min(end, (row + 1) * inner)
        out += [([row] + o, [1] + e, f + row * inner) for o, e, f in
                _flat_boxes(shape[1:], start - row * inner, stop - row * inner)]
        start = stop
    whole = (end - start) // inner
    if whole and start < end:
        out.append(([start // inner] + zeros, [whole] + shape[1:], start))
        start += whole * inner
    if start < end:
        row = start // inner
        out += [([row] + o, [1] + e, f + row * inner) for o, e, f in
                _flat_boxes(shape[1:], 0, end - start)]
    return out


def pieces_for_tensor(tensor: "torch.Tensor",
                      shards: Union[Shard, FlatShard, Sequence[Shard]],
                      region_id: int, byte_offset: int) -> List[types_pb2.Piece]:
    """Pieces (ferry.v1.Piece) of a local tensor at ``byte_offset`` of region
    ``region_id``. Several shards are parts concatenated along their common
    dim (a fused tensor, e.g. Megatron's qkv); a FlatShard's tensor is 1-D
    and contiguous."""
    if isinstance(shards, (list, tuple)) and len(shards) == 1:
        shards = shards[0]
    if isinstance(shards, (list, tuple)) and any(isinstance(s, FlatShard) for s in shards):
        raise ValueError("a FlatShard describes its local tensor alone, not as one "
                         "of several parts: %s" % [s.name for s in shards])
    if isinstance(shards, FlatShard):
        if tensor.dim() != 1 or not tensor.is_contiguous() or (
                tensor.numel() != shards.numel):
            raise ValueError("FlatShard %s: the local tensor must be 1-D, contiguous "
                             "and hold its %d elements, not %s"
                             % (shards.name, shards.numel, tuple(tensor.shape)))
        pieces = []
        for off, ext, first in shards.boxes():
            p = types_pb2.Piece(parameter=shards.name, region_id=region_id,
                                byte_offset=byte_offset + first * tensor.element_size())
            p.box.offset.extend(off)
            p.box.extent.extend(ext)
            strides, n = [], 1
            for e in reversed(ext):
                strides.insert(0, n)
                n *= e
            p.strides.extend(strides)
            pieces.append(p)
        return pieces
    if isinstance(shards, Shard):
        shards = [shards]
    itemsize = tensor.element_size()
    strides = list(tensor.stride())
    pieces = []
    if len(shards) > 1 and any(s.dim is None for s in shards):
        raise ValueError("fused parts %s need a split dim" % [s.name for s in shards])
    dim = shards[0].dim
    pos = 0
    for s in shards:
        if s.dim != dim:
            raise ValueError("fused parts %s must split along one dim" % (
                [x.name for x in shards]))
        ext = s.box_extent()
        for d, (local, want) in enumerate(zip(tensor.shape, ext)):
            if d != dim and local != want:
                raise ValueError("%s: local shape %s does not hold box extent %s"
                                 % (s.name, tuple(tensor.shape), ext))
        p = types_pb2.Piece(parameter=s.name, region_id=region_id,
                            byte_offset=byte_offset + (pos * strides[dim] * itemsize
                                                       if dim is not None else 0))
        p.box.offset.extend(s.box_offset())
        p.box.extent.extend(ext)
        p.strides.extend(strides)
        pieces.append(p)
        if dim is not None:
            pos += s.extent
    if dim is not None and pos != tensor.shape[dim]:
        raise ValueError("parts %s cover %d of the %d rows along dim %d" % (
            [s.name for s in shards], pos, tensor.shape[dim], dim))
    return pieces


class FusedPart:
    """One part of a fused engine parameter (registration.proto FusedPart).

    ``local_extent``: rows of this part in the rank's live tensor; 0 for an
    even split. Set it for GQA kv heads replicated over ranks (TP > kv
    heads): the rows the rank holds, e.g. one head of 128 rows."""

    def __init__(self, checkpoint_name: str, local_extent: int = 0,
                 lead_index: Sequence[int] = ()) -> None:
        self.checkpoint_name = checkpoint_name
        self.local_extent = int(local_extent)
        self.lead_index = tuple(int(i) for i in lead_index)


def _torch_uint8() -> "torch.dtype":
    return dtypes.torch_module().uint8


class Fp8:
    """FP8 in flight (registration.proto Fp8Quantization; docs/api.md,
    "Quantized in flight"): set on a live FP8 weight that ferry fills from
    the bf16, fp16 or fp32 checkpoint parameter its loader names, quantized
    per block of ``block`` (rows, cols) with DeepGEMM's rule. ``scale``
    names the engine parameter of the rank holding the weight's block
    scales (vLLM's ``...weight_scale_inv``): float32, of shape the weight's
    lead dims, then ceil(rows / block rows), ceil(cols / block cols).
    ``format`` ("e4m3" or "e5m2") is the weight's element type where the
    torch in use has no float8 dtype and the weight is held as uint8; a
    float8 tensor's own dtype wins."""

    FORMATS: Dict[str, int] = {"e4m3": types_pb2.DTYPE_F8_E4M3,
                               "e5m2": types_pb2.DTYPE_F8_E5M2}

    def __init__(self, scale: str, block: Sequence[int] = (128, 128),
                 format: str = "e4m3") -> None:
        if not scale:
            raise ValueError("ferry.Fp8: name the scale tensor's engine parameter")
        if len(block) != 2 or any(int(b) < 1 for b in block):
            raise ValueError("ferry.Fp8: block must be two positive sizes, got %r"
                             % (block,))
        if format not in self.FORMATS:
            raise ValueError("ferry.Fp8: format must be one of %s, got %r"
                             % (", ".join(self.FORMATS), format))
        self.scale = scale
        self.block = (int(block[0]), int(block[1]))
        self.format = format


class EngineParam:
    """One live parameter of an engine rank (registration.proto
    EngineParameter). ``tensor`` must be contiguous and live in a registered
    arena. ``loader`` is one of REPLICATED, COLUMN, ROW, VOCAB_PARALLEL,
    FUSED, CUSTOM; ``loader_tp_size`` defaults to the instance's tp_size.
    ``alias_of``: tied parameters (lm_head.weight sharing the embedding's
    storage) name the parameter whose bytes they are; ferry writes them
    once, through that one (registration.proto EngineParameter.alias_of).
    ``fp8``: a ferry.Fp8 on a live FP8 weight fed from a wider checkpoint
    parameter (FP8 in flight: ferryd quantizes it, block by block, on the
    node that holds the trainer's shards of it; with TRANSFORMED among
    ``flags`` the whole tensor reaches the engine's loader quantized, as
    FP8 elements and scales; docs/api.md, "Quantized in flight")."""

    def __init__(self, name: str, tensor: "torch.Tensor", loader: int,
                 shard_dim: int = 0,
                 fused_parts: Sequence[Union[str, FusedPart]] = (),
                 flags: Sequence[int] = (), consumes: Sequence[str] = (),
                 loader_tp_size: Optional[int] = None, alias_of: str = "",
                 fp8: Optional[Fp8] = None) -> None:
        if not tensor.is_contiguous():
            raise ValueError("engine parameter %s is not contiguous" % name)
        self.name = name
        self.tensor = tensor
        self.loader = loader
        self.shard_dim = int(shard_dim)
        self.fused_parts = [p if isinstance(p, FusedPart) else FusedPart(p)
                            for p in fused_parts]
        self.flags = list(flags)
        self.consumes = list(consumes)
        self.loader_tp_size = loader_tp_size
        self.alias_of = alias_of or ""
        self.fp8 = fp8

    def to_proto(self, region_id: int, byte_offset: int,
                 tp_size: int) -> registration_pb2.EngineParameter:
        dtype = (Fp8.FORMATS[self.fp8.format]
                 if self.fp8 is not None and self.tensor.dtype == _torch_uint8()
                 else dtypes.to_proto(self.tensor.dtype))
        p = registration_pb2.EngineParameter(
            name=self.name, dtype=dtype,
            region_id=region_id, byte_offset=byte_offset, loader=self.loader,
            loader_tp_size=self.loader_tp_size or tp_size,
            shard_dim=self.shard_dim)
        p.local_shape.extend(int(d) for d in self.tensor.shape)
        p.flags.extend(self.flags)
        for part in self.fused_parts:
            fp = p.fused_parts.add(checkpoint_name=part.checkpoint_name,
                                   local_extent=part.local_extent)
            fp.lead_index.extend(part.lead_index)
        p.consumes.extend(self.consumes)
        p.alias_of = self.alias_of
        if self.fp8 is not None:
            p.fp8.scale_parameter = self.fp8.scale
            p.fp8.block_rows, p.fp8.block_cols = self.fp8.block
        return p
