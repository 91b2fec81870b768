// The float32 vector kernels of a decoder layer's glue: one query head's attention over paged
// keys and values, and SiLU. Included by vec_ops.cpp once per instruction set, inside its own
// namespace and `#pragma GCC target`, after gguf_blocks.h (for hsum); where GGUF_KERNEL_X86_SIMD is
// defined the loops are AVX2 intrinsics, elsewhere plain C++. No system headers here.
//
// Whatever the variant, a query row's result depends only on that row, its keys and values, and
// its key count: never on the other rows of the call or on the thread that runs it. That is what
// makes a verify row compute, bit for bit, what a decode step computes at its position.

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

#ifdef GGUF_KERNEL_X86_SIMD
// scores[p] = scale * q . k_p for begin <= p < n, D a multiple of 8:
// eight keys at a time, so eight independent FMA chains keep both FMA units busy and one
// reduction tree serves eight dot products (a horizontal sum per key cost as much as its FMAs).
// Each key's score is the same whatever the range it is computed in.
static void key_scores(const float* q, int64_t D, float scale, const PagedRows& keys,
                       int64_t begin, int64_t n, float* scores) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t p = begin; p < n; p += 8) {
        const int64_t count = n - p < 8 ? n - p : 8;
        const float* k[8];
        for (int j = 0; j < 8; ++j) k[j] = keys.row(p + (j < count ? j : 0));
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), a[j]);
        }
        const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        const __m256 efgh = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20),
                                          _mm256_permute2f128_ps(abcd, efgh, 0x31));
        const __m256 scaled = _mm256_mul_ps(dots, scale8);
        if (count == 8) {
            _mm256_storeu_ps(scores + p, scaled);
        } else {
            float eight[8];
            _mm256_storeu_ps(eight, scaled);
            for (int j = 0; j < count; ++j) scores[p + j] = eight[j];
        }
    }
}

// e[p] = exp(s[p] - max s) in place; returns the sum of e.
static float softmax_numerators(float* s, int64_t n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + p));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float max_score = lanes[0];
    for (int j = 1; j < 8; ++j) max_score = lanes[j] > max_score ? lanes[j] : max_score;
    for (; p < n; ++p) max_score = s[p] > max_score ? s[p] : max_score;
    const __m256 shift = _mm256_set1_ps(max_score);
    __m256 total = _mm256_setzero_ps();
    for (p = 0; p + 8 <= n; p += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + p), shift));
        _mm256_storeu_ps(s + p, e);
        total = _mm256_add_ps(total, e);
    }
    if (p < n) {  // the tail through a padded copy: the same exp for every key
        const int64_t count = n - p;
        float chunk[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t j = 0; j < count; ++j) chunk[j] = s[p + j];
        _mm256_storeu_ps(chunk, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(chunk), shift)));
        for (int64_t j = count; j < 8; ++j) chunk[j] = 0.0f;
        for (int64_t j = 0; j < count; ++j) s[p + j] = chunk[j];
        total = _mm256_add_ps(total, _mm256_loadu_ps(chunk));
    }
    return hsum(total);
}

// acc[0, 8 NV) += sum_{begin <= p < end} w[p] v_p[0, 8 NV), in order of p: the accumulators
// stay in registers over the range, and a sum split into ranges is the same as one pass.
template <int NV>
static void weighted_values(const float* w, const PagedRows& values, int64_t begin, int64_t end,
                            float* acc_out) {
    __m256 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm256_loadu_ps(acc_out + 8 * c);
    for (int64_t p = begin; p < end; ++p) {
        const __m256 weight = _mm256_set1_ps(w[p]);
        const float* v = values.row(p);
        for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc_out + 8 * c, acc[c]);
}

static void weighted_values_of(int64_t nv, const float* w, const PagedRows& values, int64_t begin,
                               int64_t end, float* acc) {
    switch (nv) {
        case 8: return weighted_values<8>(w, values, begin, end, acc);
        case 7: return weighted_values<7>(w, values, begin, end, acc);
        case 6: return weighted_values<6>(w, values, begin, end, acc);
        case 5: return weighted_values<5>(w, values, begin, end, acc);
        case 4: return weighted_values<4>(w, values, begin, end, acc);
        case 3: return weighted_values<3>(w, values, begin, end, acc);
        case 2: return weighted_values<2>(w, values, begin, end, acc);
        default: return weighted_values<1>(w, values, begin, end, acc);
    }
}
#endif

// s[0, n) = softcap tanh(s / softcap): Gemma 2's soft-capped attention logits, applied after the
// scale as transformers does. Scalar: only models that ask for it pay for it.
static void soft_cap(float* s, int64_t n, float softcap) {
    for (int64_t p = 0; p < n; ++p) s[p] = std::tanh(s[p] / softcap) * softcap;
}

