#!/usr/bin/env bash
# benchmarks/engine_core_check.py on a lent GPU machine, in one call that carries .whl
# (benchmarks/device_wheels.sh, plus pyzmq and msgspec) and .gpu/smol (the default model's config
# and tokenizer files): a random-weight model in the default model's shape, bf16, both engine
# cores side by side at concurrency 1, 16 and 64, then the engine process killed mid-stream.
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECSERVE_CACHE_DIR=/tmp/ssc
python3 -m benchmarks.random_weights .gpu/smol /tmp/smolrand || exit 1
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
timeout -k 20 "${CHECK_S:-450}" python3 -m benchmarks.engine_core_check \
    --output "$OUT/engine_core_${gpu}.json" \
    --server-args "--model /tmp/smolrand --device cuda --dtype bfloat16 --gpu-memory-utilization 0.4" \
    --bench-args "--workload chat --num-prompts 64 --max-tokens 128 --ignore-eos --concurrency 1,16,64" \
    >"$OUT/check.log" 2>&1
echo "== engine_core_check rc $?"
grep -v -E "leaked|nanobind|skipped" "$OUT/check.log" | tail -60
