// The body of the GGUF CPU kernels, included several times by gguf_cpu.cpp: once per instruction
// set, each time inside its own namespace and under its own `#pragma GCC target`. Where
// GGUF_KERNEL_X86_SIMD is defined (the AVX2 and AVX-512 regions) the hot loops are AVX2
// intrinsics; elsewhere plain C++. Include no system headers here: an #include inside a namespace
// would put the standard library in that namespace.
//
//   gguf_blocks.h  the block formats decoded (scalar and SIMD)
//   gguf_fused.h   the fused path: raw quantized values widened in registers, for <= 8 rows
//   below          the tile path (dequantize a tile of rows into L1, multiply every row), the
//                  entry points gguf_cpu.cpp calls, and small vector primitives
#include "gguf_blocks.h"

#ifdef GGUF_KERNEL_X86_SIMD
#include "gguf_fused.h"
#define DEQUANT_Q4_0 simd_q4_0
#define DEQUANT_Q4_1 simd_q4_1
#define DEQUANT_Q8_0 simd_q8_0
#define DEQUANT_Q4_K simd_q4_k
#else
#define DEQUANT_Q4_0 dequant_q4_0
#define DEQUANT_Q4_1 dequant_q4_1
#define DEQUANT_Q8_0 dequant_q8_0
#define DEQUANT_Q4_K dequant_q4_k
#endif

// Dequantizes one packed row of `num_blocks` blocks into `out`.
template <int TYPE>
static inline void dequant_row(const uint8_t* row, int64_t num_blocks, float* out) {
    for (int64_t b = 0; b < num_blocks; ++b) {
        if (TYPE == kQ4_0) DEQUANT_Q4_0(row + b * 18, out + b * 32);
        if (TYPE == kQ4_1) DEQUANT_Q4_1(row + b * 20, out + b * 32);
        if (TYPE == kQ8_0) DEQUANT_Q8_0(row + b * 34, out + b * 32);
        if (TYPE == kQ4_K) DEQUANT_Q4_K(row + b * 144, out + b * 256);
        if (TYPE == kQ6_K) dequant_q6_k(row + b * 210, out + b * 256);
    }
}

// y[n, j] = dot(w[j, :], x[n, :]) for the ROWS weight rows of one tile (dequantized, [ROWS, K],
// K a multiple of 16) and every activation row n. Each weight row meets each activation row from
// L1; the accumulators stay in registers.
#ifdef GGUF_KERNEL_X86_SIMD
// Two activation rows at a time against ROWS weight rows: 2 * ROWS accumulators, each x load
// used ROWS times and each w load twice.
template <int ROWS>
static inline void dot_rows(const float* w, int64_t K, const float* x, int64_t x_stride,
                            int64_t N, float* y, int64_t y_stride) {
    int64_t n = 0;
    for (; n + 2 <= N; n += 2) {
        const float* x0 = x + n * x_stride;
        const float* x1 = x0 + x_stride;
        __m256 acc0[ROWS], acc1[ROWS];
        for (int j = 0; j < ROWS; ++j) acc0[j] = acc1[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 a = _mm256_loadu_ps(x0 + k), b = _mm256_loadu_ps(x1 + k);
            for (int j = 0; j < ROWS; ++j) {
                const __m256 wj = _mm256_loadu_ps(w + j * K + k);
                acc0[j] = _mm256_fmadd_ps(wj, a, acc0[j]);
                acc1[j] = _mm256_fmadd_ps(wj, b, acc1[j]);
            }
        }
        for (int j = 0; j < ROWS; ++j) {
            y[n * y_stride + j] = hsum(acc0[j]);
            y[(n + 1) * y_stride + j] = hsum(acc1[j]);
        }
    }
    if (n < N) {  // the last odd row: two accumulators per weight row hide the FMA latency
        const float* x0 = x + n * x_stride;
        __m256 acc0[ROWS], acc1[ROWS];
        for (int j = 0; j < ROWS; ++j) acc0[j] = acc1[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            const __m256 a = _mm256_loadu_ps(x0 + k), b = _mm256_loadu_ps(x0 + k + 8);
            for (int j = 0; j < ROWS; ++j) {
                acc0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + j * K + k), a, acc0[j]);
                acc1[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + j * K + k + 8), b, acc1[j]);
            }
        }
        for (int j = 0; j < ROWS; ++j) y[n * y_stride + j] = hsum(_mm256_add_ps(acc0[j], acc1[j]));
    }
}
#else
template <int ROWS>
static inline void dot_rows(const float* w, int64_t K, const float* x, int64_t x_stride,
                            int64_t N, float* y, int64_t y_stride) {
    for (int64_t n = 0; n < N; ++n) {
        const float* xn = x + n * x_stride;
        float acc[ROWS][16];
        for (int j = 0; j < ROWS; ++j)
            for (int l = 0; l < 16; ++l) acc[j][l] = 0.0f;
        for (int64_t k = 0; k < K; k += 16) {
            for (int j = 0; j < ROWS; ++j) {
                const float* wj = w + j * K + k;
                for (int l = 0; l < 16; ++l) acc[j][l] += wj[l] * xn[k + l];
            }
        }
        for (int j = 0; j < ROWS; ++j) {
            float sum = 0.0f;
            for (int l = 0; l < 16; ++l) sum += acc[j][l];
            y[n * y_stride + j] = sum;
        }
    }
}
#endif

