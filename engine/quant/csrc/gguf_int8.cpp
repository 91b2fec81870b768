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
#include <vector>
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

// Activation rows quantized per 32-value block (Int8Rows), in buffers a thread keeps from call
// to call: a decode step quantizes ~120 activation rows, and allocating four tensors for each
// cost more than the quantization.
struct QuantizedRows {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> sum;
    int64_t K = 0;
    Int8Rows view() const { return {q.data(), K, d.data(), s.data(), sum.data()}; }
};

// As llama.cpp's x86 quantize_row_q8_0/q8_1: the inverse is 127 / max, q rounds half to even,
// and the block's scale (and Q8_1's scaled sum) are stored as fp16.
static inline void finish_block(float amax, int32_t total, float* d, float* s) {
    const float scale = amax / 127.0f;
    *d = static_cast<float>(c10::Half(scale));
    *s = static_cast<float>(c10::Half(scale * (float)total));
}

static inline float block_inverse(float amax) { return amax != 0.0f ? 127.0f / amax : 0.0f; }

static void quantize_block_generic(const float* values, int8_t* q, float* d, float* s,
                                   int32_t* sum) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(values[i]));
    const float inverse = block_inverse(amax);
    int32_t total = 0;
    for (int i = 0; i < 32; ++i) {
        // nearbyint rounds half to even in the default rounding mode, as torch.round.
        const int32_t value = (int32_t)std::nearbyint(values[i] * inverse);
        q[i] = (int8_t)value;
        total += value;
    }
    *sum = total;
    finish_block(amax, total, d, s);
}

#ifdef SPECSERVE_HAVE_INT8_X86
// The same block in AVX2, bitwise: max is exact in any order, the product is one rounding, and
// _MM_FROUND_TO_NEAREST_INT rounds half to even as nearbyint does (|q| <= 127: no saturation).
__attribute__((target("avx2,fma,f16c"))) static void quantize_block_avx2(
        const float* values, int8_t* q, float* d, float* s, int32_t* sum) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4], vmax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(values + 8 * i);
        vmax = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), vmax);  // a NaN is skipped, as std::max
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inverse = _mm256_set1_ps(block_inverse(amax));
    __m256i ints[4];
    for (int i = 0; i < 4; ++i)
        ints[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inverse),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i total8 = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]),
                                            _mm256_add_epi32(ints[2], ints[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total8), _mm256_extracti128_si256(total8, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    // packs work within 128-bit lanes: bytes come out as 4-value runs 0,2,4,6,1,3,5,7 of 8.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                             _mm256_packs_epi32(ints[2], ints[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(
                                         bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *sum = _mm_cvtsi128_si32(t4);
    finish_block(amax, *sum, d, s);
}
#endif

// Into this thread's buffers; the same bits for every variant.
const QuantizedRows& quantize_rows(const float* x_ptr, int64_t N, int64_t K, int64_t x_stride,
                                   int64_t isa) {
    thread_local QuantizedRows out;
    const int64_t num_blocks = K / 32;
    out.K = K;
    out.q.resize(N * K);
    out.d.resize(N * num_blocks);
    out.s.resize(N * num_blocks);
    out.sum.resize(N * num_blocks);
    auto quantize_block = quantize_block_generic;
#ifdef SPECSERVE_HAVE_INT8_X86
    if (isa >= kIntAvx2) quantize_block = quantize_block_avx2;
#endif
    for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < num_blocks; ++b) {
            const int64_t i = n * num_blocks + b;
            quantize_block(x_ptr + n * x_stride + b * 32, out.q.data() + n * K + b * 32,
                           &out.d[i], &out.s[i], &out.sum[i]);
        }
    return out;
}

}  // namespace

bool is_int8_type(int64_t type) { return type == kQ4_0x16 || type == kQ4_1x16 || type == kQ8_0x16; }

// y[N, M] (row stride y_stride) = x[N, K] (row stride x_stride) @ W^T on the integer path.
void int8_matmul_rows(const float* x, int64_t N, int64_t K, int64_t x_stride,
                      const torch::Tensor& weights, int64_t type, float* y, int64_t y_stride,
                      int64_t isa) {
    TORCH_CHECK(is_int8_type(type), "not a repacked integer type: ", type);
    const int64_t M = weights.size(0);
    const int64_t block_bytes = type == kQ4_0x16 ? 18 : type == kQ4_1x16 ? 20 : 34;
    TORCH_CHECK(weights.scalar_type() == torch::kUInt8 && weights.dim() == 2 && weights.is_contiguous() &&
                    M % 16 == 0 && K % 32 == 0 && weights.size(1) == K / 32 * block_bytes,
                "repacked weights must be a contiguous uint8 [M, K / 32 * ", block_bytes,
                "] tensor with M a multiple of 16");
    if (N == 0 || M == 0) return;
    const int64_t chosen = resolve(isa);
    const Int8Rows rows = quantize_rows(x, N, K, x_stride, chosen).view();
    const int64_t num_blocks = K / 32, group_bytes = 16 * weights.size(1);
    const uint8_t* w = weights.data_ptr<uint8_t>();
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

void int8_matmul_out(const torch::Tensor& x, const torch::Tensor& weights, int64_t type,
                     torch::Tensor& out, int64_t isa) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                    x.stride(1) == 1, "x must be a CPU float32 [N, K] tensor with unit column stride");
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2 && out.stride(1) == 1 &&
                    out.size(0) == x.size(0) && out.size(1) == weights.size(0),
                "out must be a float32 [N, M] tensor with unit column stride");
    int8_matmul_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), weights, type,
                     out.data_ptr<float>(), out.stride(0), isa);
}

