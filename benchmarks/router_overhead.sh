#!/bin/bash
# What a many-model server's routing costs: the same `tandem bench serve` requests to `tandem serve NAME` (one
# model, no router) and to a server of two models (NAME behind the router, its engine a child), in turns
# (order alternating, a fresh prompt seed per round so that neither server's prefix cache has seen them).
#   benchmarks/router_overhead.sh MODELS_DIR [NAME OTHER [OUT [ROUNDS]]]
# MODELS_DIR holds NAME and OTHER as `tandem pull` leaves them (e.g. smollm2-135m-instruct, gemma3-270m).
set -euo pipefail
MODELS=$(realpath "$1"); NAME=${2:-smollm2-135m-instruct}; OTHER=${3:-gemma3-270m}
OUT=${4:-router_overhead}; ROUNDS=${5:-4}
TANDEM=${TANDEM:-tandem}
export TANDEM_MODELS=$MODELS
mkdir -p "$OUT"
$TANDEM serve "$NAME" --port 8101 > "$OUT/direct.log" 2>&1 & D=$!
$TANDEM serve --model "$NAME" --model "$OTHER" --port 8102 > "$OUT/router.log" 2>&1 & R=$!
trap 'kill $D $R 2>/dev/null; wait' EXIT
for p in 8101 8102; do until curl -sf "http://127.0.0.1:$p/health" > /dev/null; do sleep 1; done; done
# the router's model loaded before any timing (its first request starts it)
curl -sf http://127.0.0.1:8102/v1/completions -H 'content-type: application/json' \
  -d "{\"model\":\"$NAME\",\"prompt\":\"hi\",\"max_tokens\":2}" > /dev/null
for round in $(seq 1 "$ROUNDS"); do
  order="direct:8101 router:8102"; [ $((round % 2)) = 0 ] && order="router:8102 direct:8101"
  for which in $order; do
    label=${which%%:*}-$round; port=${which##*:}
    $TANDEM bench serve --base-url "http://127.0.0.1:$port" --model "$NAME" --tokenizer "$MODELS/$NAME" \
      --num-prompts 64 --max-concurrency 16 --input-len 64:256 --output-len 64:64 --seed $((100 + round)) \
      --label "$label" --result-dir "$OUT/$label" 2>&1 | grep -a " ok, " | sed "s/^/$label: /"
  done
done