// Output rows [row_begin, row_end) of y = x W^T: dequantize a tile of weight rows into `scratch`
// (TILE * K floats), then multiply it with all N activation rows. Every weight block is read
// from memory once per call, whatever N is.
template <int TYPE>
static void matmul_rows(const uint8_t* packed, int64_t row_bytes, int64_t K, int64_t num_blocks,
                        const float* x, int64_t x_stride, int64_t N, float* y, int64_t y_stride,
                        int64_t row_begin, int64_t row_end, float* scratch) {
    int64_t r = row_begin;
    for (; r + kTile <= row_end; r += kTile) {
        for (int j = 0; j < kTile; ++j)
            dequant_row<TYPE>(packed + (r + j) * row_bytes, num_blocks, scratch + j * K);
        dot_rows<kTile>(scratch, K, x, x_stride, N, y + r, y_stride);
    }
    for (; r < row_end; ++r) {
        dequant_row<TYPE>(packed + r * row_bytes, num_blocks, scratch);
        dot_rows<1>(scratch, K, x, x_stride, N, y + r, y_stride);
    }
}

static void matmul_range(int type, const uint8_t* packed, int64_t row_bytes, int64_t K,
                         int64_t num_blocks, const float* x, int64_t x_stride, int64_t N, float* y,
                         int64_t y_stride, int64_t row_begin, int64_t row_end, float* scratch) {
    switch (type) {
        case kQ4_0: return matmul_rows<kQ4_0>(packed, row_bytes, K, num_blocks, x, x_stride, N, y,
                                              y_stride, row_begin, row_end, scratch);
        case kQ4_1: return matmul_rows<kQ4_1>(packed, row_bytes, K, num_blocks, x, x_stride, N, y,
                                              y_stride, row_begin, row_end, scratch);
        case kQ8_0: return matmul_rows<kQ8_0>(packed, row_bytes, K, num_blocks, x, x_stride, N, y,
                                              y_stride, row_begin, row_end, scratch);
        case kQ4_K: return matmul_rows<kQ4_K>(packed, row_bytes, K, num_blocks, x, x_stride, N, y,
                                              y_stride, row_begin, row_end, scratch);
        case kQ6_K: return matmul_rows<kQ6_K>(packed, row_bytes, K, num_blocks, x, x_stride, N, y,
                                              y_stride, row_begin, row_end, scratch);
    }
}

static void dequantize_range(int type, const uint8_t* packed, int64_t row_bytes, int64_t K,
                             int64_t num_blocks, float* out, int64_t row_begin, int64_t row_end) {
    for (int64_t r = row_begin; r < row_end; ++r) {
        const uint8_t* row = packed + r * row_bytes;
        float* dst = out + r * K;
        switch (type) {
            case kQ4_0: dequant_row<kQ4_0>(row, num_blocks, dst); break;
            case kQ4_1: dequant_row<kQ4_1>(row, num_blocks, dst); break;
            case kQ8_0: dequant_row<kQ8_0>(row, num_blocks, dst); break;
            case kQ4_K: dequant_row<kQ4_K>(row, num_blocks, dst); break;
            case kQ6_K: dequant_row<kQ6_K>(row, num_blocks, dst); break;
        }
    }
}

#undef DEQUANT_Q4_0
#undef DEQUANT_Q4_1
#undef DEQUANT_Q8_0
#undef DEQUANT_Q4_K

#ifndef GGUF_KERNEL_X86_SIMD
static bool fused_supported(int) { return false; }
static void fused_range(int, const uint8_t*, int64_t, int64_t, const float*, int64_t,
                        const float*, int64_t, float*, int64_t, int64_t, int64_t) {}
#endif
