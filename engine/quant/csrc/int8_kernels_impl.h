// The integer matmul body, included once per instruction set inside its own namespace with
// INT8_ISA set: 0 generic C++, 1 256-bit (AVX2 maddubs + madd, or with INT8_AVX_VNNI set the
// AVX-VNNI vpdpbusd of CPUs that have it without AVX-512), 2 AVX-512 VNNI (vpdpbusd). No include
// guard.
//
// Weights come repacked in groups of 16 rows (int8_layout.h); activations come quantized per row
// into 32-value blocks (Int8Rows). Per output, every variant computes the same float operations in
// the same order (the canonical order, see int8_layout.h), and integer sums are exact in any
// order, so all variants give bitwise the same result, and a row's result never depends on the
// other rows in the call.

#include "gguf_blocks.h"  // fp16_to_float, read_u16 (plain C++ here: exact either way)

// Activation rows that share each weight group's unpacked registers (the weights of a group are
// read from memory once per call, then from L1): 4 in the 16 registers of the 256-bit variants,
// 8 in AVX-512's 32, so a 6-row verify step unpacks each block once, not twice (4 + 2).
constexpr int64_t kRowChunk = INT8_ISA == 2 ? 8 : 4;
// A weight streams from L3 or memory at what one core's outstanding misses allow; asking for the
// lines 4 KB on (the next groups) keeps more misses in flight: 1.7-2x faster over a whole step's
// 121 calls on the Xeon (benchmarks: "Integer GGUF kernels" in the README). A hint only: it
// never faults past the end of the weights, and it changes no result.
constexpr int64_t kPrefetchAhead = 4096;

static inline int32_t load_i32(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

#if INT8_ISA != 0
static inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64)
        _mm_prefetch((const char*)(block + kPrefetchAhead + line), _MM_HINT_T0);
}
#endif

static inline int64_t group_block_bytes(int64_t type) {
    return type == kQ4_0x16 ? kQ4_0GroupBlockBytes
           : type == kQ4_1x16 ? kQ4_1GroupBlockBytes : kQ8_0GroupBlockBytes;
}

#if INT8_ISA == 0

// Integer dot products of one block of 32: row `lane` of the group against activation `xq`.
// Q4_0 and Q4_1 nibbles as stored (0..15); Q4_0's offset of 8 is taken out by the caller.
static inline int32_t isum_q4(const uint8_t* quants, int lane, const int8_t* xq) {
    int32_t sum = 0;
    for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 4; ++j) {
            const uint8_t byte = quants[64 * c + 4 * lane + j];
            sum += (int32_t)(byte & 0x0F) * xq[4 * c + j] + (int32_t)(byte >> 4) * xq[16 + 4 * c + j];
        }
    return sum;
}

static inline int32_t isum_q8_0(const uint8_t* block, int lane, const int8_t* xq) {
    int32_t sum = 0;
    for (int c = 0; c < 8; ++c)
        for (int j = 0; j < 4; ++j)
            sum += (int32_t)(int8_t)block[kQ8_0QsOffset + 64 * c + 4 * lane + j] * xq[4 * c + j];
    return sum;
}

static void group_rows(int64_t type, const uint8_t* group, int64_t num_blocks, const Int8Rows& x,
                       int64_t n0, int64_t rows, float* y, int64_t y_stride) {
    const int64_t block_bytes = group_block_bytes(type);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        for (int lane = 0; lane < 16; ++lane) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; ++b) {
                const uint8_t* block = group + b * block_bytes;
                const int8_t* xq = x.q + n * x.K + b * 32;
                const float d_w = fp16_to_float(read_u16(block + 2 * lane));
                const float d_x = x.d[n * num_blocks + b];
                const float product = d_w * d_x;
                if (type == kQ4_1x16) {
                    const float m_w = fp16_to_float(read_u16(block + 32 + 2 * lane));
                    acc = acc + (float)isum_q4(block + kQ4_1QsOffset, lane, xq) * product;
                    acc = acc + m_w * x.s[n * num_blocks + b];
                } else if (type == kQ4_0x16) {
                    const int32_t isum = isum_q4(block + kQ4_0QsOffset, lane, xq) -
                                         8 * x.sum[n * num_blocks + b];
                    acc = acc + (float)isum * product;
                } else {
                    acc = acc + (float)isum_q8_0(block, lane, xq) * product;
                }
            }
            y[r * y_stride + lane] = acc;
        }
    }
}

