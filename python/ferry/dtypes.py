"""Element types: torch dtype <-> ferry.v1.DType <-> ferry's names, in one table.

ferry.v1.DType (proto/ferry/v1/types.proto) has the element types below and
GGUF's block-quantized ones (Q4_0 ... Q6_K), which have no torch dtype and
are not listed. ``name`` is ferry's canonical name (core/dtype.h
kDTypeTable: what libferry_tables.so's JSON and ferryctl print). float8
entries map to torch only where torch has float8_e4m3fn / float8_e5m2; the
wire has no int16, float64 or complex type.

torch is imported on first use, not with ``import ferry``: a process that
only controls ferryd (lifecycle calls, inspection) needs no PyTorch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Dict, NamedTuple, Optional, Tuple

from ferry.v1 import types_pb2

if TYPE_CHECKING:
    import torch


class DType(NamedTuple):
    """One row of the table."""
    wire: int          # ferry.v1.DType value
    name: str          # ferry's name (core/dtype.h)
    torch_name: str    # attribute of the torch module
    itemsize: int      # bytes per element


TABLE: Tuple[DType, ...] = (
    DType(types_pb2.DTYPE_F32, "f32", "float32", 4),
    DType(types_pb2.DTYPE_F16, "f16", "float16", 2),
    DType(types_pb2.DTYPE_BF16, "bf16", "bfloat16", 2),
    DType(types_pb2.DTYPE_F8_E4M3, "f8_e4m3", "float8_e4m3fn", 1),
    DType(types_pb2.DTYPE_F8_E5M2, "f8_e5m2", "float8_e5m2", 1),
    DType(types_pb2.DTYPE_I8, "i8", "int8", 1),
    DType(types_pb2.DTYPE_U8, "u8", "uint8", 1),
    DType(types_pb2.DTYPE_I32, "i32", "int32", 4),
    DType(types_pb2.DTYPE_I64, "i64", "int64", 8),
    DType(types_pb2.DTYPE_BOOL, "bool", "bool", 1),
)

_BY_WIRE: Dict[int, DType] = {d.wire: d for d in TABLE}
_BY_NAME: Dict[str, DType] = {d.name: d for d in TABLE}


def torch_module():
    """The torch module; ImportError saying what needs it when it is absent."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "ferry: tensors need PyTorch, which is not importable here (%s); "
            "install it, or the wheel with its extra: pip install "
            "'ferry[torch]'" % e) from None
    return torch


@functools.lru_cache(maxsize=None)
def _torch_maps() -> Tuple[Dict["torch.dtype", DType], Dict[int, "torch.dtype"]]:
    torch = torch_module()
    to_wire, from_wire = {}, {}
    for d in TABLE:
        t = getattr(torch, d.torch_name, None)
        if t is None:
            continue  # float8 in an older torch
        to_wire[t] = d
        from_wire[d.wire] = t
    return to_wire, from_wire


def to_proto(dtype: "torch.dtype") -> int:
    """The ferry.v1.DType of a torch dtype; ValueError if the wire has none."""
    try:
        return _torch_maps()[0][dtype].wire
    except KeyError:
        raise ValueError("ferry: dtype %s has no ferry.v1.DType (ferry moves %s)"
                         % (dtype, ", ".join(d.torch_name for d in TABLE))) from None


def from_proto(wire: int) -> "torch.dtype":
    """The torch dtype of a ferry.v1.DType; ValueError for one torch lacks
    (block-quantized, or float8 in an older torch)."""
    try:
        return _torch_maps()[1][wire]
    except KeyError:
        raise ValueError("ferry: ferry.v1.DType %s has no torch dtype here"
                         % _wire_name(wire)) from None


def view_dtype(wire: int) -> "torch.dtype":
    """The torch dtype a tensor of a ferry.v1.DType is viewed as: its own,
    or for float8 in a torch without it, uint8 (the raw bytes: an FP8
    fallback tensor, FP8 in flight through the engine's loader)."""
    if wire in (types_pb2.DTYPE_F8_E4M3, types_pb2.DTYPE_F8_E5M2) and \
            wire not in _torch_maps()[1]:
        return torch_module().uint8
    return from_proto(wire)


def from_name(name: str) -> "torch.dtype":
    """The torch dtype of one of ferry's names ("bf16", "f8_e4m3")."""
    d = _BY_NAME.get(name)
    if d is None:
        raise ValueError("ferry: dtype %r is not one of ferry's element types "
                         "with a torch dtype (%s)" % (name, ", ".join(_BY_NAME)))
    return from_proto(d.wire)


def name_of(wire: int) -> str:
    """ferry's name of a ferry.v1.DType ("bf16")."""
    d = _BY_WIRE.get(wire)
    if d is None:
        raise ValueError("ferry: ferry.v1.DType %s is not an element type"
                         % _wire_name(wire))
    return d.name


def lookup(wire: int) -> Optional[DType]:
    """The table's row for a ferry.v1.DType, or None."""
    return _BY_WIRE.get(wire)


def _wire_name(wire: int) -> str:
    try:
        return types_pb2.DType.Name(wire)
    except ValueError:
        return str(wire)
