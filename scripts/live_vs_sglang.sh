#!/usr/bin/env bash
# The live path, text prompts: kvroute serve against SGLang's router (sglang-router 0.3.2,
# --policy cache_aware) in front of the same three kvroute workers (started fresh for each
# run), the same built-in workload replayed by kvroute replay. SGLang's router takes text only,
# so prompts are decoded with Qwen3's tokenizer and every part tokenizes them itself.
# Needs: cargo build --release; scripts/fixtures.sh (the tokenizer); target/bench-venv with
# sglang-router 0.3.2 (the serve-overhead bench's --sglang makes it).
# Writes target/live-kvroute.json, target/live-sglang.json and target/live-vs-sglang.svg.
# Knobs: N requests, RATE per second (before the time scale), SCALE (engines and arrivals),
# TRACE (a Mooncake-format trace instead of the built-in workload, its first N rows) and SPEEDUP
# (its arrivals this many times sooner, before the time scale), SERVE_EXTRA (more kvroute serve
# flags, e.g. "--config weights.toml"), KV_BLOCKS (each worker's cache, default 8192 blocks of
# 16 tokens), SGLANG=0 (kvroute serve's run only), ORACLE=0 (no oracle: by default replay asks the three
# workers before each request how much of its prompt they hold, which costs each of them a
# tokenization of the prompt).
set -u
cd "$(dirname "$0")/.."
K=./target/release/kvroute
TOK=target/fixtures/qwen3
N=${N:-300}; RATE=${RATE:-2}; SCALE=${SCALE:-10}; TRACE=${TRACE:-}; SPEEDUP=${SPEEDUP:-1}
ORACLE=${ORACLE:-1}; KV_BLOCKS=${KV_BLOCKS:-8192}; SGLANG=${SGLANG:-1}
start_workers() {
  for i in 0 1 2; do
    $K worker --listen 127.0.0.1:2110$i --kv-events tcp://127.0.0.1:2120$i \
      --kv-replay tcp://127.0.0.1:2130$i --speedup "$SCALE" --kv-blocks "$KV_BLOCKS" --tokenizer $TOK \
      > /dev/null 2>&1 &
    PIDS+=($!)
  done
  for i in 0 1 2; do until curl -s -o /dev/null localhost:2110$i/health; do sleep 0.1; done; done
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
for i in 0 1 2; do
  workers="$workers --worker url=http://127.0.0.1:2110$i,events=tcp://127.0.0.1:2120$i,replay=tcp://127.0.0.1:2130$i,kv_blocks=$KV_BLOCKS"
done
replay() {
  if [ -n "$TRACE" ]; then
    workload=(--trace "$TRACE" --speedup "$(echo "$SPEEDUP * $SCALE" | bc -l)")
  else
    workload=(--rate "$RATE" --speedup "$SCALE")
  fi
  if [ "$ORACLE" = 1 ]; then
    workload+=(--oracle-worker http://127.0.0.1:21100,http://127.0.0.1:21101,http://127.0.0.1:21102)
  fi
  $K replay --url "$1" --requests "$N" "${workload[@]}" --model kvroute-sim \
    --text-with $TOK --json "$2" --label "$3" "${@:4}" 2>/dev/null
}

stop_all
start_workers
# shellcheck disable=SC2086
$K serve --listen 127.0.0.1:21080 --tokenizer $TOK ${SERVE_EXTRA:-} $workers > /dev/null 2>&1 &
PIDS+=($!)
until curl -s -o /dev/null localhost:21080/health; do sleep 0.1; done
sleep 0.5
echo "== kvroute serve"
replay http://127.0.0.1:21080 target/live-kvroute.json "kvroute serve"
stop_all
[ "$SGLANG" = 1 ] || exit 0

start_workers
target/bench-venv/bin/python -m sglang_router.launch_router --host 127.0.0.1 --port 21081 \
  --worker-urls http://127.0.0.1:21100 http://127.0.0.1:21101 http://127.0.0.1:21102 \
  --policy cache_aware --prometheus-port 21089 --log-level warn > /dev/null 2>&1 &
PIDS+=($!)
until curl -s -o /dev/null localhost:21081/health; do sleep 0.2; done
sleep 1
echo "== sglang-router 0.3.2, cache_aware"
replay http://127.0.0.1:21081 target/live-sglang.json "sglang-router cache_aware" \
  --plot target/live-vs-sglang.svg --plot-with target/live-kvroute.json
stop_all