// One query head attending over the first n keys of its KV head, without vectors:
// out = softmax(scores) V, q and out D floats, scores scratch of n floats.
static void attend_head_scalar(const float* q, int64_t D, ScoreForm form, const PagedRows& keys,
                               const PagedRows& values, int64_t n, float* scores, float* out) {
    for (int64_t p = 0; p < n; ++p) {
        const float* k = keys.row(p);
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
        scores[p] = dot * form.scale;
    }
    if (form.softcap > 0) soft_cap(scores, n, form.softcap);
    float max_score = -INFINITY;
    for (int64_t p = 0; p < n; ++p) max_score = scores[p] > max_score ? scores[p] : max_score;
    float total = 0.0f;
    for (int64_t p = 0; p < n; ++p) {
        scores[p] = std::exp(scores[p] - max_score);
        total += scores[p];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
    for (int64_t p = 0; p < n; ++p) {
        const float* v = values.row(p);
        for (int64_t d = 0; d < D; ++d) out[d] += scores[p] * v[d];
    }
    for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// The keys of a query that starts at key `first`: its key 0 is the shared list's key `first`.
static PagedRows from_key(const PagedRows& rows, int64_t first) {
    return {rows.base, rows.slots + first, rows.slot_stride};
}

// Query heads that read the same KV head (a request's rows, a GQA group's heads), each over its
// own keys [first_key, num_keys): out = softmax(scores) V. The keys and values go by in tiles of
// kKeyTile, each used by every query while it is in L1: reading them once per query from L2
// made attention a third of a 6-row verify step at 500 keys. Every query's arithmetic is that
// of a query alone (per-key scores; sums over its keys in order from its first, carried across
// tiles in memory), so its result never depends on the others. Scratch: (8 + round_up(keys, 8)
// + D) floats per query, for the most keys one query sees.
constexpr int64_t kKeyTile = 64;

static void attend_heads(const HeadQuery* queries, int64_t count, int64_t D, ScoreForm form,
                         const PagedRows& keys, const PagedRows& values, float* scratch) {
    int64_t max_keys = 0, lowest = INT64_MAX, highest = 0;
    for (int64_t g = 0; g < count; ++g) {
        const HeadQuery& query = queries[g];
        max_keys = query.num_keys - query.first_key > max_keys ? query.num_keys - query.first_key
                                                               : max_keys;
        lowest = query.first_key < lowest ? query.first_key : lowest;
        highest = query.num_keys > highest ? query.num_keys : highest;
    }
    const int64_t stride = (max_keys + 7) / 8 * 8 + D + 8;  // scores, then sums, then 1 / total
#ifdef GGUF_KERNEL_X86_SIMD
    if (D % 8 == 0) {
        const int64_t tiles_from = lowest / kKeyTile * kKeyTile;
        for (int64_t p = tiles_from; p < highest; p += kKeyTile)
            for (int64_t g = 0; g < count; ++g) {
                const int64_t f = queries[g].first_key, n = queries[g].num_keys;
                const int64_t begin = p > f ? p : f, end = p + kKeyTile < n ? p + kKeyTile : n;
                if (begin >= end) continue;
                float* scores = scratch + g * stride;
                key_scores(queries[g].q, D, form.scale, from_key(keys, f), begin - f, end - f,
                           scores);
                if (form.softcap > 0) soft_cap(scores + begin - f, end - begin, form.softcap);
            }
        for (int64_t g = 0; g < count; ++g) {
            float* scores = scratch + g * stride;
            scores[stride - 8] =
                1.0f / softmax_numerators(scores, queries[g].num_keys - queries[g].first_key);
            for (int64_t d = 0; d < D; ++d) scores[stride - 8 - D + d] = 0.0f;
        }
        for (int64_t d = 0; d < D; d += 64) {  // 64 columns (8 registers) a pass over the values
            const PagedRows part{values.base + d, values.slots, values.slot_stride};
            const int64_t nv = (D - d < 64 ? D - d : 64) / 8;
            for (int64_t p = tiles_from; p < highest; p += kKeyTile)
                for (int64_t g = 0; g < count; ++g) {
                    const int64_t f = queries[g].first_key, n = queries[g].num_keys;
                    const int64_t begin = p > f ? p : f, end = p + kKeyTile < n ? p + kKeyTile : n;
                    float* scores = scratch + g * stride;
                    if (begin < end)
                        weighted_values_of(nv, scores, from_key(part, f), begin - f, end - f,
                                           scores + stride - 8 - D + d);
                }
        }
        for (int64_t g = 0; g < count; ++g) {
            const float* scores = scratch + g * stride;
            const __m256 inv = _mm256_set1_ps(scores[stride - 8]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(queries[g].out + d,
                                 _mm256_mul_ps(_mm256_loadu_ps(scores + stride - 8 - D + d), inv));
        }
        return;
    }
#endif
    for (int64_t g = 0; g < count; ++g) {
        const int64_t f = queries[g].first_key;
        attend_head_scalar(queries[g].q, D, form, from_key(keys, f), from_key(values, f),
                           queries[g].num_keys - f, scratch + g * stride, queries[g].out);
    }
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
