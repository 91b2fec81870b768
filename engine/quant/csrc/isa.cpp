// The run-time instruction-set dispatch of isa.h.
#include "isa.h"

#include <torch/extension.h>

#include <cstdlib>
#include <string>
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The variant the environment variable `variable` names among names[0, count), or `best` where
// it is unset or empty; a name `runs` says this CPU lacks, or no variant's name, is refused.
static int64_t variant_named_by(const char* variable, const char* const* names, int64_t count,
                                int64_t best, bool (*runs)(int64_t)) {
    const char* forced = std::getenv(variable);
    if (forced == nullptr || *forced == '\0') return best;
    std::string choices;
    for (int64_t isa = 0; isa < count; ++isa) {
        if (std::string(forced) == names[isa]) {
            TORCH_CHECK(runs(isa), variable, "=", forced, " is not available on this CPU (best: ",
                        names[best], ")");
            return isa;
        }
        choices += (isa == 0 ? "" : isa + 1 == count ? " or " : ", ") + std::string(names[isa]);
    }
    TORCH_CHECK(false, variable, " must be ", choices, ", got ", forced);
    return best;
}

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

const char* const kFloatIsaNames[] = {"generic", "avx2", "avx512"};

int64_t float_isa() {
    static const int64_t chosen = variant_named_by(
        "SPECSERVE_FLOAT_ISA", kFloatIsaNames, kAvx512 + 1, best_isa(),
        [](int64_t isa) { return isa <= best_isa(); });
    return chosen;
}

int64_t resolve_isa(int64_t isa) {
    if (isa == kAuto) return float_isa();  // per kernel call: no CPUID query on this path
    const int64_t best = best_isa();
    TORCH_CHECK(isa >= kGeneric && isa <= best, "instruction set ", isa,
                " is not available on this CPU (best: ", best, ")");
    return isa;
}

const char* const kInt8IsaNames[] = {"generic", "avx2", "avx-vnni", "avx512-vnni", "amx-int8"};

#if defined(__x86_64__) && defined(__GNUC__)
// AMX-TILE and AMX-INT8 in CPUID (leaf 7: EDX bits 24 and 25; GCC 12's __builtin_cpu_supports
// does not know them), and Linux's leave to use the tile data (XFEATURE_XTILEDATA = 18): without
// it the first tile instruction kills the process. Asked once; the answer holds for every thread.
static bool amx_usable() {
    static const bool usable = [] {
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
        if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
        constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return usable;
}
#endif

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
    if (isa == kIntAmx) return cpu_runs_int8(kIntAvx512Vnni) && amx_usable();
#endif
    return false;
}

int64_t cpu_int8_isa() {
    for (int64_t isa = kIntLast; isa > kIntGeneric; --isa)
        if (cpu_runs_int8(isa)) return isa;
    return kIntGeneric;
}

int64_t int8_isa() {
    static const int64_t chosen = variant_named_by("SPECSERVE_INT8_ISA", kInt8IsaNames,
                                                   kIntLast + 1, cpu_int8_isa(), cpu_runs_int8);
    return chosen;
}

int64_t resolve_int8_isa(int64_t isa) {
    if (isa == kIntAuto) return int8_isa();
    TORCH_CHECK(isa >= kIntGeneric && isa <= kIntLast && cpu_runs_int8(isa),
                "integer variant ", isa, " is not available on this CPU");
    return isa;
}
