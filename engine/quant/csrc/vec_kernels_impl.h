// The float32 vector kernels of a decoder layer's glue: exp, SiLU and argmax (attention is in
// attention_rows_impl.h and attention_blocks_impl.h, which use exp_avx2). Included by vec_ops.cpp
// once per instruction set, inside its own namespace and `#pragma GCC target`, after gguf_blocks.h
// (for hsum); where GGUF_KERNEL_X86_SIMD is defined the loops are AVX2 intrinsics, elsewhere plain
// C++. No system headers here.

// exp by range reduction, exp(x) = 2^n exp(r) with |r| <= ln(2) / 2, and a degree-6 Taylor
// polynomial for exp(r) (truncation error < 2e-7 relative, below float32's own rounding of the
// result's neighbours): one scalar libm exp per element cost ~0.5 ms of a decode step in SiLU,
// and as much again in the softmax of a few hundred keys.
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

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
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

// The index of the largest of x[0, n), the first where several tie and the first NaN if any:
// torch.argmax's answer, which greedy decoding must reproduce exactly. Torch's own reduction
// takes ~90 us over a 49,152-token vocabulary, a fiftieth of a decode step.
static int64_t argmax_row(const float* x, int64_t n) {
    int64_t p = 0, best = 0;
#ifdef GGUF_KERNEL_X86_SIMD
    if (n >= 32 && n <= INT32_MAX) {
        // Four independent chains (a compare and a blend each are one long dependency
        // otherwise); lane j of chain c keeps the largest of x[8c + j], x[8c + j + 32], ...
        // and the first index where it occurs.
        __m256 best_values[4], unordered = _mm256_setzero_ps();
        __m256i best_index[4], index[4];
        const __m256i step = _mm256_set1_epi32(32);
        for (int c = 0; c < 4; ++c) {
            best_values[c] = _mm256_loadu_ps(x + 8 * c);
            index[c] = best_index[c] = _mm256_add_epi32(_mm256_set1_epi32(8 * c),
                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(best_values[c], best_values[c], _CMP_UNORD_Q));
        }
        for (p = 32; p + 32 <= n; p += 32)
            for (int c = 0; c < 4; ++c) {
                index[c] = _mm256_add_epi32(index[c], step);
                const __m256 v = _mm256_loadu_ps(x + p + 8 * c);
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                const __m256 greater = _mm256_cmp_ps(v, best_values[c], _CMP_GT_OQ);
                best_values[c] = _mm256_blendv_ps(best_values[c], v, greater);
                best_index[c] = _mm256_castps_si256(_mm256_blendv_ps(
                    _mm256_castsi256_ps(best_index[c]), _mm256_castsi256_ps(index[c]), greater));
            }
        if (_mm256_movemask_ps(unordered) == 0) {
            float values[32];
            int32_t indices[32];
            for (int c = 0; c < 4; ++c) {
                _mm256_storeu_ps(values + 8 * c, best_values[c]);
                _mm256_storeu_si256((__m256i*)(indices + 8 * c), best_index[c]);
            }
            for (int j = 0; j < 32; ++j)
                if (values[j] > x[best] || (values[j] == x[best] && indices[j] < best)) best = indices[j];
        } else {
            p = 0;  // a NaN somewhere: the scalar loop finds the first
        }
    }
#endif
    for (; p < n; ++p) {
        if (std::isnan(x[p])) {
            for (int64_t i = 0; i <= p; ++i)
                if (std::isnan(x[i])) return i;
        }
        if (x[p] > x[best]) best = p;
    }
    return best;
}
