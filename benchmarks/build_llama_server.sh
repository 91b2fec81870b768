#!/usr/bin/env bash
# Builds llama.cpp's own C++ server (`llama-server`) from the llama.cpp source vendored in the
# llama-cpp-python sdist (the same llama.cpp that benchmarks/vs_llamacpp.sh's Python server
# runs), for this CPU (GGML_NATIVE), into .llama-server/ (about 6 minutes on 2 cores, once).
# Prints the binary's path on its last line; a second run with the binary in place builds nothing.
#
# On a CPU with AMX, llama.cpp's AMX path crashes here (SIGILL on an OpenMP worker that never
# asked the kernel for tile data), so the build turns AMX code generation off
# (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16), as vs_llamacpp.sh does for llama-cpp-python.
#
#   benchmarks/build_llama_server.sh [--prefix DIR]
# Environment: LLAMACPP_SPEC ('llama-cpp-python==0.3.36'), CMAKE_BUILD_PARALLEL_LEVEL (2),
# PIP (.venv/bin/pip, else pip3), LLAMA_SERVER_BUILD_LOG (/tmp/llama-server-build.log).
set -euo pipefail
cd "$(dirname "$0")/.."

prefix=.llama-server
while (($#)); do
    case $1 in
        --prefix) prefix=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "$0: unknown argument $1" >&2; exit 2 ;;
    esac
done
spec=${LLAMACPP_SPEC:-llama-cpp-python==0.3.36}
spec=${spec/\[server\]/}
log=${LLAMA_SERVER_BUILD_LOG:-/tmp/llama-server-build.log}
pip=${PIP:-.venv/bin/pip}
[[ -x $pip ]] || pip=pip3
binary=$prefix/build/bin/llama-server
if [[ -x $binary && -f $prefix/spec && $(<"$prefix/spec") == "$spec" ]]; then
    echo "$binary"
    exit 0
fi

amx_off=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
rm -rf "$prefix"
mkdir -p "$prefix"
echo "building llama-server from the $spec sdist into $prefix (log: $log)" >&2
{
    "$pip" download --disable-pip-version-check --no-deps --no-binary :all: "$spec" -d "$prefix"
    tar xzf "$prefix"/*.tar.gz -C "$prefix"
    source_dir=$(echo "$prefix"/*/vendor/llama.cpp)
    cmake -S "$source_dir" -B "$prefix/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DCMAKE_C_FLAGS="$amx_off" -DCMAKE_CXX_FLAGS="$amx_off"
    cmake --build "$prefix/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
} >"$log" 2>&1 || { tail -n 30 "$log" >&2; echo "$0: the build failed (log: $log)" >&2; exit 1; }
echo "$spec" >"$prefix/spec"
echo "$binary"
