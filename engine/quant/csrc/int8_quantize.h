// The integer path's activation quantization: rows quantized per 32-value block (Int8Rows) as
// llama.cpp does on x86. Included once, by gguf_int8.cpp, inside its anonymous namespace, after
// its variant ids (kIntAvx2) and SPECSERVE_HAVE_INT8_X86; no include guard.

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
