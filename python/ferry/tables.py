"""vLLM's engine tables from a Hugging Face config.json, in one call.

    table = ferry.vllm_table(config, tp_size=2, tp_rank=0, ep=True)
    arena = ferry.SharedTensorArena("vllm-0.tp0", table.buffer_bytes)
    params = table.bind(arena)          # ferry.EngineParam, tensors in arena
    dst = ferry.DestinationClient.register(conn, "vllm-0", "policy", 0, 2, arena,
                                           params, Engine())

The tables are built by ferry's C++ (core/models, the same code its tests
and benchmarks plan with) through a small shared library,
libferry_tables.so: a C++ build output (bazel build
//python:libferry_tables.so), not part of the wheel, found at
$FERRY_TABLES_LIB, else in the ferry package's directory or the one above
it. They lay every live parameter out as vLLM allocates it
(fused qkv_proj / gate_up_proj, MoE w13 / w2 with lead_index per expert,
vocabulary padding, FP8 weight_scale_inv), one contiguous buffer per rank,
each parameter 256-byte aligned (docs/python.md, "Engine tables from a
config.json").
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from ferry import dtypes, layout

if TYPE_CHECKING:
    import torch

    from ferry.arena import SharedTensorArena

_LOADERS = {
    "replicated": layout.REPLICATED, "column": layout.COLUMN, "row": layout.ROW,
    "vocab_parallel": layout.VOCAB_PARALLEL, "fused": layout.FUSED,
    "custom": layout.CUSTOM,
}
# core/layout_resolution.h EngineParamFlag bits -> registration.proto flags.
_FLAGS = [(1 << 0, layout.PACKED), (1 << 1, layout.TRANSPOSED),
          (1 << 2, layout.PRE_SHARDED), (1 << 3, layout.WRAPPED_LOADER),
          (1 << 4, layout.TRANSFORMED)]
_lib = None


def _library():
    global _lib
    if _lib is not None:
        return _lib
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("FERRY_TABLES_LIB", ""),
                  os.path.join(here, "libferry_tables.so"),
                  os.path.join(os.path.dirname(here), "libferry_tables.so")]
    for path in candidates:
        if path and os.path.exists(path):
            lib = ctypes.CDLL(path)
            lib.ferry_vllm_tables_json.restype = ctypes.c_void_p
            lib.ferry_vllm_tables_json.argtypes = [ctypes.c_char_p, ctypes.c_int,
                                                   ctypes.c_int, ctypes.c_char_p]
            lib.ferry_free.argtypes = [ctypes.c_void_p]
            _lib = lib
            return lib
    raise RuntimeError(
        "ferry.vllm_table needs libferry_tables.so, ferry's C++ table builder, "
        "which the wheel does not carry: build it (bazel build -c opt "
        "//python:libferry_tables.so, then take bazel-bin/python/"
        "libferry_tables.so) and name it in $FERRY_TABLES_LIB, or copy it "
        "beside the ferry package; looked in: %s" %
        ", ".join(p for p in candidates if p))


class ParamLayout:
    """One live parameter of a rank's table, before it has a tensor."""

    def __init__(self, d: Dict[str, Any]) -> None:
        self.name = d["name"]
        self.dtype_name = d["dtype"]
        self.shape = tuple(d["shape"])
        self.byte_offset = d["byte_offset"]
        self.loader = _LOADERS[d["loader"]]
        self.loader_name = d["loader"]
        self.shard_dim = d["shard_dim"]
        self.flags = [f for bit, f in _FLAGS if d["flags"] & bit]
        self.consumes = list(d["consumes"])
        self.alias_of = d["alias_of"]
        self.parts = [layout.FusedPart(p["checkpoint_name"], p["local_extent"],
                                       p["lead_index"]) for p in d["parts"]]
        # FP8 in flight (trainer_dtype): the weight's scales and block.
        f = d.get("fp8")
        self.fp8: Optional[layout.Fp8] = None if f is None else layout.Fp8(
            f["scale"], block=(f["block_rows"], f["block_cols"]),
            format="e5m2" if self.dtype_name == "f8_e5m2" else "e4m3")

    @property
    def dtype(self) -> "torch.dtype":
        """Its torch dtype; for an FP8 weight quantized in flight in a torch
        without float8, uint8 (its ``fp8`` declares the format)."""
        try:
            return dtypes.from_name(self.dtype_name)
        except ValueError as e:
            if self.fp8 is not None:
                return dtypes.torch_module().uint8
            raise ValueError("%s: %s" % (self.name, e)) from None

    def __repr__(self) -> str:
        return "ParamLayout(%s %s%s %s @%d)" % (self.name, self.dtype_name,
                                                list(self.shape), self.loader_name,
                                                self.byte_offset)


