#!/usr/bin/env bash
# Disaggregated serving, live: kvroute serve (--pd-protocol sglang) against SGLang's router in
# its PD mode (sglang-router 0.3.2, --pd-disaggregation, cache_aware) in front of the same four
# kvroute workers (two --role prefill with bootstrap servers, two --role decode; started fresh
# for each run), the same built-in workload replayed by kvroute replay. SGLang's router takes
# text only, so prompts are decoded with Qwen3's tokenizer and every part tokenizes them itself.
# Needs: cargo build --release; scripts/fixtures.sh (the tokenizer); target/bench-venv with
# sglang-router 0.3.2 (the serve-overhead bench's --sglang makes it).
# Writes target/live-pd-kvroute.json and target/live-pd-sglang.json.
# Knobs: N requests, RATE per second (before the time scale), SCALE (engines and arrivals),
# KV_BLOCKS (each worker's cache, default 8192 blocks of 16 tokens).
set -u
cd "$(dirname "$0")/.."
K=./target/release/kvroute
TOK=target/fixtures/qwen3
N=${N:-300}; RATE=${RATE:-2}; SCALE=${SCALE:-10}; KV_BLOCKS=${KV_BLOCKS:-8192}
start_workers() {
  for i in 0 1; do
    $K worker --listen 127.0.0.1:2210$i --kv-events tcp://127.0.0.1:2220$i \
      --kv-replay tcp://127.0.0.1:2230$i --speedup "$SCALE" --kv-blocks "$KV_BLOCKS" --tokenizer $TOK \
      --role prefill --bootstrap-port 2240$i > /dev/null 2>&1 &
    PIDS+=($!)
  done
  for i in 2 3; do
    $K worker --listen 127.0.0.1:2210$i --kv-events tcp://127.0.0.1:2220$i \
      --kv-replay tcp://127.0.0.1:2230$i --speedup "$SCALE" --kv-blocks "$KV_BLOCKS" --tokenizer $TOK \
      --role decode > /dev/null 2>&1 &
    PIDS+=($!)
  done
  for i in 0 1 2 3; do until curl -s -o /dev/null localhost:2210$i/health; do sleep 0.1; done; done
}
# Every process this script starts runs in a process group of its own (job control on), so
# that stop_all ends exactly those, children included (SGLang's router runs under Python).
set -m
PIDS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill -- "-$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  PIDS=()
}
trap stop_all EXIT
workers=""
for i in 0 1; do
  workers="$workers --worker url=http://127.0.0.1:2210$i,events=tcp://127.0.0.1:2220$i,replay=tcp://127.0.0.1:2230$i,kv_blocks=$KV_BLOCKS,role=prefill,bootstrap_port=2240$i"
done
for i in 2 3; do
  workers="$workers --worker url=http://127.0.0.1:2210$i,events=tcp://127.0.0.1:2220$i,replay=tcp://127.0.0.1:2230$i,kv_blocks=$KV_BLOCKS,role=decode"
done
replay() {
  $K replay --url "$1" --requests "$N" --rate "$RATE" --speedup "$SCALE" --model kvroute-sim \
    --text-with $TOK --json "$2" --label "$3" 2>/dev/null
}

stop_all
start_workers
# shellcheck disable=SC2086
$K serve --listen 127.0.0.1:22080 --tokenizer $TOK --pd-protocol sglang $workers > /dev/null 2>&1 &
PIDS+=($!)
until curl -s -o /dev/null localhost:22080/health; do sleep 0.1; done
sleep 1
echo "== kvroute serve, SGLang's protocol"
replay http://127.0.0.1:22080 target/live-pd-kvroute.json "kvroute serve"
stop_all

start_workers
target/bench-venv/bin/python -m sglang_router.launch_router --host 127.0.0.1 --port 22081 \
  --pd-disaggregation --prefill http://127.0.0.1:22100 22400 --prefill http://127.0.0.1:22101 22401 \
  --decode http://127.0.0.1:22102 --decode http://127.0.0.1:22103 \
  --policy cache_aware --prometheus-port 22089 --log-level warn > target/live-pd-sglang.log 2>&1 &
PIDS+=($!)
until curl -s -o /dev/null localhost:22081/health; do sleep 0.2; done
sleep 1
echo "== sglang-router 0.3.2 PD mode, cache_aware"
replay http://127.0.0.1:22081 target/live-pd-sglang.json "sglang-router PD cache_aware"
stop_all
