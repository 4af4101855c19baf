#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang-14 (outside Bazel)
# and runs each for a bounded time over its seed corpus.
#
#   tools/fuzz.sh                    # every target, $FERRY_FUZZ_SECONDS each (60)
#   tools/fuzz.sh TARGET [SECONDS]   # one target, e.g. registration_fuzzer 600
#   tools/fuzz.sh --build-only       # build, run nothing
#   tools/fuzz.sh --seeds            # rewrite tests/fuzz/corpus/ (make_seeds)
#
# Before fuzzing, each target replays tests/fuzz/regressions/<target>/ (the
# crashes it found, now fixed). New corpus entries go to a temporary
# directory, never into the tree; a crash, hang (-timeout=10) or excessive
# memory use (-rss_limit_mb=2048) fails the target and prints the input's
# path. One line per target: "fuzz NAME: 60 s, 123456 runs (2057/s), PASSED".
# Exit status: 0 when every target passed.
#
# Build output: $FERRY_FUZZ_BUILD (default .fuzz-build/, ignored by git);
# crash inputs: $FERRY_FUZZ_ARTIFACTS (default a new directory under $TMPDIR).
set -uo pipefail
cd "$(dirname "$0")/.."

TARGETS=(registration_fuzzer layout_resolution_fuzzer wire_format_fuzzer checkpoint_fuzzer patch_fuzzer)
BUILD="${FERRY_FUZZ_BUILD:-.fuzz-build}"
SECONDS_EACH="${FERRY_FUZZ_SECONDS:-60}"

mode=run
selected=("${TARGETS[@]}")
case "${1:-}" in
  --build-only) mode=build ;;
  --seeds) mode=seeds ;;
  "") ;;
  -*) echo "usage: $0 [--build-only | --seeds | TARGET [SECONDS]]" >&2; exit 2 ;;
  *)
    if [[ ! " ${TARGETS[*]} " == *" $1 "* ]]; then
      echo "fuzz: unknown target $1 (targets: ${TARGETS[*]})" >&2
      exit 2
    fi
    selected=("$1")
    SECONDS_EACH="${2:-$SECONDS_EACH}"
    ;;
esac

# A missing toolchain is a failure, not a skip: deploy/bootstrap.sh installs it.
for need in clang++-14 make /usr/bin/protoc; do
  if ! command -v "$need" >/dev/null 2>&1; then
    echo "fuzz: $need not found (deploy/bootstrap.sh installs clang-14," \
         "libclang-rt-14-dev, libfuzzer-14-dev)" >&2
    exit 1
  fi
done
if [ ! -f "$(clang++-14 -print-resource-dir)/include/fuzzer/FuzzedDataProvider.h" ]; then
  echo "fuzz: clang-14's libFuzzer runtime is missing (deploy/bootstrap.sh" \
       "installs libclang-rt-14-dev, libfuzzer-14-dev)" >&2
  exit 1
fi

build_start=$(date +%s)
make_target=all
[ "$mode" = seeds ] && make_target=seeds
if ! make -s -f tests/fuzz/fuzz.mk -j"$(nproc)" BUILD="$BUILD" "$make_target"; then
  echo "fuzz: build FAILED" >&2
  exit 1
fi
echo "fuzz: built in $(( $(date +%s) - build_start )) s ($BUILD/bin)"

case "$mode" in
  build) exit 0 ;;
  seeds)
    for t in "${TARGETS[@]}"; do rm -rf "tests/fuzz/corpus/$t"; done
    mkdir -p tests/fuzz/corpus
    ASAN_OPTIONS=detect_leaks=0 "$BUILD/bin/make_seeds" tests/fuzz/corpus
    exit $?
    ;;
esac

# UBSan reports say where (ASan's always do).
export UBSAN_OPTIONS="print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
ARTIFACTS="${FERRY_FUZZ_ARTIFACTS:-$(mktemp -d "${TMPDIR:-/tmp}/ferry-fuzz-artifacts.XXXXXX")}"
mkdir -p "$ARTIFACTS"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ferry-fuzz.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

failed=0
for t in "${selected[@]}"; do
  bin="$BUILD/bin/$t"
  log="$WORK/$t.log"
  opts=(-rss_limit_mb=2048 -timeout=10 -artifact_prefix="$ARTIFACTS/$t-")

  # The fixed crashes first: each input once.
  regressions=()
  if [ -d "tests/fuzz/regressions/$t" ]; then
    while IFS= read -r f; do regressions+=("$f"); done \
      < <(find "tests/fuzz/regressions/$t" -type f | sort)
  fi
  if [ ${#regressions[@]} -gt 0 ] &&
     ! "$bin" "${opts[@]}" "${regressions[@]}" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "fuzz $t: a regression input fails again, FAILED"
    failed=$((failed + 1))
    continue
  fi

  corpus="$WORK/$t.corpus"
  mkdir -p "$corpus"
  start=$(date +%s)
  "$bin" "${opts[@]}" -max_total_time="$SECONDS_EACH" -print_final_stats=1 \
    "$corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" |
         grep -oE '[0-9]+$' | tail -n 1)
  runs=${runs:-0}
  rate=$(( runs / (elapsed > 0 ? elapsed : 1) ))
  cov=$(grep -oE '(cov|ft): [0-9]+' "$log" | tail -n 2 | tr '\n' ' ')
  if [ "$rc" -eq 0 ]; then
    echo "fuzz $t: ${elapsed} s, ${runs} runs (${rate}/s; ${cov% }), PASSED"
  else
    tail -n 60 "$log" >&2
    crash=$(grep -oE "Test unit written to [^ ]+" "$log" | tail -n 1 |
            sed 's/Test unit written to //')
    echo "fuzz $t: ${elapsed} s, ${runs} runs, FAILED (exit $rc; input: ${crash:-none written})"
    failed=$((failed + 1))
  fi
done
[ "$failed" -eq 0 ]
