#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (it has torch, triton and transformers, but not
# pyzmq, msgspec or xgrammar: their cp312 wheels travel in .whl/, see the device tool's README).
# Runs the GPU tests, then the async and offline benchmarks on CUDA; well under 8 minutes.
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
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_input_prep_kernels.py 2>&1 | tee "$OUT/tests.log"
test -d /tmp/bench-llama || python3 -m launch.make_model --arch llama --size bench --out /tmp/bench-llama
timeout 150 python3 -m launch.cli bench async --model /tmp/bench-llama --device cuda --batches 1,16,64 \
  --output-len 128 --json "$OUT/async.json" 2>&1 | tee "$OUT/async.log"
timeout 120 python3 -m launch.cli bench offline --model /tmp/bench-llama --device cuda --skip-baseline \
  --json "$OUT/offline.json" 2>&1 | tail -4 | tee "$OUT/offline.log"
