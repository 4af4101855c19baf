#!/usr/bin/env python3
"""Generates the ferry.v1 Python stubs inside the ferry package.

One rule for both builds: setup.py (the wheel) and the genrule
//python:ferry_v1_stubs (Bazel) run this script. protoc compiles
proto/ferry/v1/<name>.proto (imported as "proto/ferry/v1/...", so the include
root is the repository root) into <name>_pb2.py and <name>_pb2_grpc.py, whose
imports name the module path proto.ferry.v1; they are rewritten to live in
the package as ferry/v1/<name>_pb2.py and import each other as
``from ferry.v1 import types_pb2``, so nothing but ``ferry`` is a top-level
module. The descriptors themselves are untouched (their file names stay
"proto/ferry/v1/<name>.proto", as ferryd's are).

    gen_stubs.py --out DIR [--include ROOT] [--protoc P] [--grpc_plugin P] \
        proto/ferry/v1/types.proto ...

writes DIR/ferry/v1/<name>_pb2.py and _pb2_grpc.py for every .proto given,
which must be exactly the files of PROTOS (a proto added to proto/BUILD must
be added here and to python/BUILD's genrule too).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

# The ferry.v1 files, in dependency order.
PROTOS = ("types", "registration", "version", "inspection", "lifecycle", "peer")
PROTO_DIR = os.path.join("proto", "ferry", "v1")
PROTOC = "/usr/bin/protoc"
GRPC_PLUGIN = "/usr/bin/grpc_python_plugin"

_IMPORT = re.compile(r"^from proto\.ferry\.v1 import (\w+_pb2) as ", re.M)
_MODULE = re.compile(r"'proto\.ferry\.v1\.(\w+_pb2)'")


def stub_files():
    """The files this script writes, relative to --out."""
    out = []
    for name in PROTOS:
        out.append(os.path.join("ferry", "v1", name + "_pb2.py"))
        out.append(os.path.join("ferry", "v1", name + "_pb2_grpc.py"))
    return out


def rewrite(text, path):
    """protoc's module paths proto.ferry.v1.X -> ferry.v1.X."""
    text = _IMPORT.sub(r"from ferry.v1 import \1 as ", text)
    text = _MODULE.sub(r"'ferry.v1.\1'", text)
    # Whatever else names the module path would import a top-level `proto`.
    left = [line for line in text.splitlines()
            if re.search(r"\bproto\.ferry\b", line)]
    if left:
        raise RuntimeError("%s: protoc output names proto.ferry after the "
                           "rewrite: %s" % (path, left[0][:120]))
    return text


def generate(include_root, protos, out_dir, protoc=PROTOC,
             grpc_plugin=GRPC_PLUGIN):
    """Runs protoc on ``protos`` (paths relative to ``include_root``) and
    writes the rewritten stubs under out_dir/ferry/v1/."""
    names = sorted(os.path.basename(p)[:-len(".proto")] for p in protos)
    if names != sorted(PROTOS):
        raise RuntimeError(
            "gen_stubs: given the protos %s, expected %s; a new ferry.v1 "
            "file goes into gen_stubs.PROTOS and python/BUILD's "
            "ferry_v1_stubs outs" % (names, sorted(PROTOS)))
    for tool in (protoc, grpc_plugin):
        if not os.access(tool, os.X_OK):
            raise RuntimeError(
                "gen_stubs: %s is missing (Debian: protobuf-compiler, "
                "protobuf-compiler-grpc; deploy/bootstrap.sh)" % tool)
    tmp = tempfile.mkdtemp(prefix="ferry-stubs-")
    try:
        cmd = [protoc, "-I" + include_root, "--python_out=" + tmp,
               "--grpc_python_out=" + tmp,
               "--plugin=protoc-gen-grpc_python=" + grpc_plugin] + list(protos)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("gen_stubs: %s failed:\n%s" % (" ".join(cmd),
                                                             proc.stderr))
        dest = os.path.join(out_dir, "ferry", "v1")
        os.makedirs(dest, exist_ok=True)
        written = []
        for name in PROTOS:
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                src = os.path.join(tmp, PROTO_DIR, name + suffix)
                with open(src) as f:
                    text = rewrite(f.read(), src)
                path = os.path.join(dest, name + suffix)
                with open(path, "w") as f:
                    f.write(text)
                written.append(path)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True,
                    help="directory that receives ferry/v1/*_pb2*.py")
    ap.add_argument("--include", default=".",
                    help="include root: the directory holding proto/")
    ap.add_argument("--protoc", default=PROTOC)
    ap.add_argument("--grpc_plugin", default=GRPC_PLUGIN)
    ap.add_argument("protos", nargs="*",
                    help="proto/ferry/v1/*.proto relative to --include "
                         "(default: all of PROTOS)")
    args = ap.parse_args(argv)
    protos = args.protos or [os.path.join(PROTO_DIR, n + ".proto")
                             for n in PROTOS]
    try:
        generate(args.include, protos, args.out, args.protoc, args.grpc_plugin)
    except RuntimeError as e:
        sys.stderr.write("%s\n" % e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
