#!/usr/bin/env bash
# specserve against llama.cpp on the same GGUF file (default: the embedded
# SmolLM2-135M-Instruct.Q4_1.gguf), side by side in one run, on CPU:
#
#   specserve-none          specserve serve --quantization gguf --speculative-method none
#   specserve-ngram         specserve serve --quantization gguf --speculative-method ngram
#   specserve-none-float32  specserve serve --quantization none --speculative-method none
#                           (the GGUF dequantized to float32: our path before native kernels)
#   llama-server            llama.cpp's own C++ server, built from the llama.cpp source that
#                           the llama-cpp-python sdist vendors (benchmarks/build_llama_server.sh),
#                           with as many slots (-np) as the highest concurrency level: the
#                           reference every ratio divides by
#   llama-server-ngram      the same with its n-gram speculation (--spec-type ngram-simple
#                           --spec-draft-n-max 16)
#   llama-cpp-python        llama-cpp-python's server (python -m llama_cpp.server), pinned
#                           version, built from source with -DGGML_NATIVE=ON into .venv-llamacpp
#   On a CPU with AMX both llama.cpp builds get -mno-amx-tile -mno-amx-int8 -mno-amx-bf16: its
#   AMX path crashes here (SIGILL on an OpenMP worker).
#
# `specserve bench serve` drives all of them, taking turns on every workload and load level
# (greedy, streamed, EOS honoured), one call per concurrency level C with max(--num-prompts, C)
# prompts per workload (so that C requests are really in flight), merged into OUTPUT.json and
# OUTPUT.png (each answer's digest; the texts stay in the parts under the logs folder, and the
# last lines say whether the two GGUF specserve servers' greedy answers were equal). Then
# `specserve bench offline --methods none --hf-modes plain` measures
# transformers generate() on the dequantized float32 weights in one process (batch 1, greedy,
# EOS ignored; beside it our engine on the same weights) into OUTPUT_transformers.json (.png).
# Every server and transformers get the same thread count (--threads). The last lines printed
# are a table of output tokens/s per server, workload and concurrency, with ratios to llama-server;
# OUTPUT.json's "vs_llamacpp" section holds versions, command lines and the machine's load.
#
# llama-cpp-python's server answers ONE REQUEST AT A TIME: a global lock around each request
# (llama_cpp/server/app.py), no parallel slots or batching across requests (its Llama object
# holds a single sequence). That is what a user of `python -m llama_cpp.server` gets, so at
# concurrency 16 it is measured as it is: the requests queue, its tokens/s stays its
# single-stream speed and TTFT includes the wait. Its default interrupt_requests=true would cut a
# streaming answer short whenever another request waits; it runs with --interrupt_requests false
# so every answer is complete, and with --logits_all false (the default true copies the logits
# of every position, needed only for logprobs, which no request asks for). Its stream carries no
# `usage`, so its output tokens are counted as streamed chunks (about one per token).
#
#   benchmarks/vs_llamacpp.sh [--output OUTPUT.json] [--model FILE.gguf] [--num-prompts 8]
#       [--concurrency 1,16] [--workload code,copy,chat] [--max-tokens 128] [--threads 2]
#       [--no-float32] [--no-transformers] [--no-llama-server-ngram] [--no-llama-cpp-python]
#       [--offline-num-prompts 2] [--offline-repeats 2]
#       [-- more `bench serve` arguments]
#
# Defaults take about 35 minutes on 2 cores (plus the one-time llama.cpp builds, ~25 minutes).
# Run it on a quiet machine: llama.cpp's OpenMP threads spin at every barrier, and with another
# busy process on the cores its decode went from ~15 ms to 85-3500 ms a token in trials here
# (specserve, whose threads wait passively, slows far less): a noisy run favours specserve.
# Environment: BIN (default .venv/bin), LLAMACPP_VENV (.venv-llamacpp), LLAMACPP_SPEC
# ('llama-cpp-python[server]==0.3.36'), LLAMACPP_BUILD_LOG (/tmp/llamacpp-build.log),
# CMAKE_BUILD_PARALLEL_LEVEL (2), SPECSERVE_GGUF_ARGS ('--quantization gguf'),
# SPECSERVE_FLOAT_ARGS ('--quantization none'): the arguments that pick the weight format.
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${BIN:-.venv/bin}
llama_venv=${LLAMACPP_VENV:-.venv-llamacpp}
llama_spec=${LLAMACPP_SPEC:-llama-cpp-python[server]==0.3.36}
build_log=${LLAMACPP_BUILD_LOG:-/tmp/llamacpp-build.log}
read -r -a gguf_args <<<"${SPECSERVE_GGUF_ARGS---quantization gguf}"
read -r -a float_args <<<"${SPECSERVE_FLOAT_ARGS---quantization none}"

