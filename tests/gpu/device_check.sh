#!/usr/bin/env bash
# The GPU check: builds and runs every GPU test and GPU benchmark on a
# machine with a GPU, in well under 8 minutes on one H200, and prints a
# compact summary. Run from anywhere (it cds to the repository root):
#
#   tests/gpu/device_check.sh
#
# Needs bazel (deploy/bootstrap.sh installs it from Debian's packages; it
# is run here when bazel is missing) and CUDA 13 + NCCL at /usr/local/cuda;
# or, on a GPU machine without Bazel or network, a folder of binaries built
# elsewhere: `tests/gpu/device_bundle.sh DIR` here, then
# `FERRY_PREBUILT=DIR tests/gpu/device_check.sh` there.
# Logs and summary.txt go to $OUT when set, else to a temporary folder.
# Exit status 0 only when everything built and every test passed
# (benchmarks below their targets are reported, not failed).
set -uo pipefail
cd "$(dirname "$0")/../.."

LOG_DIR="${OUT:-$(mktemp -d -t ferry-device-check.XXXXXX)}"
mkdir -p "$LOG_DIR"
SUMMARY="$LOG_DIR/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
START=$(date +%s)
# Per-step limits (seconds); lower them to fit a short lease.
TEST_LIMIT="${FERRY_GPU_TEST_TIMEOUT:-150}"
DEMO_LIMIT="${FERRY_GPU_DEMO_TIMEOUT:-200}"
elapsed() { echo $(( $(date +%s) - START ))s; }

# A single-node, single-rank NCCL needs no network; keep its bootstrap on
# loopback unless told otherwise, and its warnings in the logs.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

GPU="$(nvidia-smi --query-gpu=name,driver_version,memory.total \
         --format=csv,noheader 2>/dev/null | head -1)"
say "device_check: ${GPU:-nvidia-smi found no GPU}"

if [ -n "${FERRY_PREBUILT:-}" ]; then
  # Binaries built elsewhere (tests/gpu/device_bundle.sh) with their
  # libraries; NCCL is this machine's own: /usr/local/cuda's, else the one
  # a Python wheel (nvidia-nccl-cu13) brought.
  PREBUILT="$(cd "$FERRY_PREBUILT" && pwd)"
  BIN="$PREBUILT/bin"
  NCCL_LIB="$(ls /usr/local/cuda/lib64/libnccl.so.2 2>/dev/null ||
              find / -xdev -name 'libnccl.so.2*' -path '*nvidia*' 2>/dev/null | head -1)"
  [ -n "$NCCL_LIB" ] && say "device_check: NCCL from $NCCL_LIB"
  export LD_LIBRARY_PATH="$PREBUILT/lib${NCCL_LIB:+:$(dirname "$NCCL_LIB")}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export FERRY_BIN="$BIN" FERRY_MODELS_DIR="$PREBUILT/models"
  export FERRY_IPC_EXPORTER="$BIN/tests/gpu/ipc_exporter"
  missing="$(ldd "$BIN/daemon/ferryd" "$BIN/tests/gpu/gpu_nccl_test" | grep 'not found' | sort -u)"
  [ -z "$missing" ] || say "device_check: libraries not found: $missing"
  say "build: prebuilt ($PREBUILT)"
else
  if ! command -v bazel >/dev/null 2>&1; then
    deploy/bootstrap.sh > "$LOG_DIR/bootstrap.log" 2>&1 || true
  fi
  if ! command -v bazel >/dev/null 2>&1; then
    say "device_check: no bazel (see $LOG_DIR/bootstrap.log)"
    say "0 passed, 1 failed"
    exit 1
  fi
  # -c opt: the host code optimized as in production (nvcc is always -O3).
  if ! timeout 330 bazel build -c opt //cuda/... //tests/gpu/... //bench/gpu/... \
       //daemon:ferryd //client/ferryctl:ferryctl //examples/demo:demo_trainer \
       //examples/demo:demo_engine //tools:ferry_load //python:libferry_tables.so \
       > "$LOG_DIR/build.log" 2>&1; then
    say "build: FAILED after $(elapsed) (last lines of $LOG_DIR/build.log:)"
    grep -E "error|ERROR" "$LOG_DIR/build.log" | head -20 | tee -a "$SUMMARY"
    say "0 passed, 1 failed"
    exit 1
  fi
  say "build: ok ($(elapsed))"
  BIN=bazel-bin
