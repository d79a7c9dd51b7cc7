#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (it has torch, triton and transformers, but not
# pyzmq, msgspec or xgrammar: their cp312 wheels travel in .whl/, see the device tool's README).
# Runs the GPU tests (Triton kernels against their references, fp32 and bf16 parity with transformers,
# a step launched under torch.cuda.set_sync_debug_mode("error")), the async bench (bubble per step),
# then `bench offline` on the bench model and on a Qwen3-0.6B-shaped model with nano-vllm's workload
# (256 requests, prompts 100-1024 tokens; outputs fixed at 512, the middle of its 100-1024 range, as
# `bench offline` takes one output length), and batch-1 decode with the decode graphs and without
# (--enforce-eager). Budget: under 8 minutes.
# Usage there: bash benchmarks/gpu_check.sh   (results also under $OUT when set)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tandem-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# TRITON_INTERPRET=0: the CPU test modules default it to 1 at import; here the kernels must run natively.
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 180 python3 -m pytest -q -m gpu tests/kernels/test_gpu.py tests/kernels/test_input_prep.py 2>&1 | tee "$OUT/tests.log"
test -d /tmp/bench-llama || python3 -m tandem.launch.make_model --arch llama --size bench --out /tmp/bench-llama
test -d /tmp/qwen3-0.6b || python3 -m tandem.launch.make_model --arch qwen3 --size 0.6b --out /tmp/qwen3-0.6b &
MAKE=$!
timeout 70 python3 -m tandem.launch.cli bench async --model /tmp/bench-llama --device cuda --batches 1,16,64 \
  --output-len 128 --json "$OUT/async.json" 2>&1 | tee "$OUT/async.log"
python3 - "$OUT/async.json" <<'PY' | tee -a "$OUT/async.log"
import json, sys
r = json.load(open(sys.argv[1]))
for mode in ("async_on", "async_off"):
    print(mode, "bubble us/step:", {b: round(1000 * v["worker_idle_ms_per_step"], 1) for b, v in r[mode].items()})
PY
timeout 45 python3 -m tandem.launch.cli bench offline --model /tmp/bench-llama --device cuda --skip-baseline \
  --json "$OUT/offline.json" 2>&1 | tail -4 | tee "$OUT/offline.log"
for mode in graphs eager; do  # what the captured decode steps buy at batch 1, where launches dominate
  flag=; [ $mode = eager ] && flag=--enforce-eager
  timeout 35 python3 -m tandem.launch.cli bench latency --model /tmp/bench-llama --device cuda --skip-baseline $flag \
    --prompt-len 64 --output-len 256 --num-requests 2 --json "$OUT/latency_$mode.json" 2>&1 | grep RESULT \
    | sed "s/^/$mode /" | tee -a "$OUT/latency.log"
done
wait $MAKE
timeout 140 python3 -m tandem.launch.cli bench offline --model /tmp/qwen3-0.6b --device cuda --skip-baseline \
  --num-requests 256 --input-len 100:1024 --output-len 512 --max-running-requests 256 \
  --max-num-batched-tokens 16384 --kv-memory-fraction 0.5 \
  --json "$OUT/offline_qwen3.json" 2>&1 | tail -6 | tee "$OUT/offline_qwen3.log"
