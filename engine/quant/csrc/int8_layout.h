// The integer path's data: GGUF weights repacked in groups of 16 rows, and activation rows
// quantized into 32-value int8 blocks, as llama.cpp pairs them (Q8_1 with Q4_1, Q8_0 with Q4_0
// and Q8_0).
//
// A repacked weight keeps the GGUF tensor's shape [M, row_bytes] and byte count; only the order of
// the bytes of each group of 16 rows (M % 16 == 0) changes. Per group, block by block:
//   Q4_0x16 (288 bytes = 16 x 18): fp16 d[16] | 4 x 64 bytes of quants
//   Q4_1x16 (320 bytes = 16 x 20): fp16 d[16] | fp16 m[16] | 4 x 64 bytes of quants
//   Q8_0x16 (544 bytes = 16 x 34): fp16 d[16] | 8 x 64 bytes of quants
// Quant vector c holds, in 4-byte lane r, row r's bytes 4c..4c+3 of the block's quants: for
// Q4_0/Q4_1 weights 4c+j (low nibbles) and 16+4c+j (high nibbles), for Q8_0 weight 4c+j.
// (A Q4_0 nibble q stands for q - 8: its integer sum is sum(q x) - 8 sum(x), exact.) One
// multiply-add of a vector against 4 broadcast activation bytes then serves all 16 rows.
//
// The canonical order, per output (weight row w, activation row n), that every variant follows:
//   acc = 0
//   for each block b:  p = d_w * d_x;  acc = acc + float(isum) * p
//                      (Q4_1 only)     acc = acc + m_w * s_x
// where isum is the exact integer sum of the block's 32 products, d_x the activation block's scale
// and s_x its scaled sum of quants (Int8Rows). Plain float32 multiplies and adds, never fused
// (this file's code is compiled with -ffp-contract=off), so the torch reference
// (engine/quant/int8.py) computes bitwise the same.
#pragma once

#include <cstdint>

// Not GGUF ids (those end below 100): repacked Q4_0, Q4_1, Q8_0.
constexpr int64_t kQ4_0x16 = 1002;
constexpr int64_t kQ4_1x16 = 1003;
constexpr int64_t kQ8_0x16 = 1008;
constexpr int64_t kQ4_0GroupBlockBytes = 16 * 18;
constexpr int64_t kQ4_1GroupBlockBytes = 16 * 20;
constexpr int64_t kQ8_0GroupBlockBytes = 16 * 34;
constexpr int64_t kQ4_0QsOffset = 32;
constexpr int64_t kQ4_1QsOffset = 64;
constexpr int64_t kQ8_0QsOffset = 32;

// Activation rows [N, K] quantized per 32-value block as llama.cpp does on x86:
// q = round_half_even(x * (127 / max|x|)) (q = 0 where the block is all zero), d_x = max|x| / 127
// and s_x = d_x * sum(q), each rounded to fp16 (the fields of GGUF's Q8_0 and Q8_1 blocks).
struct Int8Rows {
    const int8_t* q;    // [N, K]
    int64_t K;
    const float* d;     // [N, K / 32] d_x (an fp16 value)
    const float* s;     // [N, K / 32] s_x (an fp16 value)
    const int32_t* sum; // [N, K / 32] sum of the block's quants
};
