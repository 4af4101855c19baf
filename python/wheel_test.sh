#!/usr/bin/env bash
# //python:wheel_test: the ferry package as a user installs it.
#
#   1. python/ and proto/ copied out of the runfiles (sources only: no
#      generated stubs, no libferry_tables.so) to a temp dir;
#   2. the wheel built there offline (pip wheel --no-deps
#      --no-build-isolation --no-index): one py3-none-any wheel holding the
#      package, its ferry.v1 stubs and py.typed, and no other top-level name;
#   3. a venv (--system-site-packages: Debian's grpcio, protobuf, torch)
#      with the wheel pip-installed into it, nothing else;
#   4. from a directory outside the checkout with PYTHONPATH unset: `import
#      ferry` comes from the venv, imports no top-level `proto`, works without
#      torch, and says where libferry_tables.so comes from; then the Python
#      tests run with the venv's python (vllm_table_test with
#      $FERRY_TABLES_LIB, the one thing the wheel does not carry).
# Any failure fails the test.
set -euo pipefail
runfiles="${TEST_SRCDIR:-${RUNFILES_DIR:-$0.runfiles}}"
root="$runfiles/${TEST_WORKSPACE:-ferry}"
ferryd="$root/daemon/ferryd"
tables_lib="$root/python/libferry_tables.so"
tmp="$(mktemp -d "${TEST_TMPDIR:-/tmp}/ferry-wheel.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
unset PYTHONPATH PYTHONHOME PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL
export HOME="$tmp/home" PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$HOME" "$tmp/src" "$tmp/dist" "$tmp/run"

step() { echo "wheel_test: $*"; }
fail() { echo "wheel_test: FAILED: $*" >&2; exit 1; }

# 1. The sources, as a checkout has them.
cp -rL "$root/python" "$tmp/src/python"
cp -rL "$root/proto" "$tmp/src/proto"
rm -f "$tmp/src/python/libferry_tables.so"
find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
if compgen -G "$tmp/src/python/ferry/v1/*_pb2*.py" > /dev/null; then
  fail "the copied sources hold generated stubs; the wheel must make them"
fi

# 2. The wheel, offline.
step "building the wheel"
(cd "$tmp/src" && /usr/bin/python3 -m pip wheel --no-deps --no-build-isolation \
   --no-index --no-cache-dir -w "$tmp/dist" ./python) > "$tmp/pip-wheel.log" 2>&1 \
  || { cat "$tmp/pip-wheel.log" >&2; fail "pip wheel"; }
wheels=("$tmp"/dist/*.whl)
[[ ${#wheels[@]} -eq 1 && -f "${wheels[0]}" ]] || fail "expected one wheel: ${wheels[*]}"
wheel="${wheels[0]}"
[[ "$(basename "$wheel")" =~ ^ferry-[0-9][^-]*-py3-none-any\.whl$ ]] \
  || fail "not a py3-none-any ferry wheel: $(basename "$wheel")"
/usr/bin/python3 - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = {n.split("/")[0] for n in names}
extra = [t for t in tops if t != "ferry" and not t.endswith(".dist-info")]
assert not extra, "top-level names besides ferry: %s" % extra
for f in ["ferry/__init__.py", "ferry/py.typed", "ferry/v1/__init__.py"] + [
        "ferry/v1/%s%s" % (n, s)
        for n in ("types", "registration", "version", "inspection", "lifecycle", "peer")
        for s in ("_pb2.py", "_pb2_grpc.py")]:
    assert f in names, "the wheel lacks %s" % f
assert not [n for n in names if n.endswith(".so")], "a shared library in the wheel"
print("wheel_test: %d files in %s" % (len(names), sys.argv[1].rsplit("/", 1)[-1]))
EOF

# 3. A venv with the wheel and nothing else.
step "installing it into a venv"
venv="$tmp/venv"
/usr/bin/python3 -m venv --system-site-packages --without-pip "$venv"
py="$venv/bin/python"
"$py" -m pip install --no-deps --no-index --no-cache-dir "$wheel" \
  > "$tmp/pip-install.log" 2>&1 || { cat "$tmp/pip-install.log" >&2; fail "pip install"; }

# 4. From outside the checkout, PYTHONPATH unset.
cd "$tmp/run"
if /usr/bin/python3 -c "import ferry" > /dev/null 2>&1; then
  fail "/usr/bin/python3 imports a ferry without the venv: the checks below would not be about the wheel"
fi
VENV="$venv" "$py" - <<'EOF'
import importlib.metadata
import os
import sys

import ferry
import ferry.v1.lifecycle_pb2_grpc

venv = os.path.realpath(os.environ["VENV"]) + os.sep
for mod in (ferry, ferry.v1.lifecycle_pb2_grpc):
    assert os.path.realpath(mod.__file__).startswith(venv), \
        "%s is %s, not inside the venv %s" % (mod.__name__, mod.__file__, venv)
proto = [m for m in sys.modules if m == "proto" or m.startswith("proto.")]
assert not proto, "import ferry left top-level proto modules: %s" % proto
assert ferry.__version__ == importlib.metadata.version("ferry"), ferry.__version__
try:
    ferry.vllm_table({"architectures": ["LlamaForCausalLM"]}, 1, 0)
    raise AssertionError("vllm_table ran without libferry_tables.so")
except RuntimeError as e:
    assert "FERRY_TABLES_LIB" in str(e) and "libferry_tables.so" in str(e), e
print("wheel_test: ferry %s from %s" % (ferry.__version__, ferry.__file__))
EOF
"$py" - <<'EOF'
import sys
sys.modules["torch"] = None  # as if torch were not installed
import ferry
conn = ferry.Connection("/nonexistent/ferryd.sock")  # no I/O
conn.close()
try:
    ferry.SharedTensorArena("wheel-test", 4096).tensor((4,))
    raise AssertionError("a tensor without torch")
except ImportError as e:
    assert "ferry[torch]" in str(e), e
print("wheel_test: import ferry works without torch")
EOF

cp -r "$root/python/tests" "$tmp/run/tests"
for t in dtypes_test arena_test client_test metrics_test reregister_test offload_test; do
  step "$t"
  "$py" "tests/$t.py" "$ferryd" > "$tmp/$t.log" 2>&1 \
    || { tail -60 "$tmp/$t.log" >&2; fail "$t with the installed wheel"; }
  grep -a "^$t: " "$tmp/$t.log" | tail -1
done
step "vllm_table_test"
FERRY_TABLES_LIB="$tables_lib" "$py" tests/vllm_table_test.py "$ferryd" \
  > "$tmp/vllm_table_test.log" 2>&1 \
  || { tail -60 "$tmp/vllm_table_test.log" >&2; fail "vllm_table_test with the installed wheel"; }
grep -a "^vllm_table_test: " "$tmp/vllm_table_test.log" | tail -1
echo "wheel_test: PASSED"
