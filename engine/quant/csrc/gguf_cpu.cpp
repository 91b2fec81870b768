// Weight-only matrix multiplication with GGUF block-quantized weights on CPU.
//
// y[N, M] = x[N, K] W[M, K]^T with x and y float32 and W kept packed as GGUF stores it (one row of
// K weights = K / block_size blocks). Each tile of weight rows is dequantized once into a small
// float buffer that stays in L1 and is then multiplied with all N activation rows, so a decode
// step (N = 1), a batch of decodes and a verification of K + 1 draft positions (N up to 64) all
// stream each weight block from memory once. Accumulation is float32: the result equals
// dequantize(W) @ x up to float32 summation order.
//
// The same body (gguf_kernels_impl.h) is compiled three times, for AVX-512, AVX2+FMA and plain
// x86-64 / any other CPU, and isa.cpp picks the widest one the CPU supports at run time. Threads come
// from ATen's intra-op pool (OpenMP in torch's CPU builds), so torch.set_num_threads applies.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <cstring>
#include <vector>

#include "isa.h"
#include "vec_ops.h"

namespace {

// GGML type ids, as GGUF files store them.
constexpr int kQ4_0 = 2;
constexpr int kQ4_1 = 3;
constexpr int kQ8_0 = 8;
constexpr int kQ4_K = 12;
constexpr int kQ6_K = 14;
constexpr int kTile = 4;  // weight rows dequantized together (the dequantize-then-multiply path)
constexpr int kFusedRows = 8;  // activation rows one pass of the fused path serves
// Up to this many activation rows the fused path is faster (measured: benchmarks/kernel_rows.py);
// above it dequantizing each weight once into L1 and reusing it for every row wins.
constexpr int64_t kFusedMaxRows = 8;
// From this many activation rows (prefill chunks, large batches) the weight is dequantized to a
// float32 scratch matrix once and multiplied by torch's GEMM (MKL / oneDNN), whose blocking our
// row-tile loop cannot match at that size.
constexpr int64_t kGemmMinRows = 48;

struct BlockFormat {
    int64_t block_size;   // weights per block
    int64_t block_bytes;  // bytes per block
};

BlockFormat block_format(int64_t type) {
    switch (type) {
        case kQ4_0: return {32, 18};
        case kQ4_1: return {32, 20};
        case kQ8_0: return {32, 34};
        case kQ4_K: return {256, 144};
        case kQ6_K: return {256, 210};
    }
    TORCH_CHECK(false, "no CPU kernel for GGML type ", type);
}

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define GGUF_KERNEL_X86_SIMD 1
namespace isa_avx512 {
#include "gguf_kernels_impl.h"
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#include "gguf_kernels_impl.h"
}
#undef GGUF_KERNEL_X86_SIMD
#pragma GCC pop_options
#define SPECSERVE_HAVE_X86_VARIANTS 1
#endif

namespace isa_generic {
#include "gguf_kernels_impl.h"
}

namespace {

void check_packed(const torch::Tensor& packed, int64_t type, int64_t in_features,
                  BlockFormat* format) {
    TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 &&
                    packed.dim() == 2 && packed.stride(1) == 1,
                "packed weights must be a CPU uint8 [rows, row_bytes] tensor with unit column "
                "stride");
    *format = block_format(type);
    TORCH_CHECK(in_features % format->block_size == 0, "in_features ", in_features,
                " is not a multiple of the block size ", format->block_size);
    TORCH_CHECK(packed.size(1) == in_features / format->block_size * format->block_bytes,
                "packed rows hold ", packed.size(1), " bytes, expected ",
                in_features / format->block_size * format->block_bytes);
}

}  // namespace

// out[N, M] = x[N, K] @ dequantize(packed)^T. `out` may be a column slice of a wider tensor (its
// row stride is honoured), so projections fused from parts of different types share one output.
torch::Tensor gguf_dequantize(const torch::Tensor& packed, int64_t type, int64_t in_features,
                              int64_t isa);

// Wall time spent in matmul_out, for benchmarks/step_breakdown.py (two clock reads a call).
std::atomic<int64_t> g_matmul_ns{0};
std::atomic<int64_t> g_matmul_calls{0};

struct MatmulTimer {
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~MatmulTimer() {
        g_matmul_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - start).count();
        ++g_matmul_calls;
    }
};

