// The body of the GGUF CPU kernels, included several times by gguf_cpu.cpp: once per instruction
// set, each time inside its own namespace and under its own `#pragma GCC target`. The code is
// plain C++ written so that GCC vectorises it (fixed-length inner loops over contiguous floats);
// the instruction set is chosen by the including region, not here. Include no headers here: an
// #include inside a namespace would put the standard library in that namespace.
//
// Layouts are GGUF's (ggml-common.h), read here from the format's definition:
//   Q4_0: {fp16 d; u8 qs[16]}                    w = d * (q - 8)
//   Q4_1: {fp16 d, m; u8 qs[16]}                 w = d * q + m
//   Q8_0: {fp16 d; i8 qs[32]}                    w = d * q
//   Q4_K: {fp16 d, dmin; u8 scales[12]; u8 qs[128]}   256 weights, 8 sub-blocks of 32 with 6-bit
//         scale and min: w = d * sc * q - dmin * mn
//   Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}   256 weights, 16 sub-blocks of 16:
//         w = d * sc * (q - 32), q of 6 bits split over ql (low 4) and qh (high 2)
// In Q4_0/Q4_1 byte j holds weight j in its low nibble and weight j + 16 in its high one.

static inline float fp16_to_float(uint16_t h) {
#ifdef GGUF_KERNEL_X86_SIMD
    return _cvtsh_ss(h);  // F16C
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);  // inf / nan
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;  // signed zero
    } else {  // subnormal: normalise it
        exponent = 113;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof(out));
    return out;
#endif
}

static inline uint16_t read_u16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void dequant_q4_0(const uint8_t* block, float* out) {
    const float d = fp16_to_float(read_u16(block));
    const uint8_t* qs = block + 2;
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)((int)(qs[j] & 0x0F) - 8);
        out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

static inline void dequant_q4_1(const uint8_t* block, float* out) {
    const float d = fp16_to_float(read_u16(block));
    const float m = fp16_to_float(read_u16(block + 2));
    const uint8_t* qs = block + 4;
    for (int j = 0; j < 16; ++j) {
        out[j] = (float)(qs[j] & 0x0F) * d + m;
        out[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static inline void dequant_q8_0(const uint8_t* block, float* out) {
    const float d = fp16_to_float(read_u16(block));
    const int8_t* qs = (const int8_t*)(block + 2);
    for (int j = 0; j < 32; ++j) out[j] = d * (float)qs[j];
}

// The 6-bit scale and min of Q4_K sub-block j (0..7) from its 12 packed bytes.
static inline void q4_k_scale_min(int j, const uint8_t* q, float* scale, float* min) {
    if (j < 4) {
        *scale = (float)(q[j] & 63);
        *min = (float)(q[j + 4] & 63);
    } else {
        *scale = (float)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
        *min = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static inline void dequant_q4_k(const uint8_t* block, float* out) {
    const float d = fp16_to_float(read_u16(block));
    const float dmin = fp16_to_float(read_u16(block + 2));
    const uint8_t* scales = block + 4;
    const uint8_t* qs = block + 16;
    for (int j = 0; j < 4; ++j) {  // 64 weights: low nibbles, then high nibbles of 32 bytes
        float sc_lo, mn_lo, sc_hi, mn_hi;
        q4_k_scale_min(2 * j, scales, &sc_lo, &mn_lo);
        q4_k_scale_min(2 * j + 1, scales, &sc_hi, &mn_hi);
        const float d_lo = d * sc_lo, m_lo = dmin * mn_lo;
        const float d_hi = d * sc_hi, m_hi = dmin * mn_hi;
        for (int l = 0; l < 32; ++l) {
            out[l] = d_lo * (float)(qs[l] & 0x0F) - m_lo;
            out[l + 32] = d_hi * (float)(qs[l] >> 4) - m_hi;
        }
        qs += 32;
        out += 64;
    }
}

static inline void dequant_q6_k(const uint8_t* block, float* out) {
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    const int8_t* sc = (const int8_t*)(block + 192);
    const float d = fp16_to_float(read_u16(block + 208));
    for (int half = 0; half < 2; ++half) {  // 128 weights from 64 ql bytes and 32 qh bytes
        for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            out[l] = d * (float)sc[is] * (float)q1;
            out[l + 32] = d * (float)sc[is + 2] * (float)q2;
            out[l + 64] = d * (float)sc[is + 4] * (float)q3;
            out[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        ql += 64;
        qh += 32;
        sc += 8;
        out += 128;
    }
}

#ifdef GGUF_KERNEL_X86_SIMD
static inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// 16 packed bytes -> 16 weights from the low nibbles (d_lo * q + m_lo) to out_lo and 16 from the
// high nibbles (d_hi * q + m_hi) to out_hi.
static inline void nibbles_to_floats(const uint8_t* q16, float d_lo, float m_lo, float d_hi,
                                     float m_hi, float* out_lo, float* out_hi) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)q16);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 dl = _mm256_set1_ps(d_lo), ml = _mm256_set1_ps(m_lo);
    const __m256 dh = _mm256_set1_ps(d_hi), mh = _mm256_set1_ps(m_hi);
    _mm256_storeu_ps(out_lo, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dl, ml));
    _mm256_storeu_ps(out_lo + 8, _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dl, ml));
    _mm256_storeu_ps(out_hi, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dh, mh));
    _mm256_storeu_ps(out_hi + 8, _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dh, mh));
}

