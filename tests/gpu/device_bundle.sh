#!/usr/bin/env bash
# Builds the GPU check's binaries here and packs them, with the shared
# libraries they need, for a GPU machine that has CUDA but neither Bazel
# nor Debian's gRPC/Abseil/glog (a bare GPU image with no network):
#
#   tests/gpu/device_bundle.sh [DIR]      # default: .device_bundle
#
# DIR/bin mirrors bazel-bin (tests/gpu/*, bench/gpu/*, daemon/ferryd, ...),
# DIR/python holds the Python client's wheel (built here, where protoc is:
# the GPU machine's python3 installs it without protoc),
# DIR/lib holds every library the binaries load except the C runtime, the
# CUDA driver and NCCL (218 MB; the GPU machine's own NCCL is used, found by
# device_check.sh), DIR/models the model files the demo reads. Then, on the
# GPU machine:
#
#   FERRY_PREBUILT=DIR tests/gpu/device_check.sh
#
# DIR is meant to be git-ignored (.git/info/exclude) and carried over.
set -euo pipefail
cd "$(dirname "$0")/../.."

DIR="${1:-.device_bundle}"
TARGETS=(//cuda/... //tests/gpu/... //bench/gpu/... //daemon:ferryd
         //client/ferryctl:ferryctl //examples/demo:demo_trainer
         //examples/demo:demo_engine //tools:ferry_load //python:libferry_tables.so)
BINARIES=(tests/gpu/viability_test tests/gpu/host_logic_test
          tests/gpu/gpu_kernels_test tests/gpu/gpu_fp8_test tests/gpu/gpu_ipc_test
          tests/gpu/gpu_nccl_test tests/gpu/gpu_device_memory_test
          tests/gpu/gpu_conformance_test tests/gpu/ipc_exporter
          bench/gpu/gpu_copy_bench bench/gpu/gpu_update_bench bench/gpu/gpu_fp8_bench
          daemon/ferryd client/ferryctl/ferryctl
          examples/demo/demo_trainer examples/demo/demo_engine tools/ferry_load
          python/libferry_tables.so)

bazel build -c opt --disk_cache="${FERRY_BAZEL_DISK_CACHE:-$HOME/.cache/ferry-bazel-disk}" \
  "${TARGETS[@]}"
BIN="$(bazel info -c opt bazel-bin)"

rm -rf "$DIR"
mkdir -p "$DIR/bin" "$DIR/lib" "$DIR/models"
for b in "${BINARIES[@]}"; do
  mkdir -p "$DIR/bin/$(dirname "$b")"
  cp -L "$BIN/$b" "$DIR/bin/$b"
done

# Every library the binaries resolve here, less what the GPU machine brings
# itself: the C/C++ runtime (its own is newer and backward compatible), the
# driver (libcuda, libnvidia-*) and NCCL.
skip='^(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libgcc_s|libstdc\+\+|libcuda|libnvidia-.*|libnccl)\.so'
# ldd on the binaries where Bazel left them: tests link Bazel's own
# libraries (_solib_k8) through a runpath relative to that place.
for b in "${BINARIES[@]}"; do
  ldd "$BIN/$b" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  name="$(basename "$lib")"
  if ! [[ "$name" =~ $skip ]]; then cp -L "$lib" "$DIR/lib/$name"; fi
done

# The wheel, built from a copy so that the checkout keeps no build files.
WHEEL_SRC="$(mktemp -d)"
cp -r python proto "$WHEEL_SRC/"
rm -rf "$WHEEL_SRC/python/build" "$WHEEL_SRC/python/ferry/v1/"*_pb2*.py
mkdir -p "$DIR/python"
/usr/bin/python3 -m pip wheel -q --no-deps --no-build-isolation \
  -w "$DIR/python" "$WHEEL_SRC/python"
rm -rf "$WHEEL_SRC"

MODELS="${FERRY_MODELS_DIR:-../shared/models}"
cp "$MODELS"/*.json "$DIR/models/"
du -sh "$DIR" | awk '{print "device_bundle: " $1 " in " d}' d="$DIR"
