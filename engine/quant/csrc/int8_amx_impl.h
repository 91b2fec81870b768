// The integer matmul on AMX-INT8 tiles (Sapphire Rapids and later), included once by
// gguf_int8.cpp inside its own namespace under `#pragma GCC target("amx-tile,amx-int8,...")`, after
// the AVX-512 VNNI body (int8_kernels_impl.h with INT8_ISA 2), whose helpers it shares. No include
// guard, no system headers.
//
// One tile multiply (tdpbssd, int8 x int8 -> int32) gives a block's exact integer sums for up to
// 16 activation rows against a group's 16 weight rows at once; VNNI needs 8 multiply-adds per row
// for the same. The tile operands need no reshuffling: an activation row's block is 32 contiguous
// bytes (A: one tile row per activation row), and a group's quant vector c already holds, in lane
// r, row r's weights 4c..4c+3 (int8_layout.h), which is tile B's layout for k = 4c..4c+3 (Q4's high
// nibbles, weights 16 + 4c + j, are B's rows 4 + c). The float part then follows the canonical
// order exactly as the VNNI body does, so the result is bitwise the other variants'.

// Tile numbers (macros: GCC pastes them into the instruction text). Two sets, so that block b + 1's
// tile multiply runs while block b's sums go through the float part: each set has C, the integer
// sums [rows, 16 int32]; A, the activation blocks [rows, 32 int8]; B, a block of the group's
// weights [8 rows of 4-value groups, 16 lanes x 4 int8]. Undefined at the end of this file.
#define SUMS_0 0
#define ACTIVATIONS_0 1
#define WEIGHTS_0 2
#define SUMS_1 3
#define ACTIVATIONS_1 4
#define WEIGHTS_1 5

struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];  // bytes per row of each tile
    uint8_t rows[16];
    uint8_t reserved_tail[16];
};

// Tiles are per-thread state: each range a thread runs configures them for its row count and
// releases them after, so nothing else on the thread (oneDNN's own AMX kernels) is disturbed.
static inline void configure_tiles(int rows) {
    TileConfig config = {};
    config.palette_id = 1;
    for (int set = 0; set < 2; ++set) {
        config.rows[3 * set] = (uint8_t)rows;  // sums
        config.colsb[3 * set] = 64;
        config.rows[3 * set + 1] = (uint8_t)rows;  // activations
        config.colsb[3 * set + 1] = 32;
        config.rows[3 * set + 2] = 8;  // weights
        config.colsb[3 * set + 2] = 64;
    }
    _tile_loadconfig(&config);
}

// A Q4 group's nibbles widened to bytes for every block, tile B's layout: per block the low
// nibbles' 4 vectors, then the high ones' (weights 16 + 4c + j). Done for the whole group before
// its first tile load: a tile load of bytes still in the store buffer waits for them to drain
// (measured: widening each block just before its multiply cost 3x the multiplies themselves).
static void widen_group(const uint8_t* group, int64_t num_blocks, int64_t block_bytes,
                        int64_t qs_offset, int8_t* widened) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < num_blocks; ++b)
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(group + b * block_bytes + qs_offset + 64 * c);
            int8_t* out = widened + 512 * b;
            _mm512_storeu_si512(out + 64 * c, _mm512_and_si512(v, low));
            _mm512_storeu_si512(out + 64 * (4 + c), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
}

