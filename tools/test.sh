#!/usr/bin/env bash
# Runs every ferry test, from a fresh Debian 12 machine or an old one.
#
#   tools/test.sh [extra bazel test args]
#
# Installs the system packages (deploy/bootstrap.sh, idempotent), runs
# `bazel test //...` with a disk cache outside the clone, then clang's
# thread-safety analysis over the product code (tools/thread_safety.sh),
# then the fuzz targets for a minute each (tools/fuzz.sh;
# FERRY_FUZZ_SECONDS), and ends with one line "N passed, N failed, N
# skipped" (the thread-safety pass, the package arrows' check, the
# Kubernetes manifests' check and each fuzz target count as one test).
# CUDA targets are SKIPPED where there is no CUDA toolkit (or with
# --config=nocuda); GPU tests skip themselves, visibly, where there is no
# GPU.
set -uo pipefail
cd "$(dirname "$0")/.."

deploy/bootstrap.sh || { echo "0 passed, 1 failed"; exit 1; }

DISK_CACHE="${FERRY_BAZEL_DISK_CACHE:-$HOME/.cache/ferry-bazel-disk}"
mkdir -p "$DISK_CACHE"

# The model architecture files live in shared/models beside the clone.
MODELS_DIR="${FERRY_MODELS_DIR:-}"
if [ -z "$MODELS_DIR" ]; then
  for d in ../shared/models ../../shared/models shared/models; do
    if [ -d "$d" ]; then MODELS_DIR="$(cd "$d" && pwd)"; break; fi
  done
fi

LOG="$(mktemp)"
bazel test //... \
  --disk_cache="$DISK_CACHE" \
  --test_summary=short \
  --test_env=FERRY_MODELS_DIR="$MODELS_DIR" \
  "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$LOG")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|FLAKY|NO STATUS|INCOMPLETE)|FAILED TO BUILD' "$LOG")
# Incompatible (CUDA without a toolkit) targets are only counted in Bazel's
# "Executed ... N were skipped" line.
skipped=$(grep -oE '[0-9]+ (were|was) skipped' "$LOG" | tail -n 1 | grep -oE '^[0-9]+')
skipped=${skipped:-0}
# Tests that found no GPU (or no vLLM, no SGLang, no network namespaces)
# pass after printing "SKIPPED: no GPU (...)": report them as skipped,
# with the reasons, rather than as passed.
TESTLOGS="$(bazel info bazel-testlogs 2>/dev/null)"
if [ -n "$TESTLOGS" ] && [ -d "$TESTLOGS" ]; then
  for what in GPU vLLM SGLang network; do
    n=$(grep -rlE "^SKIPPED: no $what" "$TESTLOGS" --include=test.log 2>/dev/null | wc -l)
    if [ "$n" -gt 0 ]; then
      reason=$(grep -rhE "^SKIPPED: no $what" "$TESTLOGS" --include=test.log | head -n 1)
      echo "tests skipped at run time, no $what: $n ($reason)"
      passed=$((passed - n))
      skipped=$((skipped + n))
    fi
  done
fi
# The Bazel tests that failed, for the summary at the end: a CI log is
# often cut in the middle, where a test's own output is.
FAILED_TARGETS=$(grep -oE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|FLAKY|NO STATUS|INCOMPLETE)' "$LOG" | awk '{print $1}')
rm -f "$LOG"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # a build error fails before any test runs
fi

# The lock annotations (tools/thread_safety.sh, docs/architecture.md):
# clang-14's -Wthread-safety over every product .cc, syntax only. One
# test: PASSED when every file is clean; a thread-safety error, any other
# compile error or a missing clang-14 is one failed test.
tools/thread_safety.sh
if [ $? -eq 0 ]; then
  echo "thread-safety: PASSED"
  passed=$((passed + 1))
else
  echo "thread-safety: FAILED"
  failed=$((failed + 1))
fi

# The package arrows (tools/check_layering.py, docs/style.md): no include
# runs from a package to one above it (daemon/layers.bzl for the daemon's
# packages). One test.
if python3 tools/check_layering.py --check; then
  echo "layering: PASSED"
  passed=$((passed + 1))
else
  echo "layering: FAILED"
  failed=$((failed + 1))
fi

# Sizes a reader can take in (tools/code_size.py, docs/style.md): no daemon
# .cc over 500 lines, header over 300, function over 120; its function
# finder checked on known cases first. One test; the report names the
# longest functions either way.
if python3 tools/code_size.py --self-test && python3 tools/code_size.py --check daemon; then
  echo "code size: PASSED"
  passed=$((passed + 1))
else
  echo "code size: FAILED"
  failed=$((failed + 1))
fi

# The Kubernetes manifests (tools/k8s_check.sh, docs/operations.md): every
# manifest in deploy/k8s/ parses and validates against the Kubernetes API
# schema with no unknown field, and the bad ones in tests/deploy/bad/ are
# refused. One test; the validator (npm) is installed on the first run.
tools/k8s_check.sh
if [ $? -eq 0 ]; then
  echo "k8s manifests: PASSED"
  passed=$((passed + 1))
else
  echo "k8s manifests: FAILED"
  failed=$((failed + 1))
fi

# The libFuzzer targets (tools/fuzz.sh, docs/fuzzing.md): built with clang-14
# outside Bazel, each run for FERRY_FUZZ_SECONDS (60). Each target is one
# test: "fuzz NAME: ..., PASSED" or "... FAILED"; a build failure or a
# missing clang-14 is one failed test.
FUZZ_LOG="$(mktemp)"
tools/fuzz.sh 2>&1 | tee "$FUZZ_LOG"
fuzz_status=${PIPESTATUS[0]}
fuzz_passed=$(grep -cE '^fuzz [a-z_]+: .*PASSED$' "$FUZZ_LOG")
fuzz_failed=$(grep -cE '^fuzz [a-z_]+: .*FAILED' "$FUZZ_LOG")
rm -f "$FUZZ_LOG"
if [ "$fuzz_status" -ne 0 ] && [ "$fuzz_failed" -eq 0 ]; then
  fuzz_failed=1  # no target ran: toolchain missing or build failed
fi
passed=$((passed + fuzz_passed))
failed=$((failed + fuzz_failed))

# Why each failed Bazel test failed, distilled from its own log (Catch2's
# failures, a soak's violations, errors), so that the end of the output
# says it.
for target in $FAILED_TARGETS; do
  log="$TESTLOGS/${target#//}"
  log="${log/://}/test.log"
  echo "--- why $target failed (from $log):"
  if [ -f "$log" ]; then
    grep -E 'VIOLATION|FAILED:|with expansion|REQUIRE|CHECK|Error|ERROR|error:|Assertion|Traceback|timed out|TIMEOUT' "$log" \
      | grep -v '^I[0-9]' | tail -n 40
  fi
done

echo "${passed} passed, ${failed} failed, ${skipped} skipped"
[ "$status" -eq 0 ] && [ "$failed" -eq 0 ] && [ "$fuzz_status" -eq 0 ]
