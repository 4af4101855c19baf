"""Builds the ferry wheel (metadata in pyproject.toml).

Its one job beyond setuptools' defaults: the ferry.v1 stubs. build_py runs
gen_stubs.py (the script Bazel's //python:ferry_v1_stubs runs too) on
../proto/ferry/v1/*.proto with /usr/bin/protoc and /usr/bin/grpc_python_plugin,
writing ferry/v1/<name>_pb2.py and _pb2_grpc.py into the build directory,
never into the source tree. Where the stubs are already in the source
(an sdist, which carries them because ../proto is not in it), they are
used as they are. Offline: nothing is downloaded.
"""

import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_stubs  # noqa: E402

PROTO_ROOT = os.path.dirname(HERE)  # proto/ferry/v1/*.proto live here


def stubs_in_source():
    return all(os.path.exists(os.path.join(HERE, f)) for f in gen_stubs.stub_files())


def write_stubs(out_dir):
    missing = [os.path.join(gen_stubs.PROTO_DIR, n + ".proto")
               for n in gen_stubs.PROTOS
               if not os.path.exists(os.path.join(PROTO_ROOT, gen_stubs.PROTO_DIR,
                                                  n + ".proto"))]
    if missing:
        raise SystemExit(
            "ferry: no ferry.v1 stubs in %s/ferry/v1 and no %s under %s to "
            "generate them from: build from a checkout (python/ beside proto/) "
            "or from an sdist" % (HERE, ", ".join(missing), PROTO_ROOT))
    try:
        gen_stubs.generate(PROTO_ROOT, [os.path.join(gen_stubs.PROTO_DIR, n + ".proto")
                                        for n in gen_stubs.PROTOS], out_dir)
    except RuntimeError as e:
        raise SystemExit(str(e))


class BuildPy(build_py):
    """build_py, then the stubs into build_lib/ferry/v1 (unless the source
    has them). build_lib's ferry/ is emptied first: a module removed from
    the source must not live on in the wheel."""

    def run(self):
        if not self.dry_run:
            shutil.rmtree(os.path.join(self.build_lib, "ferry"), ignore_errors=True)
        super().run()
        if not stubs_in_source() and not self.dry_run:
            write_stubs(self.build_lib)

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if not stubs_in_source():
            outputs += [os.path.join(self.build_lib, f)
                        for f in gen_stubs.stub_files()]
        return outputs


class Sdist(sdist):
    """An sdist carries the stubs (../proto is outside it)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        if not stubs_in_source():
            write_stubs(base_dir)


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