fi
passed=0
failed=0
skipped=0
for t in viability_test host_logic_test gpu_kernels_test gpu_fp8_test gpu_ipc_test \
         gpu_nccl_test gpu_device_memory_test gpu_conformance_test; do
  t0=$(date +%s)
  timeout "$TEST_LIMIT" "$BIN/tests/gpu/$t" > "$LOG_DIR/$t.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  last="$(grep -E "All tests passed|test cases?:|assertions" "$LOG_DIR/$t.log" \
            | tail -1)"
  if grep -q "SKIPPED: no GPU" "$LOG_DIR/$t.log"; then
    skipped=$((skipped + 1))
    note=" (SKIPPED: no GPU)"
  else
    note=""
  fi
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    say "test $t: PASS in ${secs}s${note} - $last"
  else
    failed=$((failed + 1))
    [ "$rc" -eq 124 ] && last="TIMEOUT after ${TEST_LIMIT}s"
    say "test $t: FAIL (rc $rc) in ${secs}s - $last"
    grep -E "FAILED|REQUIRE|CHECK|with expansion|: error|SIGSEGV" \
      "$LOG_DIR/$t.log" | head -15 | sed 's/^/    /' | tee -a "$SUMMARY"
  fi
done

# ferryd end to end on the GPU: the demo's processes register GPU memory
# (CUDA IPC), ferryd copies GPU to GPU and every engine rank checks every
# byte. 1: the 1.6 GB model, 3 versions (the per-version GB/s is the
# end-to-end figure); 2: a small model with lm_head forced through pinned
# host staging and the engine's loader.
for d in "demo_gpu --device=cuda" \
         "demo_gpu_fallback --device=cuda --scale=small --versions=2 --fallback=lm_head"; do
  name="${d%% *}"
  if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    skipped=$((skipped + 1))
    passed=$((passed + 1))
    say "test $name: PASS (SKIPPED: no GPU, nvidia-smi lists none)"
    continue
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086
  FERRY_NO_BOOTSTRAP=1 timeout "$DEMO_LIMIT" deploy/demo.sh ${d#* } > "$LOG_DIR/$name.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    say "test $name: PASS in ${secs}s"
  else
    failed=$((failed + 1))
    say "test $name: FAIL (rc $rc) in ${secs}s"
    grep -E "demo:|ERROR|E[0-9]{4}|FAILED|mismatch" "$LOG_DIR/$name.log" | head -15 \
      | sed 's/^/    /' | tee -a "$SUMMARY"
  fi
  grep -E "moved in|devices|device " "$LOG_DIR/$name.log" | sed 's/^.*\] //' \
    | head -6 | sed 's/^/    /' | tee -a "$SUMMARY"
done

# The Python client on the GPU, with this machine's own python3 (CUDA
# PyTorch, grpcio, protobuf) and the ferry wheel installed into a venv
# (or, without venv, unpacked): no PYTHONPATH into the checkout, no protoc.
# 1: tests/gpu/python_gpu_check.py (CUDA tensors in both roles, device
# staging, offload/onload, refusals, and the 1.6 GiB same-node update
# against a D2D copy); 2: python/tests/engine_test.py --device=cuda (the
# engine adapter on CUDA tensors); 3: examples/tp_sync with --device=cuda
# (every run).
PY_LIMIT="${FERRY_GPU_PY_TIMEOUT:-240}"
if [ -n "${FERRY_PREBUILT:-}" ]; then
  WHEEL="$(ls "$PREBUILT"/python/ferry-*.whl 2>/dev/null | head -1)"
else
  rm -rf "$LOG_DIR/wheel-src" && mkdir -p "$LOG_DIR/wheel-src"
  cp -r python proto "$LOG_DIR/wheel-src/"
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$LOG_DIR/wheel" \
    "$LOG_DIR/wheel-src/python" > "$LOG_DIR/wheel.log" 2>&1
  WHEEL="$(ls "$LOG_DIR"/wheel/ferry-*.whl 2>/dev/null | head -1)"
fi
PYBIN=""
if [ -n "$WHEEL" ]; then
  if python3 -m venv --system-site-packages "$LOG_DIR/venv" > "$LOG_DIR/venv.log" 2>&1 &&
     "$LOG_DIR/venv/bin/python" -m pip install -q --no-deps --no-index "$WHEEL" \
       >> "$LOG_DIR/venv.log" 2>&1; then
    PYBIN="$LOG_DIR/venv/bin/python"
  else  # no venv module: the wheel is a zip of the package
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
      "$WHEEL" "$LOG_DIR/site" && PYBIN="env PYTHONPATH=$LOG_DIR/site python3"
  fi
fi
say "python: ${PYBIN:-none} (wheel ${WHEEL:-missing}; $(python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tail -1))"
FERRY_LOAD="$BIN/tools/ferry_load"
[ -x "$FERRY_LOAD" ] || FERRY_LOAD="$(ls bazel-bin/tools/ferry_load 2>/dev/null)"
# ferry.engine's EngineAdapter (engine_test) builds vLLM's tables with
# libferry_tables.so, which the wheel does not carry.
export FERRY_TABLES_LIB="${FERRY_TABLES_LIB:-$BIN/python/libferry_tables.so}"
for p in "python_gpu_check tests/gpu/python_gpu_check.py $BIN/daemon/ferryd --versions=5" \
         "engine_adapter_cuda python/tests/engine_test.py $BIN/daemon/ferryd --device=cuda" \
         "tp_sync_cuda examples/tp_sync/run_e2e.py --ferryd $BIN/daemon/ferryd --ferry_load $FERRY_LOAD --device=cuda"; do
  name="${p%% *}"
  if [ -z "$PYBIN" ]; then
    failed=$((failed + 1))
    say "test $name: FAIL (no ferry wheel installed; see $LOG_DIR/venv.log)"
    continue
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$PY_LIMIT" $PYBIN ${p#* } > "$LOG_DIR/$name.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  if grep -q "^SKIPPED: no GPU" "$LOG_DIR/$name.log"; then
    skipped=$((skipped + 1))
  fi
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    say "test $name: PASS in ${secs}s"
  else
    failed=$((failed + 1))
    [ "$rc" -eq 124 ] && say "    TIMEOUT after ${PY_LIMIT}s"
    say "test $name: FAIL (rc $rc) in ${secs}s"
    grep -E "Error|error|FAIL|assert|Traceback" "$LOG_DIR/$name.log" | tail -12 \
      | sed 's/^/    /' | tee -a "$SUMMARY"
  fi
  grep -E "^python gpu check|^bench |^  run|PASSED" "$LOG_DIR/$name.log" | head -12 \
    | sed 's/^/    /' | tee -a "$SUMMARY"
done

for b in "gpu_copy_bench 1024" "gpu_update_bench 5" "gpu_fp8_bench"; do
  name="${b%% *}"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$TEST_LIMIT" "$BIN/bench/gpu/"$b > "$LOG_DIR/$name.log" 2>&1
  rc=$?
  say "bench $name: rc $rc in $(( $(date +%s) - t0 ))s"
  grep -vE "^NCCL|^$" "$LOG_DIR/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
done

say "device_check: done in $(elapsed); logs in $LOG_DIR"
say "$passed passed, $failed failed, $skipped skipped (no GPU)"
[ "$failed" -eq 0 ]