// One block's exact integer sums, [rows, 16] int32 into `sums`, on tile set SET.
#define BLOCK_SUMS(SET, weights, activations, K, sums)              \
    do {                                                            \
        _tile_loadd(WEIGHTS_##SET, weights, 64);                    \
        _tile_zero(SUMS_##SET);                                     \
        _tile_loadd(ACTIVATIONS_##SET, activations, K);             \
        _tile_dpbssd(SUMS_##SET, ACTIVATIONS_##SET, WEIGHTS_##SET); \
        _tile_stored(SUMS_##SET, sums, 64);                         \
    } while (0)

// acc[r] over every block for activation rows n0 .. n0 + R - 1 (R <= 16) and one group's 16 rows.
template <int R>
static void group_tiles(int64_t type, const uint8_t* group, int64_t num_blocks, const Int8Rows& x,
                        int64_t n0, float* y, int64_t y_stride, int8_t* widened) {
    const bool q4 = type != kQ8_0x16, q4_1 = type == kQ4_1x16;
    const int64_t block_bytes = group_block_bytes(type);
    const int64_t qs_offset = q4_1 ? kQ4_1QsOffset : kQ4_0QsOffset;
    alignas(64) int32_t isums[2][16 * 16];  // tile C of each set, stored
    const int8_t* activations = x.q + n0 * x.K;
    if (q4) widen_group(group, num_blocks, block_bytes, qs_offset, widened);
    auto issue = [&](int64_t b) {  // block b's sums into isums[b % 2]
        const uint8_t* block = group + b * block_bytes;
        prefetch_ahead(block, block_bytes);
        const void* weights = q4 ? (const void*)(widened + 512 * b) : block + kQ8_0QsOffset;
        if (b % 2 == 0)
            BLOCK_SUMS(0, weights, activations + b * 32, x.K, isums[0]);
        else
            BLOCK_SUMS(1, weights, activations + b * 32, x.K, isums[1]);
    };
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    issue(0);
    for (int64_t b = 0; b < num_blocks; ++b) {
        if (b + 1 < num_blocks) issue(b + 1);
        const uint8_t* block = group + b * block_bytes;
        const int32_t* sums = isums[b % 2];
        const __m512 d_w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)block));
        const __m512 m_w = q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + 32)))
                                : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
            const int64_t n = n0 + r;
            __m512i isum = _mm512_load_si512(sums + 16 * r);
            if (q4 && !q4_1)  // Q4_0: the nibbles stand for q - 8
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * x.sum[n * num_blocks + b]));
            const __m512 product = _mm512_mul_ps(d_w, _mm512_set1_ps(x.d[n * num_blocks + b]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), product));
            if (q4_1)
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(m_w, _mm512_set1_ps(x.s[n * num_blocks + b])));
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}

template <int R>
static void tiles_for_rows(int64_t type, const uint8_t* weights, int64_t group_bytes,
                           int64_t num_blocks, const Int8Rows& x, int64_t n0, float* y,
                           int64_t y_stride, int64_t g_begin, int64_t g_end) {
    configure_tiles(R);
    // 512 bytes a block: 24 KB for a 1536-wide row, kept by the thread from call to call.
    thread_local std::vector<int8_t> widened;
    widened.resize(512 * num_blocks);
    for (int64_t g = g_begin; g < g_end; ++g)
        group_tiles<R>(type, weights + g * group_bytes, num_blocks, x, n0, y + 16 * g, y_stride,
                       widened.data());
}

// Below this many rows a chunk runs faster on the VNNI body (tile set-up and Q4's nibble
// widening are paid per chunk): a 17-row call as 16 rows on tiles and 1 on VNNI took 111 us
// where 16 + 1 on tiles took 121 (Q4_1, 1536 x 576, the Xeon). Bitwise the same either way.
constexpr int64_t kTileMinRows = 8;

// Output columns [16 g_begin, 16 g_end) of every activation row, 16 rows a tile.
void matmul_groups_amx(int64_t type, const uint8_t* weights, int64_t group_bytes,
                       int64_t num_blocks, const Int8Rows& x, int64_t N, float* y,
                       int64_t y_stride, int64_t g_begin, int64_t g_end) {
    using Kernel = void (*)(int64_t, const uint8_t*, int64_t, int64_t, const Int8Rows&, int64_t,
                            float*, int64_t, int64_t, int64_t);
    static constexpr Kernel kernels[16] = {
        tiles_for_rows<1>, tiles_for_rows<2>, tiles_for_rows<3>, tiles_for_rows<4>,
        tiles_for_rows<5>, tiles_for_rows<6>, tiles_for_rows<7>, tiles_for_rows<8>,
        tiles_for_rows<9>, tiles_for_rows<10>, tiles_for_rows<11>, tiles_for_rows<12>,
        tiles_for_rows<13>, tiles_for_rows<14>, tiles_for_rows<15>, tiles_for_rows<16>};
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t rows = std::min<int64_t>(16, N - n0);
        if (rows < kTileMinRows) {  // a short last chunk (17 rows: 16 + 1): the VNNI body
            for (int64_t g = g_begin; g < g_end; ++g)
                for (int64_t r0 = n0; r0 < N; r0 += kRowChunk)
                    group_rows(type, weights + g * group_bytes, num_blocks, x, r0,
                               std::min<int64_t>(kRowChunk, N - r0), y + r0 * y_stride + 16 * g,
                               y_stride);
            continue;
        }
        kernels[rows - 1](type, weights, group_bytes, num_blocks, x, n0, y + n0 * y_stride,
                          y_stride, g_begin, g_end);
    }
    _tile_release();
}

#undef BLOCK_SUMS
#undef SUMS_0
#undef ACTIVATIONS_0
#undef WEIGHTS_0
#undef SUMS_1
#undef ACTIVATIONS_1
#undef WEIGHTS_1