#elif INT8_ISA == 1

// acc + u8 x s8, 4 products per i32 lane. Exact either way here: maddubs' int16 pair sums stay
// below 2^15 (4-bit weights, and |w| x |x| <= 128 x 127 for Q8_0 with x carrying w's sign).
static inline __m256i dot4_u8s8(__m256i acc, __m256i u, __m256i s) {
#if INT8_AVX_VNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

template <int R>
static void group_chunk(int64_t type, const uint8_t* group, int64_t num_blocks, const Int8Rows& x,
                        int64_t n0, float* y, int64_t y_stride) {
    const bool q4 = type != kQ8_0x16, q4_1 = type == kQ4_1x16;
    const int64_t block_bytes = group_block_bytes(type);
    const int64_t qs_offset = q4_1 ? kQ4_1QsOffset : kQ4_0QsOffset;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int half = 0; half < 2; ++half) {  // lanes 0-7, then 8-15
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < num_blocks; ++b) {
            const uint8_t* block = group + b * block_bytes;
            if (half == 0) prefetch_ahead(block, block_bytes);
            const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(block + 16 * half)));
            if (q4) {
                const __m256 m_w = q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                              (const __m128i*)(block + 32 + 16 * half)))
                                        : _mm256_setzero_ps();
                __m256i lo[4], hi[4];
                for (int c = 0; c < 4; ++c) {
                    const __m256i v = _mm256_loadu_si256(
                        (const __m256i*)(block + qs_offset + 64 * c + 32 * half));
                    lo[c] = _mm256_and_si256(v, low);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                for (int r = 0; r < R; ++r) {
                    const int64_t n = n0 + r;
                    const int8_t* xq = x.q + n * x.K + b * 32;
                    __m256i isum = _mm256_setzero_si256();
                    for (int c = 0; c < 4; ++c) {
                        isum = dot4_u8s8(isum, lo[c], _mm256_set1_epi32(load_i32(xq + 4 * c)));
                        isum = dot4_u8s8(isum, hi[c], _mm256_set1_epi32(load_i32(xq + 16 + 4 * c)));
                    }
                    if (!q4_1)  // Q4_0: the nibbles stand for q - 8
                        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * x.sum[n * num_blocks + b]));
                    const __m256 product = _mm256_mul_ps(d_w, _mm256_set1_ps(x.d[n * num_blocks + b]));
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), product));
                    if (q4_1)
                        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(m_w, _mm256_set1_ps(x.s[n * num_blocks + b])));
                }
            } else {
                __m256i w[8], w_abs[8];
                for (int c = 0; c < 8; ++c) {
                    w[c] = _mm256_loadu_si256((const __m256i*)(block + kQ8_0QsOffset + 64 * c + 32 * half));
                    w_abs[c] = _mm256_abs_epi8(w[c]);
                }
                for (int r = 0; r < R; ++r) {
                    const int64_t n = n0 + r;
                    const int8_t* xq = x.q + n * x.K + b * 32;
                    __m256i isum = _mm256_setzero_si256();
                    for (int c = 0; c < 8; ++c) {
                        // |w| * (x with w's sign): u8 x s8 with no saturation (|w| <= 128).
                        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq + 4 * c)), w[c]);
                        isum = dot4_u8s8(isum, w_abs[c], signed_x);
                    }
                    const __m256 product = _mm256_mul_ps(d_w, _mm256_set1_ps(x.d[n * num_blocks + b]));
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), product));
                }
            }
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * y_stride + 8 * half, acc[r]);
    }
}

#else  // INT8_ISA == 2: AVX-512 VNNI

