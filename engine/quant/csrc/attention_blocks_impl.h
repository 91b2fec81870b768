// Query heads that read the same KV heads (a request's rows, its GQA groups' heads), each over its
// own keys [first_key, num_keys): out = softmax(scores) V. Included by vec_ops.cpp after
// attention_rows_impl.h, once per instruction set; ATTENTION_QUERY_BLOCK (how many queries the
// blocked kernels take at once) is set there per variant. No system headers here.
//
// The keys and values go by in tiles of kKeyTile, each used by every query while it is in L1:
// reading them once per query from L2 made attention a third of a 6-row verify step at 500 keys.
// Within a tile, blocks of kQueryBlock queries share each key and value load over the keys they
// all see (register blocking; a load per multiply-add left the FMA units half idle), and each
// query takes its other keys of the tile alone. Every query's arithmetic is that of a query alone
// either way: per-key scores in one summation tree (sum_lanes), value sums over its keys in key
// order from its first, carried across tiles and kernels in memory. So its result never depends
// on the others, nor on how they were blocked. Scratch: (8 + round_up(keys, 8) + D) floats per
// query, for the most keys one query sees.
constexpr int64_t kKeyTile = 64;

#ifdef GGUF_KERNEL_X86_SIMD
#ifndef ATTENTION_QUERY_BLOCK
#define ATTENTION_QUERY_BLOCK 1
#endif
// Queries per block: 3 where the variant has 32 vector registers (three queries' accumulators
// for 8 keys, or for 64 value columns, are 24 of them), else 1 (AVX2's 16 registers would spill).
constexpr int64_t kQueryBlock = ATTENTION_QUERY_BLOCK;

// A query as the blocked kernels see it: scores[p - first] is its score (then weight) of key p,
// sums its value sums (D floats).
struct BlockQuery {
    const float* q;
    float* scores;
    int64_t first;
    float* sums;
};

// Query g's part of the scratch: its scores from its first key, then its value sums (D floats),
// then 1 / the softmax total (8 floats kept for it).
struct QueryScratch {
    float* base;
    int64_t stride, D;
    float* scores(int64_t g) const { return base + g * stride; }
    float* sums(int64_t g) const { return base + g * stride + stride - 8 - D; }
    float* inverse_total(int64_t g) const { return base + g * stride + stride - 8; }
};

// Queries [g0, g0 + kQueryBlock) as a block.
static inline void fill_block(const HeadQuery* queries, const QueryScratch& scratch, int64_t g0,
                              BlockQuery* block) {
    for (int64_t g = 0; g < kQueryBlock; ++g)
        block[g] = {queries[g0 + g].q, scratch.scores(g0 + g), queries[g0 + g].first_key,
                    scratch.sums(g0 + g)};
}

// scores of keys [begin, end), D a multiple of 8, for kQueryBlock queries at once: each key
// row loaded once for all of them, each query's eight dot products summed as key_scores does.
static void block_key_scores(const BlockQuery* block, int64_t D, float scale,
                             const PagedRows& keys, int64_t begin, int64_t end) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t p = begin; p < end; p += 8) {
        const int64_t count = end - p < 8 ? end - p : 8;
        const float* k[8];
        for (int j = 0; j < 8; ++j) k[j] = keys.row(p + (j < count ? j : 0));
        __m256 a[kQueryBlock][8];
        for (int g = 0; g < kQueryBlock; ++g)
            for (int j = 0; j < 8; ++j) a[g][j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 qv[kQueryBlock];
            for (int g = 0; g < kQueryBlock; ++g) qv[g] = _mm256_loadu_ps(block[g].q + d);
            for (int j = 0; j < 8; ++j) {
                const __m256 kv = _mm256_loadu_ps(k[j] + d);
                for (int g = 0; g < kQueryBlock; ++g) a[g][j] = _mm256_fmadd_ps(qv[g], kv, a[g][j]);
            }
        }
        for (int g = 0; g < kQueryBlock; ++g)
            store_scores(sum_lanes(a[g]), count, block[g].scores + (p - block[g].first));
    }
    // Scaled after (the same multiply, so the same bits): the loop above keeps one register
    // fewer live, and measured faster (GCC still spills one accumulator there).
    for (int g = 0; g < kQueryBlock; ++g) {
        float* scores = block[g].scores + (begin - block[g].first);
        int64_t i = 0;
        for (; i + 8 <= end - begin; i += 8)
            _mm256_storeu_ps(scores + i, _mm256_mul_ps(_mm256_loadu_ps(scores + i), scale8));
        for (; i < end - begin; ++i) scores[i] *= scale;
    }
}

