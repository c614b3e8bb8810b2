#!/usr/bin/env bash
# Throughput of kvroute-sim with the latency model off: 4 pods in one process pinned to
# core 0, one wrk per pod pinned to core 1. Needs `wrk` (apt-get install -y wrk) and
# `taskset` (util-linux). Usage: sim/bench.sh [seconds] [connections-per-pod]
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-10}"
CONNS="${2:-16}"
BASE=19001
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo build --release -q -p kvroute-sim
BIN="$CARGO_TARGET_DIR/release/kvroute-sim"
WORK="$(mktemp -d)"
trap 'kill "$SIM" 2>/dev/null || true; rm -rf "$WORK"' EXIT

cat >"$WORK/chat.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"Say hello in one short sentence."}],"max_tokens":16}'
LUA
cat >"$WORK/stream.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"Say hello in one short sentence."}],"max_tokens":16,"stream":true,"stream_options":{"include_usage":true}}'
LUA

taskset -c 0 "$BIN" --pods 4 --base-port "$BASE" --no-latency --threads 1 >"$WORK/sim.out" &
SIM=$!
for _ in $(seq 50); do [ "$(wc -l <"$WORK/sim.out")" -ge 4 ] && break; sleep 0.1; done
cat "$WORK/sim.out"

run() { # name script path
  local total=0
  for i in 0 1 2 3; do
    taskset -c 1 wrk -t1 -c"$CONNS" -d"${DUR}s" -s "$WORK/$2" "http://127.0.0.1:$((BASE + i))$3" >"$WORK/$1.$i" &
  done
  wait $(jobs -p | grep -v "^$SIM$") 2>/dev/null || true
  for i in 0 1 2 3; do
    if grep -q "Non-2xx" "$WORK/$1.$i"; then echo "$1: non-2xx responses on pod $i"; cat "$WORK/$1.$i"; exit 1; fi
    total=$(awk -v t="$total" '/Requests\/sec/ {printf "%.0f", t + $2}' "$WORK/$1.$i")
  done
  grep -h "Requests/sec" "$WORK/$1".*
  echo "$1: $total req/s (4 pods, one core, ${DUR}s, $((CONNS * 4)) connections)"
}
run chat chat.lua /v1/chat/completions
run chat-sse stream.lua /v1/chat/completions
