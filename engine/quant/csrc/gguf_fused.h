// The fused path of the kernel body for up to 8 activation rows (see gguf_kernels_impl.h:
// included once per instruction set inside a namespace, so no include guard and no #include).

// The fused path for a few activation rows. Per block, w = scale * q + offset, so
//   sum_i w_i x_i = scale * sum_i q_i x_i + offset * sum_i x_i,
// with sum_i x_i per 32-weight block precomputed once per call (`x_block_sums`). The raw q of a
// block are widened to float in registers and never stored: fewer instructions per weight than
// dequantizing first, which is what bounds a decode step once the weights are 4-bit.

// 8 bytes -> 8 int32 lanes -> the low nibbles (lo) and the high nibbles (hi) as floats.
static inline void nibbles8(const uint8_t* p, __m256* lo, __m256* hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

static inline __m256 int8x8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// One unit of a row: SUBS sub-blocks of 32 weights each as 4 vectors of raw q (weight order),
// with each sub-block's scale and offset.
template <int TYPE>
struct Unit {
    static constexpr int SUBS = TYPE == kQ4_K ? 2 : 1;
    static constexpr bool HAS_OFFSET = TYPE != kQ8_0;
    static constexpr int64_t BYTES = TYPE == kQ4_0 ? 18 : TYPE == kQ4_1 ? 20 : TYPE == kQ8_0 ? 34
                                                                              : 144;
    static inline const uint8_t* at(const uint8_t* row, int64_t u) {
        return TYPE == kQ4_K ? row + (u / 4) * 144 : row + u * BYTES;
    }
    static inline void load(const uint8_t* row, int64_t u, __m256 q[8], float scale[2],
                            float offset[2]) {
        const uint8_t* b = at(row, u);
        if (TYPE == kQ8_0) {
            scale[0] = fp16_to_float(read_u16(b));
            for (int i = 0; i < 4; ++i) q[i] = int8x8(b + 2 + 8 * i);
        } else if (TYPE == kQ4_0 || TYPE == kQ4_1) {
            const float d = fp16_to_float(read_u16(b));
            scale[0] = d;
            offset[0] = TYPE == kQ4_0 ? -8.0f * d : fp16_to_float(read_u16(b + 2));
            const uint8_t* qs = b + (TYPE == kQ4_0 ? 2 : 4);
            nibbles8(qs, &q[0], &q[2]);
            nibbles8(qs + 8, &q[1], &q[3]);
        } else {  // Q4_K: unit j of 4 = 32 bytes, low nibbles sub-block 2j, high ones 2j+1
            const int j = (int)(u % 4);
            const float d = fp16_to_float(read_u16(b));
            const float dmin = fp16_to_float(read_u16(b + 2));
            for (int s = 0; s < 2; ++s) {
                float sc, mn;
                q4_k_scale_min(2 * j + s, b + 4, &sc, &mn);
                scale[s] = d * sc;
                offset[s] = -dmin * mn;
            }
            const uint8_t* qs = b + 16 + 32 * j;
            for (int i = 0; i < 4; ++i) nibbles8(qs + 8 * i, &q[i], &q[4 + i]);
        }
    }
};

// One unit's contribution to NR activation rows, into acc / offset_sum.
template <int TYPE, int NR>
static inline void fused_unit(const uint8_t* row, int64_t u, const float* x, int64_t x_stride,
                              const float* x_block_sums, int64_t num_subs, __m256* acc,
                              float* offset_sum) {
    using U = Unit<TYPE>;
    __m256 q[8];
    float scale[2], offset[2];
    U::load(row, u, q, scale, offset);
    for (int s = 0; s < U::SUBS; ++s) {
        const int64_t sub = u * U::SUBS + s;
        const __m256 sc = _mm256_set1_ps(scale[s]);
        for (int n = 0; n < NR; ++n) {
            const float* xs = x + n * x_stride + sub * 32;
            __m256 t = _mm256_mul_ps(q[4 * s], _mm256_loadu_ps(xs));
            t = _mm256_fmadd_ps(q[4 * s + 1], _mm256_loadu_ps(xs + 8), t);
            t = _mm256_fmadd_ps(q[4 * s + 2], _mm256_loadu_ps(xs + 16), t);
            t = _mm256_fmadd_ps(q[4 * s + 3], _mm256_loadu_ps(xs + 24), t);
            acc[n] = _mm256_fmadd_ps(t, sc, acc[n]);
            if (U::HAS_OFFSET) offset_sum[n] += offset[s] * x_block_sums[n * num_subs + sub];
        }
    }
}

// With one or two activation rows, units alternate between two sets of accumulators: one set's
// loop-carried FMA chain would bound a row at one unit per FMA latency. From three rows on, the
// rows' own chains are independent enough, and one set leaves registers for up to 8 rows, so a
// verify step of K + 1 <= 8 positions widens each block once.
template <int TYPE, int NR>
static void fused_rows(const uint8_t* packed, int64_t row_bytes, int64_t K, const float* x,
                       int64_t x_stride, const float* x_block_sums, float* y, int64_t y_stride,
                       int64_t row_begin, int64_t row_end) {
    using U = Unit<TYPE>;
    constexpr int SETS = NR <= 2 ? 2 : 1;
    const int64_t num_subs = K / 32, num_units = num_subs / U::SUBS;
    for (int64_t r = row_begin; r < row_end; ++r) {
        const uint8_t* row = packed + r * row_bytes;
        __m256 acc[SETS][NR];
        float offset[SETS][NR];
        for (int s = 0; s < SETS; ++s)
            for (int n = 0; n < NR; ++n) {
                acc[s][n] = _mm256_setzero_ps();
                offset[s][n] = 0.0f;
            }
        int64_t u = 0;
        for (; u + SETS <= num_units; u += SETS)
            for (int s = 0; s < SETS; ++s)
                fused_unit<TYPE, NR>(row, u + s, x, x_stride, x_block_sums, num_subs, acc[s],
                                     offset[s]);
        for (; u < num_units; ++u)
            fused_unit<TYPE, NR>(row, u, x, x_stride, x_block_sums, num_subs, acc[0], offset[0]);
        for (int n = 0; n < NR; ++n) {
            __m256 total = acc[0][n];
            float total_offset = offset[0][n];
            for (int s = 1; s < SETS; ++s) {
                total = _mm256_add_ps(total, acc[s][n]);
                total_offset += offset[s][n];
            }
            y[n * y_stride + r] = hsum(total) + total_offset;
        }
    }
}

template <int TYPE>
static void fused_dispatch(const uint8_t* packed, int64_t row_bytes, int64_t K, const float* x,
                           int64_t x_stride, const float* x_block_sums, int64_t N, float* y,
                           int64_t y_stride, int64_t row_begin, int64_t row_end) {
    const int64_t num_subs = K / 32;
    for (int64_t n = 0; n < N; n += kFusedRows) {  // chunks of up to kFusedRows activation rows
        const float* xn = x + n * x_stride;
        const float* sums = x_block_sums + n * num_subs;
        float* yn = y + n * y_stride;
#define FUSED_ROWS(NR) fused_rows<TYPE, NR>(packed, row_bytes, K, xn, x_stride, sums, yn, \
                                            y_stride, row_begin, row_end)
        switch (N - n < kFusedRows ? N - n : kFusedRows) {
            case 1: FUSED_ROWS(1); break;
            case 2: FUSED_ROWS(2); break;
            case 3: FUSED_ROWS(3); break;
            case 4: FUSED_ROWS(4); break;
            case 5: FUSED_ROWS(5); break;
            case 6: FUSED_ROWS(6); break;
            case 7: FUSED_ROWS(7); break;
            default: FUSED_ROWS(8); break;
        }
#undef FUSED_ROWS
    }
}

// Whether this build has the fused path for `type` (K-quant Q6_K and the generic build do not).
static bool fused_supported(int type) {
    return type == kQ4_0 || type == kQ4_1 || type == kQ8_0 || type == kQ4_K;
}

static void fused_range(int type, const uint8_t* packed, int64_t row_bytes, int64_t K,
                        const float* x, int64_t x_stride, const float* x_block_sums, int64_t N,
                        float* y, int64_t y_stride, int64_t row_begin, int64_t row_end) {
    switch (type) {
        case kQ4_0: return fused_dispatch<kQ4_0>(packed, row_bytes, K, x, x_stride, x_block_sums,
                                                 N, y, y_stride, row_begin, row_end);
        case kQ4_1: return fused_dispatch<kQ4_1>(packed, row_bytes, K, x, x_stride, x_block_sums,
                                                 N, y, y_stride, row_begin, row_end);
        case kQ8_0: return fused_dispatch<kQ8_0>(packed, row_bytes, K, x, x_stride, x_block_sums,
                                                 N, y, y_stride, row_begin, row_end);
        case kQ4_K: return fused_dispatch<kQ4_K>(packed, row_bytes, K, x, x_stride, x_block_sums,
                                                 N, y, y_stride, row_begin, row_end);
    }
}