// sums[d, d + 8 NV) += w[p] v_p[d, d + 8 NV) over keys [begin, end) in key order, for
// kQueryBlock queries at once: each value row loaded once for all of them (values: column d on).
template <int NV>
static void block_weighted_values(const BlockQuery* block, const PagedRows& values, int64_t begin,
                                  int64_t end, int64_t d) {
    __m256 acc[kQueryBlock][NV];
    for (int g = 0; g < kQueryBlock; ++g)
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm256_loadu_ps(block[g].sums + d + 8 * c);
    for (int64_t p = begin; p < end; ++p) {
        __m256 weight[kQueryBlock];
        for (int g = 0; g < kQueryBlock; ++g)
            weight[g] = _mm256_set1_ps(block[g].scores[p - block[g].first]);
        const float* v = values.row(p);
        for (int c = 0; c < NV; ++c) {
            const __m256 vv = _mm256_loadu_ps(v + 8 * c);
            for (int g = 0; g < kQueryBlock; ++g)
                acc[g][c] = _mm256_fmadd_ps(weight[g], vv, acc[g][c]);
        }
    }
    for (int g = 0; g < kQueryBlock; ++g)
        for (int c = 0; c < NV; ++c) _mm256_storeu_ps(block[g].sums + d + 8 * c, acc[g][c]);
}

static void block_weighted_values_of(int64_t nv, const BlockQuery* block, const PagedRows& values,
                                     int64_t begin, int64_t end, int64_t d) {
    with_column_count(nv, [&](auto n) {
        block_weighted_values<decltype(n)::value>(block, values, begin, end, d);
    });
}

// The keys of tile [p, p + kKeyTile) that query g sees: [begin, end), empty where begin >= end.
struct KeyRange {
    int64_t begin, end;
};
static inline KeyRange tile_keys(const HeadQuery& query, int64_t p) {
    return {p > query.first_key ? p : query.first_key,
            p + kKeyTile < query.num_keys ? p + kKeyTile : query.num_keys};
}

// The keys of tile p that all of queries [g0, g0 + kQueryBlock) see; empty where there are not
// that many queries left, or nothing is shared.
static KeyRange shared_keys(const HeadQuery* queries, int64_t count, int64_t g0, int64_t p) {
    if (kQueryBlock == 1 || g0 + kQueryBlock > count) return {0, 0};
    KeyRange shared{p, p + kKeyTile};
    for (int64_t g = g0; g < g0 + kQueryBlock; ++g) {
        const KeyRange own = tile_keys(queries[g], p);
        shared.begin = own.begin > shared.begin ? own.begin : shared.begin;
        shared.end = own.end < shared.end ? own.end : shared.end;
    }
    return shared.begin < shared.end ? shared : KeyRange{0, 0};
}

// Scores (then soft-capped) of tile p for every query: blocks over their shared keys, the rest
// one query at a time. A key's score is the same whichever computes it.
static void tile_scores(const HeadQuery* queries, int64_t count, const QueryScratch& scratch,
                        ScoreForm form, const PagedRows& keys, int64_t p) {
    const int64_t D = scratch.D;
    for (int64_t g0 = 0; g0 < count; g0 += kQueryBlock) {
        const KeyRange shared = shared_keys(queries, count, g0, p);
        if (shared.begin < shared.end) {
            BlockQuery block[kQueryBlock];
            fill_block(queries, scratch, g0, block);
            block_key_scores(block, D, form.scale, keys, shared.begin, shared.end);
        }
        for (int64_t g = g0; g < g0 + kQueryBlock && g < count; ++g) {
            const int64_t f = queries[g].first_key;
            const KeyRange own = tile_keys(queries[g], p);
            if (own.begin >= own.end) continue;
            const PagedRows mine = from_key(keys, f);
            if (shared.begin < shared.end) {
                key_scores(queries[g].q, D, form.scale, mine, own.begin - f, shared.begin - f,
                           scratch.scores(g));
                key_scores(queries[g].q, D, form.scale, mine, shared.end - f, own.end - f,
                           scratch.scores(g));
            } else {
                key_scores(queries[g].q, D, form.scale, mine, own.begin - f, own.end - f,
                           scratch.scores(g));
            }
            if (form.softcap > 0)
                soft_cap(scratch.scores(g) + own.begin - f, own.end - own.begin, form.softcap);
        }
    }
}

