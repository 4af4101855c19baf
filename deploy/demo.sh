#!/usr/bin/env bash
# The ferry demo: a real ferryd, a synthetic Megatron-style trainer of a
# Llama-3.1-style model (the Llama-3.1-8B tensor set scaled down to about
# 1.7 GB of bf16) as 2 processes (TP=2), and one vLLM-style inference
# instance with fused qkv_proj / gate_up_proj as 4 processes (TP=4). The
# trainer publishes 3 versions; every engine rank checks every byte of
# every version against what the trainer wrote, on its own. ferryctl shows
# the participants, the plan and each update along the way.
#
#   deploy/demo.sh [--scale=demo|small|tiny] [--versions=N]
#                  [--device=host|cuda] [--fallback=SUBSTR,...]
#
# Needs no GPU. --device=cuda puts every rank's tensors in GPU memory
# (ranks spread over the node's GPUs) and ferryd copies GPU to GPU (needs
# a GPU and a ferryd built with CUDA). --fallback forces the engine
# parameters whose names contain a substring through staging and the
# engine's loader. Exits 0 when every byte of every version arrived.
set -euo pipefail
cd "$(dirname "$0")/.."

SCALE=demo
VERSIONS=3
DEVICE=host
FALLBACK=
for arg in "$@"; do
  case "$arg" in
    --scale=*) SCALE="${arg#--scale=}" ;;
    --versions=*) VERSIONS="${arg#--versions=}" ;;
    --device=host|--device=cuda) DEVICE="${arg#--device=}" ;;
    --fallback=*) FALLBACK="${arg#--fallback=}" ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "demo: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

# FERRY_NO_BOOTSTRAP=1: the packages are known to be there (device_check).
[ "${FERRY_NO_BOOTSTRAP:-0}" = 1 ] || deploy/bootstrap.sh
if [ -z "${FERRY_MODELS_DIR:-}" ]; then
  for d in ../shared/models ../../shared/models shared/models; do
    if [ -d "$d" ]; then export FERRY_MODELS_DIR="$(cd "$d" && pwd)"; break; fi
  done
fi

# FERRY_BIN=DIR: binaries built elsewhere, laid out as bazel-bin
# (tests/gpu/device_bundle.sh makes such a folder for a GPU machine).
if [ -n "${FERRY_BIN:-}" ]; then
  BIN="$FERRY_BIN"
else
  echo "== building ferryd, ferryctl and the demo processes"
  bazel build -c opt --noshow_progress --ui_event_filters=-info \
    //daemon:ferryd //client/ferryctl:ferryctl \
    //examples/demo:demo_trainer //examples/demo:demo_engine
  BIN="$(bazel info -c opt bazel-bin 2>/dev/null)"
fi

WORK="$(mktemp -d /tmp/ferry-demo.XXXXXX)"
SOCK="$WORK/ferryd.sock"
DAEMON="unix:$SOCK"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done
  if [ -n "${FERRYD:-}" ]; then
    kill -TERM "$FERRYD" 2>/dev/null || true
    wait "$FERRYD" 2>/dev/null || true
  fi
  if [ "${KEEP_WORK:-0}" = 1 ]; then echo "demo: logs kept in $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
ctl() { "$BIN/client/ferryctl/ferryctl" --daemon="$DAEMON" "$@"; }

echo "== starting ferryd on $SOCK"
"$BIN/daemon/ferryd" --socket="$SOCK" --node=demo-node \
  --log_dir="$WORK" >"$WORK/ferryd.out" 2>&1 &
FERRYD=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
ctl health

# Rank r's device: host, or GPU r mod the node's GPU count.
GPUS=1
if [ "$DEVICE" = cuda ]; then
  GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
  [ "${GPUS:-0}" -ge 1 ] || { echo "demo: --device=cuda needs a GPU (nvidia-smi -L lists none)" >&2; exit 2; }
fi
device_of() { if [ "$DEVICE" = cuda ]; then echo "cuda:$(( $1 % GPUS ))"; else echo host; fi; }

echo "== 4 engine ranks (TP=4, fused qkv_proj/gate_up_proj), 2 trainer ranks (TP=2), device $DEVICE"
for r in 0 1 2 3; do
  "$BIN/examples/demo/demo_engine" --daemon="$DAEMON" --instance=vllm-tp4 \
    --tp=4 --tp_rank=$r --scale="$SCALE" --exit_after_version="$VERSIONS" \
    --device="$(device_of $r)" --fallback="$FALLBACK" \
    --logtostderr >"$WORK/engine$r.log" 2>&1 &
  PIDS+=($!)
done
ENGINES=("${PIDS[@]}")
TRAINERS=()
for r in 0 1; do
  "$BIN/examples/demo/demo_trainer" --daemon="$DAEMON" --tp=2 --rank=$r \
    --scale="$SCALE" --versions="$VERSIONS" --wait_instances=1 \
    --device="$(device_of $r)" \
    --interval_ms=1500 \
    --logtostderr >"$WORK/trainer$r.log" 2>&1 &
  TRAINERS+=($!)
  PIDS+=($!)
done

# Show the plan once everyone has registered (the trainer waits for the
# instance before publishing its first version, and pauses 1.5 s between
# versions so that there is time to look).
for _ in $(seq 600); do
  ctl plan --instance=vllm-tp4 >"$WORK/plan.txt" 2>/dev/null && break
  sleep 0.1
done
echo "== ferryctl participants"
ctl participants || true
echo "== ferryctl plan --instance=vllm-tp4 (first lines; --all lists every parameter)"
head -n 30 "$WORK/plan.txt" || true
if [ "$VERSIONS" -ge 2 ]; then
  echo "== ferryctl watch --watch_version=2"
  ctl watch --watch_version=2 || true
fi

status=0
for p in "${TRAINERS[@]}"; do wait "$p" || status=1; done
for p in "${ENGINES[@]}"; do wait "$p" || status=1; done
PIDS=()

echo "== trainer rank 0: one line per version"
grep -E "version [0-9]+" "$WORK/trainer0.log" | sed 's/^.*\] //' || true
echo "== engine ranks: what each verified"
for r in 0 1 2 3; do
  grep -E "verified|mismatch|ABORT" "$WORK/engine$r.log" | tail -n 1 | sed "s/^.*\] /rank $r: /" || true
done
echo "== streams"
ctl streams || true
if [ $status -eq 0 ]; then
  echo "demo: OK — $VERSIONS versions, every byte verified on every engine rank"
else
  echo "demo: FAILED"; tail -n 5 "$WORK"/*.log >&2
  KEEP_WORK=1
fi
exit $status
