#!/usr/bin/env bash
# Runs a Python script of the ferry tree with Debian's /usr/bin/python3 and
# the ferry package plus its generated stubs on PYTHONPATH, from Bazel's
# runfiles. Arguments that name a file in the runfiles tree (the script,
# //daemon:ferryd) are given relative to the workspace root and resolved
# here.
#   run_python.sh SCRIPT [ARG...]
set -euo pipefail
runfiles="${TEST_SRCDIR:-${RUNFILES_DIR:-$0.runfiles}}"
root="$runfiles/${TEST_WORKSPACE:-ferry}"
export PYTHONPATH="$root/python:$root${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
args=()
for a in "$@"; do
  if [[ "$a" != -* && -e "$root/$a" ]]; then
    args+=("$root/$a")
  else
    args+=("$a")
  fi
done
exec /usr/bin/python3 "${args[@]}"