template <int R>
static void group_chunk(int64_t type, const uint8_t* group, int64_t num_blocks, const Int8Rows& x,
                        int64_t n0, float* y, int64_t y_stride) {
    const bool q4 = type != kQ8_0x16, q4_1 = type == kQ4_1x16;
    const int64_t block_bytes = group_block_bytes(type);
    const int64_t qs_offset = q4_1 ? kQ4_1QsOffset : kQ4_0QsOffset;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i sign_bit = _mm512_set1_epi8((char)0x80);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* block = group + b * block_bytes;
        prefetch_ahead(block, block_bytes);
        const __m512 d_w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)block));
        if (q4) {
            const __m512 m_w = q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + 32)))
                                    : _mm512_setzero_ps();
            __m512i lo[4], hi[4];
            for (int c = 0; c < 4; ++c) {
                const __m512i v = _mm512_loadu_si512(block + qs_offset + 64 * c);
                lo[c] = _mm512_and_si512(v, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; ++r) {
                const int64_t n = n0 + r;
                const int8_t* xq = x.q + n * x.K + b * 32;
                // Two chains, so one row's 8 multiply-adds are not one long dependency.
                __m512i sum_lo = _mm512_setzero_si512(), sum_hi = _mm512_setzero_si512();
                for (int c = 0; c < 4; ++c) {
                    sum_lo = _mm512_dpbusd_epi32(sum_lo, lo[c], _mm512_set1_epi32(load_i32(xq + 4 * c)));
                    sum_hi = _mm512_dpbusd_epi32(sum_hi, hi[c], _mm512_set1_epi32(load_i32(xq + 16 + 4 * c)));
                }
                __m512i isum = _mm512_add_epi32(sum_lo, sum_hi);
                if (!q4_1)  // Q4_0: the nibbles stand for q - 8
                    isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * x.sum[n * num_blocks + b]));
                const __m512 product = _mm512_mul_ps(d_w, _mm512_set1_ps(x.d[n * num_blocks + b]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), product));
                if (q4_1)
                    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(m_w, _mm512_set1_ps(x.s[n * num_blocks + b])));
            }
        } else {
            __m512i w_biased[8];  // w + 128 as u8: vpdpbusd multiplies u8 by s8
            for (int c = 0; c < 8; ++c)
                w_biased[c] = _mm512_xor_si512(_mm512_loadu_si512(block + kQ8_0QsOffset + 64 * c), sign_bit);
            for (int r = 0; r < R; ++r) {
                const int64_t n = n0 + r;
                const int8_t* xq = x.q + n * x.K + b * 32;
                __m512i sum_a = _mm512_setzero_si512(), sum_b = _mm512_setzero_si512();
                for (int c = 0; c < 8; c += 2) {
                    sum_a = _mm512_dpbusd_epi32(sum_a, w_biased[c], _mm512_set1_epi32(load_i32(xq + 4 * c)));
                    sum_b = _mm512_dpbusd_epi32(sum_b, w_biased[c + 1], _mm512_set1_epi32(load_i32(xq + 4 * c + 4)));
                }
                // sum (w + 128) x = sum w x + 128 sum x: take the bias back out, exactly.
                const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(sum_a, sum_b),
                                                      _mm512_set1_epi32(128 * x.sum[n * num_blocks + b]));
                const __m512 product = _mm512_mul_ps(d_w, _mm512_set1_ps(x.d[n * num_blocks + b]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), product));
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}

#endif

#if INT8_ISA != 0
static void group_rows(int64_t type, const uint8_t* group, int64_t num_blocks, const Int8Rows& x,
                       int64_t n0, int64_t rows, float* y, int64_t y_stride) {
    switch (rows) {
#if INT8_ISA == 2
        case 8: return group_chunk<8>(type, group, num_blocks, x, n0, y, y_stride);
        case 7: return group_chunk<7>(type, group, num_blocks, x, n0, y, y_stride);
        case 6: return group_chunk<6>(type, group, num_blocks, x, n0, y, y_stride);
        case 5: return group_chunk<5>(type, group, num_blocks, x, n0, y, y_stride);
#endif
        case 4: return group_chunk<4>(type, group, num_blocks, x, n0, y, y_stride);
        case 3: return group_chunk<3>(type, group, num_blocks, x, n0, y, y_stride);
        case 2: return group_chunk<2>(type, group, num_blocks, x, n0, y, y_stride);
        default: return group_chunk<1>(type, group, num_blocks, x, n0, y, y_stride);
    }
}
#endif

// Output columns [16 g_begin, 16 g_end) of every activation row.
void matmul_groups(int64_t type, const uint8_t* weights, int64_t group_bytes, int64_t num_blocks,
                   const Int8Rows& x, int64_t N, float* y, int64_t y_stride, int64_t g_begin,
                   int64_t g_end) {
    for (int64_t g = g_begin; g < g_end; ++g)
        for (int64_t n0 = 0; n0 < N; n0 += kRowChunk)
            group_rows(type, weights + g * group_bytes, num_blocks, x, n0,
                       std::min<int64_t>(kRowChunk, N - n0), y + n0 * y_stride + 16 * g, y_stride);
}
