// Which instruction-set variant each kernel family runs: the one place that asks the CPU what it
// supports. The float kernels (gguf_cpu.cpp's dequantize-and-multiply, vec_ops.cpp's attention
// and SiLU) and the integer kernels (gguf_int8.cpp) are each compiled once per variant and pick
// one here at run time.
#pragma once

#include <cstdint>

// Float kernels: the widest the CPU runs, or a narrower one a caller names (tests, benchmarks).
enum FloatIsa : int64_t { kAuto = -1, kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };
extern const char* const kFloatIsaNames[];  // as SPECSERVE_FLOAT_ISA names them
int64_t best_isa();
// The variant this process uses: the CPU's widest, or a narrower one named by SPECSERVE_FLOAT_ISA
// (with SPECSERVE_INT8_ISA=avx2, what an AVX2-only CPU runs). Fixed at the first call.
int64_t float_isa();
int64_t resolve_isa(int64_t isa);  // kAuto -> float_isa(); refuses one the CPU cannot run

// Integer kernels. Not a chain: CPUs with AVX-512 VNNI may lack AVX-VNNI. AMX-INT8 also needs
// AVX-512 VNNI (its few-row calls run there) and the kernel's leave to use the tiles, asked once
// per process (arch_prctl ARCH_REQ_XCOMP_PERM).
enum Int8Isa : int64_t {
    kIntAuto = -1, kIntGeneric = 0, kIntAvx2 = 1, kIntAvxVnni = 2, kIntAvx512Vnni = 3, kIntAmx = 4,
    kIntLast = kIntAmx
};
extern const char* const kInt8IsaNames[];  // as SPECSERVE_INT8_ISA names them
bool cpu_runs_int8(int64_t isa);
int64_t cpu_int8_isa();  // the best integer variant this CPU runs
// The variant this process uses: the CPU's best, or another it runs named by SPECSERVE_INT8_ISA.
// Fixed at the first call, so every step of a process computes the same way.
int64_t int8_isa();
int64_t resolve_int8_isa(int64_t isa);  // kIntAuto -> int8_isa(); refuses one the CPU cannot run