class VllmTable:
    """One TP rank's engine table: ``params`` (ParamLayout, in checkpoint
    order) and ``buffer_bytes`` (the one buffer they live in);
    ``checkpoint`` lists the checkpoint's tensors as (name, dtype name,
    shape) tuples, for the trainer side."""

    def __init__(self, tp_rank: int, tp_size: int, d: Dict[str, Any],
                 checkpoint: List[Tuple[str, str, Tuple[int, ...]]]) -> None:
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.buffer_bytes = d["buffer_bytes"]
        self.params = [ParamLayout(p) for p in d["params"]]
        self.checkpoint = checkpoint

    def bind(self, arena: "SharedTensorArena") -> List[layout.EngineParam]:
        """Reserves ``buffer_bytes`` in ``arena`` and returns the table as
        ferry.EngineParam objects whose tensors view their bytes there."""
        base = arena.allocate(self.buffer_bytes)
        out = []
        for p in self.params:
            tensor = arena.view(base + p.byte_offset, p.shape, p.dtype)
            out.append(layout.EngineParam(
                p.name, tensor, p.loader, shard_dim=p.shard_dim,
                fused_parts=p.parts, flags=p.flags, consumes=p.consumes,
                alias_of=p.alias_of, fp8=p.fp8))
        return out


def vllm_table(config: Union[Dict[str, Any], str], tp_size: int, tp_rank: int,
               ep: bool = False, trainer_dtype: Optional[str] = None) -> VllmTable:
    """vLLM's engine table for rank ``tp_rank`` of a ``tp_size`` instance.

    ``config``: a Hugging Face config.json as a dict, its text, or a path.
    ``ep``: expert parallelism (each rank holds E / tp_size whole experts).
    ``trainer_dtype``: for an FP8 block-scaled model (DeepSeek-V3, Kimi-K2:
    ``quantization_config.weight_block_size`` set) whose trainer holds it
    in "bf16", "f16" or "f32": every FP8 weight is declared quantized in
    flight (its ``fp8``: its ``weight_scale_inv`` and block; docs/api.md,
    "Quantized in flight"), MLA's ``kv_b_proj`` through the loader
    quantized, and ``checkpoint`` lists the tensors as the trainer holds
    them (no scales). None: the checkpoint as it is.
    Raises ValueError naming the field or parameter where ferry (or vLLM)
    would refuse the model at this size, or an architecture it does not
    build tables for."""
    if isinstance(config, dict):
        text = json.dumps(config)
    elif isinstance(config, str) and config.lstrip().startswith("{"):
        text = config
    else:
        with open(config) as f:
            text = f.read()
    if not 0 <= tp_rank < tp_size:
        raise ValueError("tp_rank %d is outside [0, %d)" % (tp_rank, tp_size))
    lib = _library()
    ptr = lib.ferry_vllm_tables_json(text.encode(), int(tp_size), 1 if ep else 0,
                                     (trainer_dtype or "").encode())
    try:
        answer = json.loads(ctypes.string_at(ptr).decode())
    finally:
        lib.ferry_free(ptr)
    if "error" in answer:
        raise ValueError("ferry.vllm_table: " + answer["error"])
    checkpoint = [(c["name"], c["dtype"], tuple(c["shape"]))
                  for c in answer["checkpoint"]]
    return VllmTable(tp_rank, tp_size, answer["tables"][tp_rank], checkpoint)
