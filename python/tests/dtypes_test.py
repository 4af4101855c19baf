"""ferry.dtypes: the one torch <-> ferry.v1.DType table. Every entry
round-trips (torch -> wire -> torch, wire -> torch -> wire, name -> torch),
its size is torch's, every element type of types.proto's DType enum is in
the table (the block-quantized GGUF types are not element types), and what
the wire lacks is refused naming the dtype.

Usage: dtypes_test.py
"""

import torch

import ferry
from ferry import dtypes
from ferry.v1 import types_pb2


def main():
    checked = []
    for d in dtypes.TABLE:
        assert dtypes.lookup(d.wire) == d
        assert dtypes.name_of(d.wire) == d.name
        t = getattr(torch, d.torch_name, None)
        if t is None:  # float8 in a torch without it
            assert d.torch_name.startswith("float8"), d
            try:
                dtypes.from_proto(d.wire)
                raise AssertionError("%s mapped without torch.%s" % (d.name, d.torch_name))
            except ValueError as e:
                assert types_pb2.DType.Name(d.wire) in str(e), e
            continue
        assert dtypes.to_proto(t) == d.wire, d
        assert dtypes.from_proto(d.wire) is t, d
        assert dtypes.to_proto(dtypes.from_proto(d.wire)) == d.wire
        assert dtypes.from_proto(dtypes.to_proto(t)) is t
        assert dtypes.from_name(d.name) is t
        assert torch.empty((), dtype=t).element_size() == d.itemsize, d
        checked.append(d.name)
    for name in ("f32", "f16", "bf16", "i8", "u8", "i32", "i64", "bool"):
        assert name in checked, (name, checked)

    # The table covers the wire's element types: all but UNSPECIFIED and
    # the GGUF block formats (Q4_0 ... Q6_K).
    wire = {v for n, v in types_pb2.DType.items()
            if n != "DTYPE_UNSPECIFIED" and not n.startswith("DTYPE_Q")}
    assert wire == {d.wire for d in dtypes.TABLE}, sorted(wire)

    for t in (torch.int16, torch.float64, torch.complex64):
        try:
            dtypes.to_proto(t)
            raise AssertionError("%s has a wire dtype?" % t)
        except ValueError as e:
            assert str(t) in str(e), e
    for bad in (types_pb2.DTYPE_Q4_K, types_pb2.DTYPE_UNSPECIFIED, 99):
        try:
            dtypes.from_proto(bad)
            raise AssertionError("wire dtype %d mapped to torch" % bad)
        except ValueError:
            pass
    try:
        dtypes.from_name("q4_k")
        raise AssertionError("q4_k mapped to torch")
    except ValueError as e:
        assert "q4_k" in str(e), e

    # The users of the table: engine parameters and vLLM tables.
    arena = ferry.SharedTensorArena("dtypes-test", 1 << 12)
    p = ferry.EngineParam("x", arena.tensor((4,), torch.bfloat16), ferry.REPLICATED)
    assert p.to_proto(0, 0, 1).dtype == types_pb2.DTYPE_BF16
    print("dtypes_test: %d entries round-trip (%s)" % (len(checked), ", ".join(checked)))


if __name__ == "__main__":
    main()
