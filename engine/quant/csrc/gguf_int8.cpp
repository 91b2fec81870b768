// Integer matmul for GGUF weights on CPU: y[N, M] = x[N, K] W[M, K]^T with x quantized per row
// into int8 blocks and W repacked in 16-row groups (int8_layout.h), as llama.cpp computes it.
//
// Variants: generic C++, AVX2 and AVX-512 VNNI, the best the CPU has unless SPECSERVE_INT8_ISA
// (generic, avx2, avx512-vnni) asks for a lower one; all give bitwise the same result. Threads
// split the output columns (16 per group), so each output is computed by one thread in one way.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "int8_layout.h"

// The canonical order (int8_layout.h) forbids fusing a multiply into an add.
#pragma GCC optimize("fp-contract=off")

#define INT8_ISA 0
namespace int8_generic {
#include "int8_kernels_impl.h"
}
#undef INT8_ISA

#if defined(__x86_64__) && defined(__GNUC__)
#define SPECSERVE_HAVE_INT8_X86 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define INT8_ISA 1
namespace int8_avx2 {
#include "int8_kernels_impl.h"
}
#undef INT8_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#define INT8_ISA 2
namespace int8_avx512vnni {
#include "int8_kernels_impl.h"
}
#undef INT8_ISA
#pragma GCC pop_options
#endif

namespace {

enum Int8Isa : int64_t { kIntAuto = -1, kIntGeneric = 0, kIntAvx2 = 1, kIntAvx512Vnni = 2 };
const char* const kIsaNames[] = {"generic", "avx2", "avx512-vnni"};

int64_t cpu_int8_isa() {
#ifdef SPECSERVE_HAVE_INT8_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("f16c"))
        return kIntAvx512Vnni;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return kIntAvx2;
#endif
    return kIntGeneric;
}

// The variant this process uses: the CPU's best, or a lower one named by SPECSERVE_INT8_ISA.
// Fixed at the first call, so every step of a process computes the same way.
int64_t int8_isa() {
    static const int64_t chosen = [] {
        const int64_t best = cpu_int8_isa();
        const char* forced = std::getenv("SPECSERVE_INT8_ISA");
        if (forced == nullptr || *forced == '\0') return best;
        for (int64_t isa = kIntGeneric; isa <= kIntAvx512Vnni; ++isa)
            if (std::string(forced) == kIsaNames[isa]) {
                TORCH_CHECK(isa <= best, "SPECSERVE_INT8_ISA=", forced,
                            " is not available on this CPU (best: ", kIsaNames[best], ")");
                return isa;
            }
        TORCH_CHECK(false, "SPECSERVE_INT8_ISA must be generic, avx2 or avx512-vnni, got ", forced);
        return best;
    }();
    return chosen;
}

int64_t resolve(int64_t isa) {
    if (isa == kIntAuto) return int8_isa();
    TORCH_CHECK(isa >= kIntGeneric && isa <= cpu_int8_isa(), "integer variant ", isa,
                " is not available on this CPU");
    return isa;
}

struct QuantizedRows {
    torch::Tensor q, d, s, sum;
    Int8Rows view() const {
        return {q.data_ptr<int8_t>(), q.size(1), d.data_ptr<float>(), s.data_ptr<float>(),
                sum.data_ptr<int32_t>()};
    }
};

// One implementation for every variant: the activations' int8 blocks are part of the result.
QuantizedRows quantize_rows(const torch::Tensor& x) {
    const int64_t N = x.size(0), K = x.size(1), num_blocks = K / 32;
    QuantizedRows out{torch::empty({N, K}, torch::kInt8), torch::empty({N, num_blocks}, torch::kFloat32),
                      torch::empty({N, num_blocks}, torch::kFloat32),
                      torch::empty({N, num_blocks}, torch::kInt32)};
    const float* x_ptr = x.data_ptr<float>();
    int8_t* q = out.q.data_ptr<int8_t>();
    float* d = out.d.data_ptr<float>();
    float* s = out.s.data_ptr<float>();
    int32_t* sum = out.sum.data_ptr<int32_t>();
    const int64_t x_stride = x.stride(0);
    for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < num_blocks; ++b) {
            const float* values = x_ptr + n * x_stride + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(values[i]));
            // As llama.cpp's x86 quantize_row_q8_0/q8_1: the inverse is 127 / max, and the
            // block's scale (and Q8_1's scaled sum) are stored as fp16.
            const float scale = amax / 127.0f;
            const float inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
            int32_t total = 0;
            for (int i = 0; i < 32; ++i) {
                // nearbyint rounds half to even in the default rounding mode, as torch.round.
                const int32_t value = (int32_t)std::nearbyint(values[i] * inverse);
                q[n * K + b * 32 + i] = (int8_t)value;
                total += value;
            }
            d[n * num_blocks + b] = static_cast<float>(c10::Half(scale));
            sum[n * num_blocks + b] = total;
            s[n * num_blocks + b] = static_cast<float>(c10::Half(scale * (float)total));
        }
    return out;
}

}  // namespace

