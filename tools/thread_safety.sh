#!/usr/bin/env bash
# Checks ferry's lock annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED,
# ABSL_LOCKS_EXCLUDED, ...) with clang's thread-safety analysis. The Bazel
# build uses gcc, which parses the annotations and ignores them; this pass
# runs Debian's clang-14 in syntax-only mode (no objects, no link) over every
# product .cc, so a guarded member read without its mutex fails CI.
#
#   tools/thread_safety.sh            # every .cc under core/ common/ daemon/ client/
#                                     # transport/ examples/demo/
#   tools/thread_safety.sh FILE...    # just these files
#   tools/thread_safety.sh --list     # print the files it would check
#
# Sources under cuda/ and files that include CUDA or NCCL headers are left
# out (they need nvcc's headers and defines); the list of files left out is
# printed. Any other compile error (a header clang cannot find, code clang
# rejects) fails the file just like a thread-safety error: nothing is
# skipped silently.
#
# Output: one line per failing file ("thread-safety: FILE: FAILED (...)"),
# its diagnostics, then one summary line
# "thread-safety: N files checked in S s, N failed". Exit status 0 only when
# every file is clean.
#
# Generated protobuf/gRPC headers come from Bazel (//proto:ferry_cc_proto_gen,
# with the same disk cache as tools/test.sh); FERRY_PROTO_GEN_DIR names a
# directory holding proto/ferry/v1/*.pb.h instead. System headers (absl,
# grpc, protobuf, glog, gflags, xxhash, openssl, nlohmann-json) are Debian's,
# in /usr/include, as in the Bazel build (third_party/system/BUILD sets no
# defines).
set -uo pipefail
cd "$(dirname "$0")/.."

CLANG="${FERRY_TSA_CLANG:-clang++-14}"
JOBS="${FERRY_TSA_JOBS:-2}"
DISK_CACHE="${FERRY_BAZEL_DISK_CACHE:-$HOME/.cache/ferry-bazel-disk}"

if ! command -v "$CLANG" >/dev/null 2>&1; then
  echo "thread-safety: $CLANG not found (deploy/bootstrap.sh installs clang-14)" >&2
  echo "thread-safety: 0 files checked, FAILED (no compiler)"
  exit 1
fi

start=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ferry-tsa.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# --- the files --------------------------------------------------------------
uses_cuda() {
  grep -qE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](cuda[_/.]|cuda\.h|nccl|cublas|cufft|curand)' "$1"
}

files=()
excluded=()
list_only=0
if [ "${1:-}" = --list ]; then list_only=1; shift; fi
if [ $# -gt 0 ]; then
  files=("$@")
else
  dirs=()
  for d in core common daemon client transport examples/demo; do
    [ -d "$d" ] && dirs+=("$d")
  done
  while IFS= read -r f; do
    case "$f" in
      */cuda/*|cuda/*) excluded+=("$f"); continue ;;
    esac
    if uses_cuda "$f"; then excluded+=("$f"); continue; fi
    files+=("$f")
  done < <(find "${dirs[@]}" -name '*.cc' -type f | sort)
fi

if [ ${#files[@]} -eq 0 ]; then
  echo "thread-safety: no .cc files found, FAILED"
  exit 1
fi
for f in "${excluded[@]}"; do
  echo "thread-safety: $f: left out (CUDA headers)"
done
if [ "$list_only" -eq 1 ]; then
  printf '%s\n' "${files[@]}"
  exit 0
fi

# --- generated proto headers ------------------------------------------------
GEN="${FERRY_PROTO_GEN_DIR:-}"
if [ -z "$GEN" ]; then
  mkdir -p "$DISK_CACHE"
  if ! bazel build //proto:ferry_cc_proto_gen --disk_cache="$DISK_CACHE" \
       >"$WORK/bazel.log" 2>&1; then
    cat "$WORK/bazel.log" >&2
    echo "thread-safety: generating proto headers (bazel build) FAILED"
    exit 1
  fi
  GEN="$(bazel info bazel-bin 2>/dev/null)"
fi
if [ ! -f "$GEN/proto/ferry/v1/types.pb.h" ]; then
  echo "thread-safety: no generated headers under '$GEN' (proto/ferry/v1/types.pb.h)" >&2
  echo "thread-safety: FAILED (no generated headers)"
  exit 1
fi

# Flags: the Bazel build's language level (.bazelrc: -std=c++17) and include
# paths, no code generation, plus the analysis. -Wthread-safety turns on
# -Wthread-safety-analysis, -attributes, -precise and -reference; ferry's
# code passes -Wthread-safety-beta too, so it is kept on.
FLAGS=(
  -fsyntax-only -std=c++17
  -Wthread-safety -Wthread-safety-beta -Werror=thread-safety
  -Werror=thread-safety-beta
  -I. -I"$GEN"
)

# --- check, in parallel -----------------------------------------------------
# The flags go in a response file (clang's @FILE), one per line, quoted, so
# that each parallel job reads the same list and paths may hold spaces.
for flag in "${FLAGS[@]}"; do
  printf '"%s"\n' "$flag"
done >"$WORK/flags"

# One job per file: diagnostics to $WORK/<file>.log, exit status to .rc.
printf '%s\0' "${files[@]}" |
  xargs -0 -P "$JOBS" -I{} sh -c \
    'key=$(printf "%s" "$1" | tr / _); "$0" @"$2" "$1" >"$3/$key.log" 2>&1; echo $? >"$3/$key.rc"' \
    "$CLANG" {} "$WORK/flags" "$WORK"

failed=0
tsa_failed=0
for f in "${files[@]}"; do
  key="$(printf '%s' "$f" | tr '/' '_')"
  rc="$(cat "$WORK/$key.rc" 2>/dev/null || echo missing)"
  if [ "$rc" != 0 ]; then
    failed=$((failed + 1))
    if grep -qE 'error: .*-Wthread-safety[a-z-]*\]' "$WORK/$key.log"; then
      tsa_failed=$((tsa_failed + 1))
      why="$(grep -cE 'error: .*-Wthread-safety[a-z-]*\]' "$WORK/$key.log") thread-safety error(s)"
    elif grep -qE "fatal error: '.*' file not found" "$WORK/$key.log"; then
      why="header not found: $(grep -oE "fatal error: '[^']+'" "$WORK/$key.log" | head -n 1 | sed "s/fatal error: //")"
    else
      why="compile error (exit $rc), not thread-safety"
    fi
    echo "thread-safety: $f: FAILED ($why)"
    sed 's/^/    /' "$WORK/$key.log"
  fi
done

elapsed=$(( $(date +%s) - start ))
echo "thread-safety: ${#files[@]} files checked in ${elapsed} s (${JOBS} jobs), ${failed} failed" \
     "(${tsa_failed} with thread-safety errors, ${#excluded[@]} left out for CUDA)"
[ "$failed" -eq 0 ]