static inline void simd_q4_0(const uint8_t* block, float* out) {
    const float d = fp16_to_float(read_u16(block));
    nibbles_to_floats(block + 2, d, -8.0f * d, d, -8.0f * d, out, out + 16);
}

static inline void simd_q4_1(const uint8_t* block, float* out) {
    const float d = fp16_to_float(read_u16(block));
    const float m = fp16_to_float(read_u16(block + 2));
    nibbles_to_floats(block + 4, d, m, d, m, out, out + 16);
}

static inline void simd_q8_0(const uint8_t* block, float* out) {
    const __m256 d = _mm256_set1_ps(fp16_to_float(read_u16(block)));
    const __m128i a = _mm_loadu_si128((const __m128i*)(block + 2));
    const __m128i b = _mm_loadu_si128((const __m128i*)(block + 18));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), d));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))), d));
    _mm256_storeu_ps(out + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d));
    _mm256_storeu_ps(out + 24, _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d));
}

static inline void simd_q4_k(const uint8_t* block, float* out) {
    const float d = fp16_to_float(read_u16(block));
    const float dmin = fp16_to_float(read_u16(block + 2));
    const uint8_t* scales = block + 4;
    const uint8_t* qs = block + 16;
    for (int j = 0; j < 4; ++j) {
        float sc_lo, mn_lo, sc_hi, mn_hi;
        q4_k_scale_min(2 * j, scales, &sc_lo, &mn_lo);
        q4_k_scale_min(2 * j + 1, scales, &sc_hi, &mn_hi);
        const float d_lo = d * sc_lo, m_lo = -dmin * mn_lo;
        const float d_hi = d * sc_hi, m_hi = -dmin * mn_hi;
        nibbles_to_floats(qs, d_lo, m_lo, d_hi, m_hi, out, out + 32);
        nibbles_to_floats(qs + 16, d_lo, m_lo, d_hi, m_hi, out + 16, out + 48);
        qs += 32;
        out += 64;
    }
}

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

// Units alternate between two sets of accumulators: the loop-carried FMA chain of one set
// would otherwise bound a row at one unit per FMA latency.
template <int TYPE, int NR>
static void fused_rows(const uint8_t* packed, int64_t row_bytes, int64_t K, const float* x,
                       int64_t x_stride, const float* x_block_sums, float* y, int64_t y_stride,
                       int64_t row_begin, int64_t row_end) {
    using U = Unit<TYPE>;
    const int64_t num_subs = K / 32, num_units = num_subs / U::SUBS;
    for (int64_t r = row_begin; r < row_end; ++r) {
        const uint8_t* row = packed + r * row_bytes;
        __m256 acc0[NR], acc1[NR];
        float offset0[NR], offset1[NR];
        for (int n = 0; n < NR; ++n) {
            acc0[n] = acc1[n] = _mm256_setzero_ps();
            offset0[n] = offset1[n] = 0.0f;
        }
        int64_t u = 0;
        for (; u + 2 <= num_units; u += 2) {
            fused_unit<TYPE, NR>(row, u, x, x_stride, x_block_sums, num_subs, acc0, offset0);
            fused_unit<TYPE, NR>(row, u + 1, x, x_stride, x_block_sums, num_subs, acc1, offset1);
        }
        if (u < num_units)
            fused_unit<TYPE, NR>(row, u, x, x_stride, x_block_sums, num_subs, acc0, offset0);
        for (int n = 0; n < NR; ++n)
            y[n * y_stride + r] = hsum(_mm256_add_ps(acc0[n], acc1[n])) + offset0[n] + offset1[n];
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
        switch (N - n < kFusedRows ? N - n : kFusedRows) {
            case 1: fused_rows<TYPE, 1>(packed, row_bytes, K, xn, x_stride, sums, yn, y_stride,
                                        row_begin, row_end); break;
            case 2: fused_rows<TYPE, 2>(packed, row_bytes, K, xn, x_stride, sums, yn, y_stride,
                                        row_begin, row_end); break;
            case 3: fused_rows<TYPE, 3>(packed, row_bytes, K, xn, x_stride, sums, yn, y_stride,
                                        row_begin, row_end); break;
            default: fused_rows<TYPE, 4>(packed, row_bytes, K, xn, x_stride, sums, yn, y_stride,
                                         row_begin, row_end); break;
        }
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

// Small float32 vector primitives for the fused attention (cpu_ops.cpp).
static float dot_f32(const float* a, const float* b, int64_t n) {
#ifdef GGUF_KERNEL_X86_SIMD
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    float sum = hsum(_mm256_add_ps(acc0, acc1));
#else
    float sum = 0.0f;
    int64_t i = 0;
#endif
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

static void axpy_f32(float alpha, const float* x, float* y, int64_t n) {  // y += alpha * x
    int64_t i = 0;
#ifdef GGUF_KERNEL_X86_SIMD
    const __m256 a = _mm256_set1_ps(alpha);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; ++i) y[i] += alpha * x[i];
}
