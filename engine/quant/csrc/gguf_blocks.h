// GGUF block formats decoded, part of the kernel body (see gguf_kernels_impl.h: included once per
// instruction set inside a namespace, so no include guard and no #include here).
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

#endif  // GGUF_KERNEL_X86_SIMD
