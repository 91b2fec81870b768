// One query head's attention over paged keys and values, in pieces: scores of a range of keys,
// softmax numerators, value sums over a range of keys, and the whole of it without vectors.
// Included by vec_ops.cpp after vec_kernels_impl.h (exp_avx2) once per instruction set, like it;
// attention_blocks_impl.h puts the pieces together. No system headers here.
//
// Whatever the variant, a query row's result depends only on that row, its keys and values, and
// its key count: never on the other rows of the call or on the thread that runs it. That is what
// makes a verify row compute, bit for bit, what a decode step computes at its position.

#ifdef GGUF_KERNEL_X86_SIMD
// Lane j of the result: the lanes of a[j] summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)), the one tree every attention score is summed in, whichever kernel computes it.
static inline __m256 sum_lanes(const __m256* a) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 efgh = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20),
                         _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

// scores[0, count) = the first `count` lanes of v.
static inline void store_scores(__m256 v, int64_t count, float* scores) {
    if (count == 8) {
        _mm256_storeu_ps(scores, v);
        return;
    }
    float eight[8];
    _mm256_storeu_ps(eight, v);
    for (int j = 0; j < count; ++j) scores[j] = eight[j];
}

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
        store_scores(_mm256_mul_ps(sum_lanes(a), scale8), count, scores + p);
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

// call(std::integral_constant<int, nv>{}) for nv of 1 to 8 (8 value columns each): the value
// kernels' register loops are unrolled for each column count, and both pick theirs here.
template <typename Call>
static inline void with_column_count(int64_t nv, Call&& call) {
    switch (nv) {
        case 8: return call(std::integral_constant<int, 8>{});
        case 7: return call(std::integral_constant<int, 7>{});
        case 6: return call(std::integral_constant<int, 6>{});
        case 5: return call(std::integral_constant<int, 5>{});
        case 4: return call(std::integral_constant<int, 4>{});
        case 3: return call(std::integral_constant<int, 3>{});
        case 2: return call(std::integral_constant<int, 2>{});
        default: return call(std::integral_constant<int, 1>{});
    }
}

static void weighted_values_of(int64_t nv, const float* w, const PagedRows& values, int64_t begin,
                               int64_t end, float* acc) {
    with_column_count(nv, [&](auto n) {
        weighted_values<decltype(n)::value>(w, values, begin, end, acc);
    });
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

