#!/usr/bin/env bash
# The ferry demo. Installs what it needs (deploy/bootstrap.sh), builds, and
# plans a sync of Llama-3.1-8B from a Megatron trainer (TP4 x DP2) to two
# vLLM-style TP8 instances, printing how every parameter lands and why.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/bootstrap.sh
models="${FERRY_MODELS_DIR:-}"
if [ -z "$models" ]; then
  for d in ../shared/models ../../shared/models shared/models; do
    if [ -d "$d" ]; then models="$(cd "$d" && pwd)"; break; fi
  done
fi
export FERRY_MODELS_DIR="$models"
bazel run -c opt --ui_event_filters=-info,-stdout,-stderr --noshow_progress \
  //tools:ferry_plan -- --model=llama-3.1-8b --trainer=tp=4,dp=2 \
  --engine=tp=8 --replicas=2 "$@"