output=benchmarks/results/vs_llamacpp_cpu_$(date +%F).json
model=""
num_prompts=8
concurrency=1,16
workload=code,copy,chat
max_tokens=128
threads=2
float32=1
transformers=1
server_ngram=1
llama_cpp_python=1
offline_prompts=2
offline_repeats=2
while (($#)); do
    case $1 in
        --output) output=$2; shift 2 ;;
        --model) model=$2; shift 2 ;;
        --num-prompts) num_prompts=$2; shift 2 ;;
        --concurrency) concurrency=$2; shift 2 ;;
        --workload) workload=$2; shift 2 ;;
        --max-tokens) max_tokens=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --no-float32) float32=0; shift ;;
        --no-transformers) transformers=0; shift ;;
        --no-llama-server-ngram) server_ngram=0; shift ;;
        --no-llama-cpp-python) llama_cpp_python=0; shift ;;
        --offline-num-prompts) offline_prompts=$2; shift 2 ;;
        --offline-repeats) offline_repeats=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "$0: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
    esac
done
[[ $output == *.json ]] || { echo "$0: --output must end in .json" >&2; exit 2; }
for number in "$num_prompts" "$threads" ${concurrency//,/ }; do
    [[ $number =~ ^[1-9][0-9]*$ ]] || { echo "$0: not a positive integer: '$number'" >&2; exit 2; }
done
offline_output=${output%.json}_transformers.json
mkdir -p "$(dirname "$output")"

# 1. llama-cpp-python, compiled from source for this CPU, in its own venv; llama-server.
amx_off=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
want_version=${llama_spec##*==}
if ((llama_cpp_python)) && ! "$llama_venv/bin/python" -c "import llama_cpp, llama_cpp.server, sys; \
        sys.exit(llama_cpp.__version__ != '$want_version')" 2>/dev/null; then
    echo "building $llama_spec into $llama_venv (compiles llama.cpp: minutes; log: $build_log)" >&2
    test -x "$llama_venv/bin/python" || python3 -m venv "$llama_venv"
    if ! CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
            CMAKE_ARGS="-DGGML_NATIVE=ON ${amx_off:+-DCMAKE_C_FLAGS='$amx_off' -DCMAKE_CXX_FLAGS='$amx_off'} ${CMAKE_ARGS:-}" \
            "$llama_venv/bin/pip" install --disable-pip-version-check -v "$llama_spec" \
            >"$build_log" 2>&1; then
        tail -n 30 "$build_log" >&2
        echo "$0: building $llama_spec failed (log: $build_log)" >&2
        exit 1
    fi
fi

llama_server=$(LLAMACPP_SPEC=$llama_spec PIP=$bin/pip benchmarks/build_llama_server.sh | tail -n 1)

# 2. The GGUF file every server loads.
if [[ -z $model ]]; then
    model=$("$bin/python" -c \
        "from engine.models.loader import default_model_path; print(default_model_path())")
fi
[[ -f $model && $model == *.gguf ]] || { echo "$0: $model is not a .gguf file" >&2; exit 2; }
echo "model: $model" >&2

# A busy machine skews everything, llama.cpp most (see the top of this file).
read -r load_1min _ </proc/loadavg
if awk -v load="$load_1min" 'BEGIN { exit !(load > 0.5) }'; then
    echo "warning: 1-minute load average is $load_1min before the run: other work on this" \
        "machine skews the figures (llama.cpp's most; see the JSON's load averages)" >&2
fi

# 3. The servers, on free loopback ports; logs in a temporary folder. Our GGUF kernel is
# compiled (once, cached) before they start rather than by each of them.
logs=$(mktemp -d /tmp/vs_llamacpp.XXXXXX)
if [[ -f engine/quant/kernels.py ]] \
        && ! "$bin/python" -m engine.quant.kernels >"$logs/kernel.log" 2>&1; then
    echo "warning: building the GGUF kernel failed (see $logs/kernel.log); the servers" \
        "log what they fall back to" >&2
fi
read -r -a ports <<<"$("$bin/python" -m benchmarks.vs_llamacpp ports 6)"
labels=() urls=() health=() pids=() commands=()
# One at a time: each specserve times its steps at start-up (the controller's cost model), and
# servers started together timed theirs on a shared CPU, 2-4x too slow and unevenly so.
start_server() {  # LABEL PORT HEALTH_PATH COMMAND...
    local label=$1 port=$2 path=$3
    shift 3
    OMP_NUM_THREADS=$threads "$@" >"$logs/$label.log" 2>&1 &
    pids+=($!)
    labels+=("$label")
    urls+=("http://127.0.0.1:$port")
    health+=("http://127.0.0.1:$port$path" "$!")
    commands+=("$label=OMP_NUM_THREADS=$threads $*")
    if ! "$bin/python" -m benchmarks.vs_llamacpp wait "http://127.0.0.1:$port$path" "$!"; then
        echo "--- $logs/$label.log" >&2
        tail -n 15 "$logs/$label.log" >&2
        exit 1
    fi
}
stop_servers() {
    ((${#pids[@]})) || return 0
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    pids=()
}
trap 'stop_servers' EXIT
specserve=("$bin/specserve" serve --model "$model" --log-level warning)
start_server specserve-none "${ports[0]}" /health \
    "${specserve[@]}" --port "${ports[0]}" "${gguf_args[@]}" --speculative-method none
start_server specserve-ngram "${ports[1]}" /health \
    "${specserve[@]}" --port "${ports[1]}" "${gguf_args[@]}" --speculative-method ngram
if ((float32)); then
    start_server specserve-none-float32 "${ports[2]}" /health \
        "${specserve[@]}" --port "${ports[2]}" "${float_args[@]}" --speculative-method none
fi
slots=0
for level in ${concurrency//,/ }; do
    ((level > slots)) && slots=$level
done
llama_server_args=(-m "$model" --host 127.0.0.1 -t "$threads" -tb "$threads" -np "$slots"
    -c $((2048 * slots)) --no-webui)
start_server llama-server "${ports[4]}" /health \
    "$llama_server" "${llama_server_args[@]}" --port "${ports[4]}"
if ((server_ngram)); then
    start_server llama-server-ngram "${ports[5]}" /health \
        "$llama_server" "${llama_server_args[@]}" --port "${ports[5]}" \
        --spec-type ngram-simple --spec-draft-n-max 16
fi
# HOST / PORT in the environment would override llama_cpp.server's own --host / --port.
if ((llama_cpp_python)); then
    start_server llama-cpp-python "${ports[3]}" /v1/models \
        env -u HOST -u PORT "$llama_venv/bin/python" -m llama_cpp.server --model "$model" \
        --host 127.0.0.1 --port "${ports[3]}" --n_ctx 2048 --n_threads "$threads" \
        --n_threads_batch "$threads" --interrupt_requests false --logits_all false
fi
echo "starting ${labels[*]} (logs: $logs)" >&2
if ! "$bin/python" -m benchmarks.vs_llamacpp wait "${health[@]}"; then
    for label in "${labels[@]}"; do
        echo "--- $logs/$label.log" >&2
        tail -n 15 "$logs/$label.log" >&2
    done
    exit 1
fi

# 4. All servers side by side, one `bench serve` per concurrency level: a level of C gets
# max(--num-prompts, C) prompts, so that C requests are really in flight at once.
bench=()
for i in "${!labels[@]}"; do
    bench+=(--base-url "${urls[$i]}" --label "${labels[$i]}")
done
parts=()
for level in ${concurrency//,/ }; do
    prompts=$((level > num_prompts ? level : num_prompts))
    echo "concurrency $level, $prompts prompts per workload" >&2
    "$bin/specserve" bench serve "${bench[@]}" --workload "$workload" --concurrency "$level" \
        --num-prompts "$prompts" --max-tokens "$max_tokens" --temperature 0 \
        --output "$logs/serve_c$level.json" --plot "$logs/serve_c$level.png" --keep-texts "$@" \
        >/dev/null
    parts+=("$logs/serve_c$level.json")
done
stop_servers
"$bin/python" -m benchmarks.vs_llamacpp merge --output "$output" "${parts[@]}"

# 5. transformers generate() on the dequantized weights, with our float32 engine beside it.
offline=()
if ((transformers)); then
    OMP_NUM_THREADS=$threads "$bin/specserve" bench offline --model "$model" --methods none \
        --hf-modes plain --workload "$workload" --num-prompts "$offline_prompts" \
        --repeats "$offline_repeats" --max-tokens "$max_tokens" --concurrency 0 \
        --output "$offline_output" >/dev/null
    offline=(--offline "$offline_output")
fi

server_args=()
for command in "${commands[@]}"; do
    server_args+=(--server "$command")
done
"$bin/python" -m benchmarks.vs_llamacpp finish --serve "$output" "${offline[@]}" \
    --llamacpp-python "$( ((llama_cpp_python)) && echo "$llama_venv/bin/python")" --llama-server "$llama_server" --model-file "$model" --threads "$threads" \
    --load-at-start "$load_1min" \
    "${server_args[@]}" --logs "$logs"