// GGUF rows `ids` [n] of a repacked weight, [n, row_bytes] uint8: the inverse of the 16-row
// repacking (int8_layout.h; engine/quant/int8.py `unpack_rows` is the torch reference), one row at
// a time. The embedding lookup of a tied vocabulary matrix: one call instead of ~20 tensor ops.
torch::Tensor int8_unpack_rows(const torch::Tensor& weights, int64_t type, const torch::Tensor& ids) {
    TORCH_CHECK(is_int8_type(type), "not a repacked integer type: ", type);
    TORCH_CHECK(weights.scalar_type() == torch::kUInt8 && weights.dim() == 2 &&
                    weights.is_contiguous() && weights.size(0) % 16 == 0,
                "repacked weights must be a contiguous uint8 [M, row_bytes] tensor, M % 16 == 0");
    TORCH_CHECK(ids.scalar_type() == torch::kLong, "ids must be int64");
    const auto flat = ids.reshape({-1}).contiguous();
    const int64_t n = flat.numel(), M = weights.size(0), row_bytes = weights.size(1);
    const int64_t block_bytes = type == kQ4_0x16 ? 18 : type == kQ4_1x16 ? 20 : 34;
    const int64_t scale_bytes = type == kQ4_1x16 ? 4 : 2;  // fp16 d (and m) per row and block
    const int64_t chunks = (block_bytes - scale_bytes) / 4;  // 4-byte quant chunks per block
    TORCH_CHECK(row_bytes % block_bytes == 0, "row_bytes is not a whole number of blocks");
    auto out = torch::empty({n, row_bytes}, weights.options());
    const uint8_t* w = weights.data_ptr<uint8_t>();
    const int64_t* id = flat.data_ptr<int64_t>();
    uint8_t* o = out.data_ptr<uint8_t>();
    for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK(id[i] >= 0 && id[i] < M, "row ", id[i], " out of range for ", M, " rows");
        const int64_t r = id[i] % 16;
        const uint8_t* group = w + (id[i] - r) * row_bytes;
        for (int64_t b = 0; b < row_bytes / block_bytes; ++b) {
            const uint8_t* src = group + b * 16 * block_bytes;
            uint8_t* dst = o + i * row_bytes + b * block_bytes;
            for (int64_t f = 0; f < scale_bytes / 2; ++f)  // d[16], then (Q4_1) m[16]
                std::memcpy(dst + 2 * f, src + 32 * f + 2 * r, 2);
            for (int64_t c = 0; c < chunks; ++c)
                std::memcpy(dst + scale_bytes + 4 * c, src + 16 * scale_bytes + 64 * c + 4 * r, 4);
        }
    }
    return out;
}

void register_int8_ops(pybind11::module& m) {
    m.def("int8_unpack_rows", &int8_unpack_rows, py::call_guard<py::gil_scoped_release>(),
          "GGUF rows `ids` of a repacked weight", py::arg("weights"), py::arg("type"),
          py::arg("ids"));
    m.def("int8_quantize_rows", [](const torch::Tensor& x, int64_t isa) {
        TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 &&
                        x.size(1) % 32 == 0, "x must be float32 [N, K], K a multiple of 32");
        const int64_t N = x.size(0), num_blocks = x.size(1) / 32;
        const QuantizedRows& r = quantize_rows(x.data_ptr<float>(), N, x.size(1), x.stride(0),
                                               resolve(isa));
        auto copy = [](const auto& values, auto dtype, std::vector<int64_t> shape) {
            return torch::from_blob((void*)values.data(), shape, dtype).clone();
        };
        return std::make_tuple(copy(r.q, torch::kInt8, {N, x.size(1)}),
                               copy(r.d, torch::kFloat32, {N, num_blocks}),
                               copy(r.s, torch::kFloat32, {N, num_blocks}),
                               copy(r.sum, torch::kInt32, {N, num_blocks}));
    }, "activation rows as int8 blocks: (q, d, s, sum)", py::arg("x"), py::arg("isa") = -1);
    m.def("int8_matmul_out", &int8_matmul_out, py::call_guard<py::gil_scoped_release>(),
          "out = x @ W^T on the integer path", py::arg("x"), py::arg("weights"), py::arg("type"),
          py::arg("out"), py::arg("isa") = -1);
    m.def("int8_isa", []() { return std::string(kIsaNames[int8_isa()]); },
          "the integer variant this process uses");
    m.def("int8_cpu_isa", &cpu_int8_isa, "the best integer variant of this CPU (0, 1, 2)");
}