// y[N, M] (row stride y_stride) = x[N, K] (row stride x_stride) @ dequantize(packed)^T: the
// raw-pointer form the fused decoder stack calls; every other entry point goes through it.
void gguf_matmul_rows(const float* x_ptr, int64_t N, int64_t K, int64_t x_stride,
                      const torch::Tensor& packed, int64_t type, float* out_ptr, int64_t y_stride,
                      int64_t isa) {
    MatmulTimer timer;
    if (is_int8_type(type))
        return int8_matmul_rows(x_ptr, N, K, x_stride, packed, type, out_ptr, y_stride, kAuto);
    BlockFormat format;
    check_packed(packed, type, K, &format);
    const int64_t M = packed.size(0), num_blocks = K / format.block_size;
    if (N == 0 || M == 0) return;
    const int64_t chosen = resolve_isa(isa);
    if (N >= kGemmMinRows) {
        const auto weight = gguf_dequantize(packed, type, K, chosen);  // [M, K]
        auto out = torch::from_blob(out_ptr, {N, M}, {y_stride, 1}, weight.options());
        at::mm_out(out, torch::from_blob((void*)x_ptr, {N, K}, {x_stride, 1}, weight.options()),
                   weight.t());
        return;
    }
    const uint8_t* packed_ptr = packed.data_ptr<uint8_t>();
    const int64_t row_bytes = packed.stride(0);
    const int t = (int)type;
    const bool fused = chosen != kGeneric && N <= kFusedMaxRows &&
#ifdef SPECSERVE_HAVE_X86_VARIANTS
                       isa_avx2::fused_supported(t);
#else
                       false;
#endif
    if (fused) {
        // Sums of x over each 32-weight block, for the blocks' offsets (w = scale * q + offset).
        // (A plain loop: a torch reduction here costs more than the kernel for small matrices.)
        std::vector<float> x_block_sums(N * (K / 32));  // [N, K / 32]
        for (int64_t n = 0; n < N; ++n)
            for (int64_t b = 0; b < K / 32; ++b) {
                float sum = 0.0f;
                for (int i = 0; i < 32; ++i) sum += x_ptr[n * x_stride + b * 32 + i];
                x_block_sums[n * (K / 32) + b] = sum;
            }
        const float* sums_ptr = x_block_sums.data();
        at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
#ifdef SPECSERVE_HAVE_X86_VARIANTS
            if (chosen == kAvx512)
                return isa_avx512::fused_range(t, packed_ptr, row_bytes, K, x_ptr, x_stride,
                                               sums_ptr, N, out_ptr, y_stride, begin, end);
            isa_avx2::fused_range(t, packed_ptr, row_bytes, K, x_ptr, x_stride, sums_ptr, N,
                                  out_ptr, y_stride, begin, end);
#endif
        });
        return;
    }
    const int64_t num_tiles = (M + kTile - 1) / kTile;
    at::parallel_for(0, num_tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
        std::vector<float> scratch(kTile * K);
        const int64_t begin = tile_begin * kTile, end = std::min(tile_end * kTile, M);
#ifdef SPECSERVE_HAVE_X86_VARIANTS
        if (chosen == kAvx512)
            return isa_avx512::matmul_range(t, packed_ptr, row_bytes, K, num_blocks, x_ptr, x_stride,
                                            N, out_ptr, y_stride, begin, end, scratch.data());
        if (chosen == kAvx2)
            return isa_avx2::matmul_range(t, packed_ptr, row_bytes, K, num_blocks, x_ptr, x_stride,
                                          N, out_ptr, y_stride, begin, end, scratch.data());
#endif
        isa_generic::matmul_range(t, packed_ptr, row_bytes, K, num_blocks, x_ptr, x_stride, N,
                                  out_ptr, y_stride, begin, end, scratch.data());
    });
}

void gguf_matmul_out(const torch::Tensor& x, const torch::Tensor& packed, int64_t type,
                     torch::Tensor& out, int64_t isa) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                    x.stride(1) == 1,
                "x must be a CPU float32 [N, K] tensor with unit column stride");
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2 && out.stride(1) == 1 &&
                    out.size(0) == x.size(0) && out.size(1) == packed.size(0),
                "out must be a float32 [N, M] tensor with unit column stride");
    gguf_matmul_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), packed, type,
                     out.data_ptr<float>(), out.stride(0), isa);
}

// x [..., K] @ dequantize(packed)^T -> [..., M]: the one-call form a projection stored in a
// single format uses (every Python-side tensor op costs microseconds at batch 1).
torch::Tensor gguf_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t type) {
    const auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
    auto out = torch::empty({x2.size(0), packed.size(0)}, x.options());
    gguf_matmul_out(x2, packed, type, out, kAuto);
    auto shape = x.sizes().vec();
    shape.back() = packed.size(0);
    return out.view(shape);
}

// The float32 [rows, in_features] matrix a packed one stands for (tests, embeddings).
torch::Tensor gguf_dequantize(const torch::Tensor& packed, int64_t type, int64_t in_features,
                              int64_t isa) {
    BlockFormat format;
    check_packed(packed, type, in_features, &format);
    const int64_t M = packed.size(0), num_blocks = in_features / format.block_size;
    auto out = torch::empty({M, in_features}, torch::kFloat32);
    const int64_t chosen = resolve_isa(isa);
    const uint8_t* packed_ptr = packed.data_ptr<uint8_t>();
    float* out_ptr = out.data_ptr<float>();
    const int64_t row_bytes = packed.stride(0);
    const int t = (int)type;
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
#ifdef SPECSERVE_HAVE_X86_VARIANTS
        if (chosen == kAvx512)
            return isa_avx512::dequantize_range(t, packed_ptr, row_bytes, in_features, num_blocks,
                                                out_ptr, begin, end);
        if (chosen == kAvx2)
            return isa_avx2::dequantize_range(t, packed_ptr, row_bytes, in_features, num_blocks,
                                              out_ptr, begin, end);
#endif
        isa_generic::dequantize_range(t, packed_ptr, row_bytes, in_features, num_blocks, out_ptr,
                                      begin, end);
    });
    return out;
}

void register_gguf_ops(pybind11::module& m) {
    m.def("matmul_out", &gguf_matmul_out, py::call_guard<py::gil_scoped_release>(), "out = x @ dequantize(packed)^T", py::arg("x"),
          py::arg("packed"), py::arg("type"), py::arg("out"), py::arg("isa") = -1);
    m.def("matmul", &gguf_matmul, py::call_guard<py::gil_scoped_release>(), "x @ dequantize(packed)^T", py::arg("x"), py::arg("packed"),
          py::arg("type"));
    m.def("dequantize", &gguf_dequantize, py::call_guard<py::gil_scoped_release>(), "dequantize(packed) as float32", py::arg("packed"),
          py::arg("type"), py::arg("in_features"), py::arg("isa") = -1);
    m.def("best_isa", &best_isa, "0 generic, 1 AVX2+FMA, 2 AVX-512");
    m.def("matmul_time", []() {
        return std::make_pair(g_matmul_calls.load(), g_matmul_ns.load() * 1e-9);
    }, "(calls, seconds) spent in matmul so far, process-wide");
}
