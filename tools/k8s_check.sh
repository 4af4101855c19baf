#!/usr/bin/env bash
# Checks ferry's Kubernetes manifests (deploy/k8s/, docs/operations.md):
# each parses, passes the Kubernetes API schema of its kind with no unknown
# field, and follows what the API server and ferryd require beyond it
# (tools/k8s_check/check.js says which rules). Then the self-test: every
# manifest under tests/deploy/bad/ must be refused, for the reason its
# "# expect:" lines give.
#
#   tools/k8s_check.sh            # deploy/k8s/, then the self-test
#   tools/k8s_check.sh PATH...    # only these files or directories, as one set
#
# Prints one line per manifest file; exits 0 when everything is as expected.
# Run by tools/test.sh as one test.
#
# The validator is the npm package kubernetes-models (JSON-schema validation
# generated from Kubernetes' OpenAPI spec) with js-yaml, at the versions in
# tools/k8s_check/package-lock.json. The first run installs them with
# `npm ci` into tools/k8s_check/node_modules (git-ignored; needs the npm
# registry once); later runs are offline, until the lockfile changes. Needs
# node >= 14 and npm: without them it installs Debian's nodejs and npm
# through deploy/bootstrap.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=tools/k8s_check

fail() {
  echo "k8s_check: FAILED: $*"
  exit 1
}

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "k8s_check: no node/npm here; installing Debian's nodejs and npm" >&2
  deploy/bootstrap.sh nodejs npm >&2 || fail "could not install nodejs and npm (deploy/bootstrap.sh nodejs npm)"
  command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 ||
    fail "node and npm are still missing after deploy/bootstrap.sh nodejs npm"
fi
major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null)
[ "${major:-0}" -ge 14 ] 2>/dev/null || fail "node $(node --version 2>/dev/null) is too old; kubernetes-models needs node >= 14"

# node_modules matches the lockfile it was installed from, or is installed
# again. npm ci installs exactly the locked versions, checks every
# package's integrity hash, and runs no install scripts here.
stamp="$dir/node_modules/.ferry-package-lock.sha256"
want=$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "k8s_check: installing the validator (npm ci in $dir; once, offline afterwards)" >&2
  (cd "$dir" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error) >&2 ||
    fail "npm ci in $dir (the first run needs the npm registry)"
  echo "$want" >"$stamp"
fi

if [ $# -gt 0 ]; then
  exec node "$dir/check.js" "$@"
fi
exec node "$dir/check.js" deploy/k8s --self-test tests/deploy/bad
