"""Loads the ferry.v1 Python stubs, generated from proto/ at build time.

Nothing generated is checked in. The stubs are the modules
``proto.ferry.v1.<file>_pb2`` / ``_pb2_grpc`` (protoc run with ``-I.`` from
the repository root, as //proto:ferry_py_proto does). They are found, in
order:

1. already importable (Bazel: the genrule outputs of //proto:ferry_py_proto
   in the runfiles tree, whose root is on PYTHONPATH);
2. ``$FERRY_PY_PROTO_DIR`` (a directory holding ``proto/ferry/v1/*_pb2.py``);
3. generated here with ``protoc --python_out --grpc_python_out`` into
   ``$FERRY_PROTO_BUILD_DIR`` (default ``~/.cache/ferry/py-proto/<hash of the
   .proto files>``), from the repository's proto/ directory next to python/.
"""

import hashlib
import importlib
import os
import subprocess
import sys
import tempfile

_FILES = ("types", "registration", "version", "inspection", "lifecycle", "peer")
_PROTOC = os.environ.get("FERRY_PROTOC", "/usr/bin/protoc")
_GRPC_PLUGIN = os.environ.get("FERRY_GRPC_PYTHON_PLUGIN",
                              "/usr/bin/grpc_python_plugin")


def _repo_root():
    # python/ferry/_stubs.py -> the repository root (two levels above python/ferry).
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(here))


def _try_import():
    try:
        mods = {}
        for f in _FILES:
            mods[f] = importlib.import_module("proto.ferry.v1.%s_pb2" % f)
            mods[f + "_grpc"] = importlib.import_module(
                "proto.ferry.v1.%s_pb2_grpc" % f)
        return mods
    except ImportError:
        for name in list(sys.modules):
            if name == "proto" or name.startswith("proto."):
                if sys.modules[name] is None:
                    del sys.modules[name]
        return None


def _generate(root):
    protos = [os.path.join("proto", "ferry", "v1", f + ".proto") for f in _FILES]
    missing = [p for p in protos if not os.path.exists(os.path.join(root, p))]
    if missing:
        raise ImportError(
            "ferry: cannot find the ferry.v1 stubs: not importable, "
            "$FERRY_PY_PROTO_DIR unset, and %s has no %s to generate them from"
            % (root, ", ".join(missing)))
    digest = hashlib.sha256()
    for p in protos:
        with open(os.path.join(root, p), "rb") as fh:
            digest.update(fh.read())
    out = os.environ.get("FERRY_PROTO_BUILD_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "ferry", "py-proto",
        digest.hexdigest()[:16])
    marker = os.path.join(out, "proto", "ferry", "v1", "peer_pb2_grpc.py")
    if not os.path.exists(marker):
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".gen-", dir=os.path.dirname(out) or ".")
        cmd = [_PROTOC, "-I.", "--python_out=" + tmp, "--grpc_python_out=" + tmp,
               "--plugin=protoc-gen-grpc_python=" + _GRPC_PLUGIN] + protos
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImportError("ferry: %s failed: %s" % (" ".join(cmd), proc.stderr))
        try:
            os.rename(tmp, out)  # atomic; a concurrent generator may win
        except OSError:
            if not os.path.exists(marker):
                raise
    return out


def load():
    mods = _try_import()
    if mods is not None:
        return mods
    explicit = os.environ.get("FERRY_PY_PROTO_DIR")
    path = explicit if explicit else _generate(_repo_root())
    if path not in sys.path:
        sys.path.insert(0, path)
    mods = _try_import()
    if mods is None:
        raise ImportError("ferry: no proto.ferry.v1 stubs under %s" % path)
    return mods


_M = load()
types_pb2 = _M["types"]
registration_pb2 = _M["registration"]
registration_pb2_grpc = _M["registration_grpc"]
version_pb2 = _M["version"]
version_pb2_grpc = _M["version_grpc"]
inspection_pb2 = _M["inspection"]
inspection_pb2_grpc = _M["inspection_grpc"]
lifecycle_pb2 = _M["lifecycle"]
lifecycle_pb2_grpc = _M["lifecycle_grpc"]
