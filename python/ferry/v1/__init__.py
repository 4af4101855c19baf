"""The ferry.v1 gRPC API as Python modules: ``ferry.v1.<file>_pb2`` and
``ferry.v1.<file>_pb2_grpc`` for types, registration, version, inspection,
lifecycle and peer (docs/api.md).

They are generated from proto/ferry/v1/*.proto by python/gen_stubs.py, never
checked in: the wheel carries them (``pip wheel ./python`` runs it), and
under Bazel the genrule //python:ferry_v1_stubs puts them beside this file
in the runfiles tree. A checkout's python/ directory alone has none.
"""

import os as _os

_NAMES = ("types", "registration", "version", "inspection", "lifecycle", "peer")
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_MISSING = [n + suffix for n in _NAMES for suffix in ("_pb2.py", "_pb2_grpc.py")
            if not _os.path.exists(_os.path.join(_HERE, n + suffix))]
if _MISSING:
    raise ImportError(
        "ferry: the ferry.v1 stubs are not in %s (%d of %d files missing, "
        "%s first). They are "
        "generated from proto/, never checked in: install the wheel "
        "(pip wheel --no-deps --no-build-isolation ./python, then pip install "
        "the ferry-*.whl it writes), or run under Bazel with "
        "//python:ferry_runtime in the target's data (python/run_python.sh)"
        % (_HERE, len(_MISSING), 2 * len(_NAMES), _MISSING[0]))
del _os