// Value sums of tile p over columns [d, d + 8 nv) for every query, each in key order: a block's
// queries take their keys before the shared ones alone, then the shared ones together, then the
// rest alone.
static void tile_values(const HeadQuery* queries, int64_t count, const QueryScratch& scratch,
                        int64_t nv, const PagedRows& part, int64_t d, int64_t p) {
    for (int64_t g0 = 0; g0 < count; g0 += kQueryBlock) {
        const KeyRange shared = shared_keys(queries, count, g0, p);
        const bool blocked = shared.begin < shared.end;
        const int64_t end_g = g0 + kQueryBlock < count ? g0 + kQueryBlock : count;
        for (int64_t g = g0; g < end_g; ++g) {  // alone: all of the tile, or up to the shared keys
            const int64_t f = queries[g].first_key;
            const KeyRange own = tile_keys(queries[g], p);
            const int64_t end = blocked ? shared.begin : own.end;
            if (own.begin < end)
                weighted_values_of(nv, scratch.scores(g), from_key(part, f), own.begin - f, end - f,
                                   scratch.sums(g) + d);
        }
        if (!blocked) continue;
        BlockQuery block[kQueryBlock];
        fill_block(queries, scratch, g0, block);
        block_weighted_values_of(nv, block, part, shared.begin, shared.end, d);
        for (int64_t g = g0; g < end_g; ++g) {  // alone again: past the shared keys
            const int64_t f = queries[g].first_key;
            const KeyRange own = tile_keys(queries[g], p);
            if (shared.end < own.end)
                weighted_values_of(nv, scratch.scores(g), from_key(part, f), shared.end - f,
                                   own.end - f, scratch.sums(g) + d);
        }
    }
}
#endif

// Query heads of `kv_heads` KV heads: queries [h count, (h + 1) count) read KV head h, whose
// rows lie h D floats past keys.base and values.base. The heads go through each key tile in turn,
// so that the lines of a slot (its KV heads side by side) are read together. Past a few hundred
// keys a step's keys and values come from memory: with one KV head a call, a one-row decode at
// 1,700 keys read them 1.3x slower (attention_rows --from-memory). Each query's arithmetic is
// the same either way.
static void attend_heads(const HeadQuery* queries, int64_t count, int64_t kv_heads, int64_t D,
                         ScoreForm form, const PagedRows& keys, const PagedRows& values,
                         float* scratch) {
    const int64_t total = count * kv_heads;
    int64_t max_keys = 0, lowest = INT64_MAX, highest = 0;
    for (int64_t g = 0; g < total; ++g) {
        const HeadQuery& query = queries[g];
        max_keys = query.num_keys - query.first_key > max_keys ? query.num_keys - query.first_key
                                                               : max_keys;
        lowest = query.first_key < lowest ? query.first_key : lowest;
        highest = query.num_keys > highest ? query.num_keys : highest;
    }
    const int64_t stride = (max_keys + 7) / 8 * 8 + D + 8;  // scores, then sums, then 1 / total
    const auto head_rows = [&](const PagedRows& rows, int64_t h, int64_t d) {
        return PagedRows{rows.base + h * D + d, rows.slots, rows.slot_stride};
    };
#ifdef GGUF_KERNEL_X86_SIMD
    if (D % 8 == 0) {
        const auto mine = [&](int64_t h) {  // KV head h's queries' part of the scratch
            return QueryScratch{scratch + h * count * stride, stride, D};
        };
        const int64_t tiles_from = lowest / kKeyTile * kKeyTile;
        for (int64_t p = tiles_from; p < highest; p += kKeyTile) {
            for (int64_t h = 0; h < kv_heads; ++h)
                tile_scores(queries + h * count, count, mine(h), form, head_rows(keys, h, 0), p);
        }
        for (int64_t g = 0; g < total; ++g) {
            const QueryScratch own = mine(g / count);
            const int64_t i = g % count;
            *own.inverse_total(i) = 1.0f / softmax_numerators(
                own.scores(i), queries[g].num_keys - queries[g].first_key);
            for (int64_t d = 0; d < D; ++d) own.sums(i)[d] = 0.0f;
        }
        for (int64_t d = 0; d < D; d += 64) {  // 64 columns (8 registers) a pass over the values
            const int64_t nv = (D - d < 64 ? D - d : 64) / 8;
            for (int64_t p = tiles_from; p < highest; p += kKeyTile) {
                for (int64_t h = 0; h < kv_heads; ++h)
                    tile_values(queries + h * count, count, mine(h), nv, head_rows(values, h, d),
                                d, p);
            }
        }
        for (int64_t g = 0; g < total; ++g) {
            const QueryScratch own = mine(g / count);
            const __m256 inv = _mm256_set1_ps(*own.inverse_total(g % count));
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(queries[g].out + d,
                                 _mm256_mul_ps(_mm256_loadu_ps(own.sums(g % count) + d), inv));
        }
        return;
    }
#endif
    for (int64_t g = 0; g < total; ++g) {
        const int64_t f = queries[g].first_key, h = g / count;
        attend_head_scalar(queries[g].q, D, form, from_key(head_rows(keys, h, 0), f),
                           from_key(head_rows(values, h, 0), f), queries[g].num_keys - f,
                           scratch + g * stride, queries[g].out);
    }
}
