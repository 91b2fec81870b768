// Integer matmul for GGUF weights on CPU: y[N, M] = x[N, K] W[M, K]^T with x quantized per row
// into int8 blocks and W repacked in 16-row groups (int8_layout.h), as llama.cpp computes it.
//
// Variants: generic C++, AVX2, AVX-VNNI (256-bit vpdpbusd: Alder Lake and later without
// AVX-512), AVX-512 VNNI and AMX-INT8 tiles (int8_amx_impl.h, for calls of several rows), the best
// the CPU has (isa.cpp) unless SPECSERVE_INT8_ISA (generic, avx2, avx-vnni, avx512-vnni, amx-int8)
// asks for another it runs; all give bitwise the same result. Threads split
// the output columns (16 per group), so each output is computed by one thread in one way.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "int8_layout.h"
#include "isa.h"

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
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define INT8_AVX_VNNI 1
namespace int8_avx_vnni {
#include "int8_kernels_impl.h"
}
#undef INT8_AVX_VNNI
#undef INT8_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#define INT8_ISA 2
namespace int8_avx512vnni {
#include "int8_kernels_impl.h"
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
namespace int8_amx {
#include "int8_kernels_impl.h"
#include "int8_amx_impl.h"
}
#undef INT8_ISA
#pragma GCC pop_options
#endif

namespace {

#include "int8_quantize.h"

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
    const int64_t chosen = resolve_int8_isa(isa);
    const Int8Rows rows = quantize_rows(x, N, K, x_stride, chosen).view();
    const int64_t num_blocks = K / 32, group_bytes = 16 * weights.size(1);
    const uint8_t* w = weights.data_ptr<uint8_t>();
    at::parallel_for(0, M / 16, 4, [&](int64_t begin, int64_t end) {
#ifdef SPECSERVE_HAVE_INT8_X86
        // From int8_amx::kTileMinRows rows a call runs on AMX tiles where the CPU has them (below,
        // the VNNI body is faster); the two give bitwise the same result.
        if (chosen == kIntAmx && N >= int8_amx::kTileMinRows)
            return int8_amx::matmul_groups_amx(type, w, group_bytes, num_blocks, rows, N, y,
                                               y_stride, begin, end);
        if (chosen == kIntAvx512Vnni || chosen == kIntAmx)
            return int8_avx512vnni::matmul_groups(type, w, group_bytes, num_blocks, rows, N, y,
                                                  y_stride, begin, end);
        if (chosen == kIntAvxVnni)
            return int8_avx_vnni::matmul_groups(type, w, group_bytes, num_blocks, rows, N, y,
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
                                               resolve_int8_isa(isa));
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
    m.def("int8_isa", []() { return std::string(kInt8IsaNames[int8_isa()]); },
          "the integer variant this process uses");
    m.def("int8_cpu_isa", &cpu_int8_isa, "the best integer variant of this CPU (0 generic, 1 avx2, "
          "2 avx-vnni, 3 avx512-vnni, 4 amx-int8)");
    m.def("int8_cpu_isas", []() {
        std::vector<int64_t> runs;
        for (int64_t isa = kIntGeneric; isa <= kIntLast; ++isa)
            if (cpu_runs_int8(isa)) runs.push_back(isa);
        return runs;
    }, "every integer variant this CPU runs");
}
