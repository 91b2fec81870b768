// The run-time instruction-set dispatch of isa.h.
#include "isa.h"

#include <torch/extension.h>

#include <cstdlib>
#include <string>

int64_t best_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return kAvx2;
#endif
    return kGeneric;
}

int64_t resolve_isa(int64_t isa) {
    const int64_t best = best_isa();
    if (isa == kAuto) return best;
    TORCH_CHECK(isa >= kGeneric && isa <= best, "instruction set ", isa,
                " is not available on this CPU (best: ", best, ")");
    return isa;
}

const char* const kInt8IsaNames[] = {"generic", "avx2", "avx-vnni", "avx512-vnni"};

bool cpu_runs_int8(int64_t isa) {
    if (isa == kIntGeneric) return true;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (isa == kIntAvx2) return avx2;
    if (isa == kIntAvxVnni) return avx2 && __builtin_cpu_supports("avxvnni");
    if (isa == kIntAvx512Vnni)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    return false;
}

int64_t cpu_int8_isa() {
    for (int64_t isa = kIntAvx512Vnni; isa > kIntGeneric; --isa)
        if (cpu_runs_int8(isa)) return isa;
    return kIntGeneric;
}

int64_t int8_isa() {
    static const int64_t chosen = []() -> int64_t {
        const char* forced = std::getenv("SPECSERVE_INT8_ISA");
        if (forced == nullptr || *forced == '\0') return cpu_int8_isa();
        for (int64_t isa = kIntGeneric; isa <= kIntAvx512Vnni; ++isa)
            if (std::string(forced) == kInt8IsaNames[isa]) {
                TORCH_CHECK(cpu_runs_int8(isa), "SPECSERVE_INT8_ISA=", forced,
                            " is not available on this CPU (best: ",
                            kInt8IsaNames[cpu_int8_isa()], ")");
                return isa;
            }
        TORCH_CHECK(false, "SPECSERVE_INT8_ISA must be generic, avx2, avx-vnni or avx512-vnni, got ",
                    forced);
        return kIntGeneric;
    }();
    return chosen;
}

int64_t resolve_int8_isa(int64_t isa) {
    if (isa == kIntAuto) return int8_isa();
    TORCH_CHECK(isa >= kIntGeneric && isa <= kIntAvx512Vnni && cpu_runs_int8(isa),
                "integer variant ", isa, " is not available on this CPU");
    return isa;
}
