#!/usr/bin/env bash
# Installs everything ferry needs to build and test on Debian 12, from
# Debian's own packages. Idempotent: a machine that already has them spends
# a second in dpkg-query and touches nothing.
#
#   deploy/bootstrap.sh            # build + test dependencies (C++ and Python)
#   deploy/bootstrap.sh PKG...     # those, and these Debian packages too
#
# tools/k8s_check.sh asks for `nodejs npm` that way where there is no node
# (it validates deploy/k8s/ with an npm package); they are not in the list
# below because a machine may have node from elsewhere (NodeSource's nodejs
# bundles npm and conflicts with Debian's npm package).
#
# clang-14 checks the lock annotations (tools/thread_safety.sh; gcc ignores
# them) and builds the libFuzzer targets (tools/fuzz.sh); its sanitizer and
# libFuzzer runtimes are libclang-rt-14-dev, which clang-14 only recommends
# (and --no-install-recommends skips), so it is listed here itself.
#
# CUDA 13 and NCCL 2.28 are not Debian packages; when /usr/local/cuda exists
# the GPU targets build, otherwise they are reported SKIPPED.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap bazel-rules-java bazel-platforms
  g++ make
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgoogle-glog-dev libgflags-dev catch2 nlohmann-json3-dev
  libssl-dev openssl libxxhash-dev libcivetweb-dev python3-prometheus-client
  libgoogle-perftools-dev
  python3 python3-grpcio python3-protobuf python3-torch python3-numpy
  python3-setuptools python3-wheel python3-pip python3-venv
  clang-14 libclang-rt-14-dev libfuzzer-14-dev
  libucx-dev
  iproute2 procps
)
PACKAGES+=("$@")

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "bootstrap: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "bootstrap: done" >&2
