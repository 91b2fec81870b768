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

// The attention of one query row's GQA group of heads over one KV head (cpu_ops.cpp's paged
// attention calls this once per row and KV head). Each key and value is loaded once for the
// whole group, and the inner loops are inlined here, compiled for this instruction set: one
// call per (key, head) through a function pointer cost more than the arithmetic at D = 64.
//   q: `group` query heads, D floats each, contiguous; out: the same shape.
//   key p lives at slot table[p / block_size] * block_size + p % block_size of k_base/v_base,
//   whose slots are slot_stride floats apart. scores: scratch of group * num_keys floats.
static inline float dot_inline(const float* a, const float* b, int64_t n) {
#ifdef GGUF_KERNEL_X86_SIMD
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float sum = hsum(_mm256_add_ps(acc0, acc1));
#else
    float sum = 0.0f;
    int64_t i = 0;
#endif
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

static inline void axpy_inline(float alpha, const float* x, float* y, int64_t n) {  // y += alpha x
    int64_t i = 0;
#ifdef GGUF_KERNEL_X86_SIMD
    const __m256 a = _mm256_set1_ps(alpha);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; ++i) y[i] += alpha * x[i];
}

static void attend_group(const float* q, int64_t group, int64_t D, float scale,
                         const float* k_base, const float* v_base, const int64_t* table,
                         int64_t block_size, int64_t slot_stride, int64_t num_keys,
                         float* scores, float* out) {
    for (int64_t p = 0; p < num_keys; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const float* k = k_base + slot * slot_stride;
        for (int64_t g = 0; g < group; ++g)
            scores[g * num_keys + p] = dot_inline(q + g * D, k, D) * scale;
    }
    for (int64_t g = 0; g < group; ++g) {  // softmax over the keys, normalized before the sum
        float* s = scores + g * num_keys;
        float max_score = s[0];
        for (int64_t p = 1; p < num_keys; ++p) max_score = s[p] > max_score ? s[p] : max_score;
        float total = 0.0f;
        for (int64_t p = 0; p < num_keys; ++p) {
            s[p] = std::exp(s[p] - max_score);
            total += s[p];
        }
        const float inv = 1.0f / total;
        for (int64_t p = 0; p < num_keys; ++p) s[p] *= inv;
        for (int64_t d = 0; d < D; ++d) out[g * D + d] = 0.0f;
    }
    for (int64_t p = 0; p < num_keys; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const float* v = v_base + slot * slot_stride;
        for (int64_t g = 0; g < group; ++g)
            axpy_inline(scores[g * num_keys + p], v, out + g * D, D);
    }
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i]. The AVX2 path computes
// exp by range reduction, exp(x) = 2^n exp(r) with |r| <= ln(2) / 2, and a degree-6 Taylor
// polynomial for exp(r) (truncation error < 2e-7 relative, below float32's own rounding of
// the result's neighbours): one scalar libm exp per element cost ~0.5 ms of a decode step.
#ifdef GGUF_KERNEL_X86_SIMD
static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln 2, high bits
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);     // ln 2, the rest
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

static void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
    int64_t i = 0;
#ifdef GGUF_KERNEL_X86_SIMD
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp_avx2(_mm256_sub_ps(zero, g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}