bool is_int8_type(int64_t type) { return type == kQ4_0x16 || type == kQ4_1x16 || type == kQ8_0x16; }

void int8_matmul_out(const torch::Tensor& x, const torch::Tensor& weights, int64_t type,
                     torch::Tensor& out, int64_t isa) {
    TORCH_CHECK(is_int8_type(type), "not a repacked integer type: ", type);
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                    x.stride(1) == 1, "x must be a CPU float32 [N, K] tensor with unit column stride");
    const int64_t N = x.size(0), K = x.size(1), M = weights.size(0);
    const int64_t block_bytes = type == kQ4_0x16 ? 18 : type == kQ4_1x16 ? 20 : 34;
    TORCH_CHECK(weights.scalar_type() == torch::kUInt8 && weights.dim() == 2 && weights.is_contiguous() &&
                    M % 16 == 0 && K % 32 == 0 && weights.size(1) == K / 32 * block_bytes,
                "repacked weights must be a contiguous uint8 [M, K / 32 * ", block_bytes,
                "] tensor with M a multiple of 16");
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2 && out.stride(1) == 1 &&
                    out.size(0) == N && out.size(1) == M, "out must be a float32 [N, M] tensor with unit column stride");
    if (N == 0 || M == 0) return;
    const QuantizedRows quantized = quantize_rows(x);
    const Int8Rows rows = quantized.view();
    const int64_t chosen = resolve(isa), num_blocks = K / 32, group_bytes = 16 * weights.size(1);
    const uint8_t* w = weights.data_ptr<uint8_t>();
    float* y = out.data_ptr<float>();
    const int64_t y_stride = out.stride(0);
    at::parallel_for(0, M / 16, 4, [&](int64_t begin, int64_t end) {
#ifdef SPECSERVE_HAVE_INT8_X86
        if (chosen == kIntAvx512Vnni)
            return int8_avx512vnni::matmul_groups(type, w, group_bytes, num_blocks, rows, N, y,
                                                  y_stride, begin, end);
        if (chosen == kIntAvx2)
            return int8_avx2::matmul_groups(type, w, group_bytes, num_blocks, rows, N, y, y_stride,
                                            begin, end);
#endif
        int8_generic::matmul_groups(type, w, group_bytes, num_blocks, rows, N, y, y_stride, begin, end);
    });
}

void register_int8_ops(pybind11::module& m) {
    m.def("int8_quantize_rows", [](const torch::Tensor& x) {
        TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 &&
                        x.size(1) % 32 == 0, "x must be float32 [N, K], K a multiple of 32");
        const QuantizedRows r = quantize_rows(x);
        return std::make_tuple(r.q, r.d, r.s, r.sum);
    }, "activation rows as int8 blocks: (q, d, s, sum)", py::arg("x"));
    m.def("int8_matmul_out", &int8_matmul_out, py::call_guard<py::gil_scoped_release>(),
          "out = x @ W^T on the integer path", py::arg("x"), py::arg("weights"), py::arg("type"),
          py::arg("out"), py::arg("isa") = -1);
    m.def("int8_isa", []() { return std::string(kIsaNames[int8_isa()]); },
          "the integer variant this process uses");
    m.def("int8_cpu_isa", &cpu_int8_isa, "the best integer variant of this CPU (0, 1, 2)");
}
