// What the extension's files share: the attention of one head and SiLU compiled for the widest
// instruction set this CPU runs (vec_ops.cpp), the raw-pointer forms of the matmuls and of the
// decoder layer's glue (cpu_ops.cpp) that the fused decoder stack (decoder_stack.cpp) calls, and
// each file's registration in the one extension module.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <torch/extension.h>

#include "isa.h"

// Where key/value p of a paged cache lives: slots[p] is its cache slot (block * block_size +
// offset, worked out once per request: a division per key and head cost as much as its
// arithmetic), slots are slot_stride floats apart, and base already points at the wanted KV head.
struct PagedRows {
    const float* base;
    const int64_t* slots;
    int64_t slot_stride;
    const float* row(int64_t p) const { return base + slots[p] * slot_stride; }
};

// One query head's attention: out = softmax(scale * q K^T) V over its keys first_key up to
// num_keys - 1 (a sliding window starts past 0).
struct HeadQuery {
    const float* q;
    float* out;
    int64_t first_key, num_keys;
};

// How scores are formed: s = scale * q . k, then, with softcap > 0, s = softcap tanh(s / softcap)
// (Gemma 2's logit soft-capping).
struct ScoreForm {
    float scale, softcap;
};

struct VecOps {
    // Query heads of kv_heads KV heads, `count` reading each (see attend_heads in
    // attention_blocks_impl.h; keys.base and values.base at the first of them), with a scratch
    // of attend_scratch_floats(count * kv_heads, max keys of one query, D) floats.
    void (*attend_heads)(const HeadQuery* queries, int64_t count, int64_t kv_heads, int64_t D,
                         ScoreForm form, const PagedRows& keys, const PagedRows& values,
                         float* scratch);
    void (*silu_mul_row)(const float* gate, const float* up, float* out, int64_t n);
    // torch.argmax of one row: the first of ties, the first NaN if any.
    int64_t (*argmax_row)(const float* x, int64_t n);
    // How many queries attend_heads takes at once where they share keys (1: one at a time).
    int64_t query_block;
};

// The kernels of variant `isa` (kAuto: the process's, float_isa()).
VecOps vec_ops(int64_t isa = kAuto);
inline int64_t attend_scratch_floats(int64_t count, int64_t max_keys, int64_t D) {
    return count * ((max_keys + 7) / 8 * 8 + D + 8);
}
void register_gguf_ops(pybind11::module& m);
void register_cpu_ops(pybind11::module& m);
void register_paged_attention(pybind11::module& m);
void register_decoder_stack(pybind11::module& m);

// gguf_cpu.cpp: y[N, M] (row stride y_stride) = x[N, K] (row stride x_stride) @ W^T for a
// single-format GGUF weight, or a repacked integer one (gguf_int8.cpp, reached by its type id).
void gguf_matmul_rows(const float* x, int64_t N, int64_t K, int64_t x_stride,
                      const torch::Tensor& packed, int64_t type, float* y, int64_t y_stride,
                      int64_t isa = -1);

// gguf_int8.cpp: the integer path for weights repacked in 16-row groups (int8_layout.h).
bool is_int8_type(int64_t type);
void int8_matmul_rows(const float* x, int64_t N, int64_t K, int64_t x_stride,
                      const torch::Tensor& weights, int64_t type, float* y, int64_t y_stride,
                      int64_t isa);
void register_int8_ops(pybind11::module& m);

// cpu_ops.cpp: a decoder layer's glue on raw float32 rows.
void rms_norm_rows(const float* x, int64_t rows, int64_t hidden, const float* weight, float eps,
                   float* out);
void rotary_rows(float* x, int64_t T, int64_t heads, int64_t s0, int64_t s1, int64_t D,
                 const int64_t* pos, const float* cos, const float* sin);

// A step's attention rows: for each query row (its index in the step's rows), where its
// request's key slots start in `slots` and which of them it sees: first_key up to num_keys - 1.
struct AttentionPlan {
    struct Row {
        int64_t index, slot_start, first_key, num_keys;
    };
    std::vector<Row> rows;
    std::vector<int64_t> slots;  // each request's cache slots, request after request
    std::vector<int64_t> request_rows;  // request s owns rows [request_rows[s], [s + 1])
    int64_t work = 0;            // sum over query rows of the keys each sees
};
// window > 0: a query at position p sees only the keys at p - window + 1 up to p.
AttentionPlan plan_attention(const torch::Tensor& token_index, const torch::Tensor& query_lens,
                             const torch::Tensor& context_lens, const torch::Tensor& block_tables,
                             int64_t num_cache_blocks, int64_t block_size, int64_t window = 0);
void attend(const AttentionPlan& plan, const float* q, int64_t q_row_stride, const float* k_cache,
            const float* v_cache, int64_t num_heads, int64_t num_kv_heads, int64_t D, float* out,
            int64_t out_row_stride, ScoreForm form, int64_t isa = kAuto);
// The scores of a head of size D unless the model says otherwise: 1 / sqrt(D), no soft-cap.
inline ScoreForm score_form(int64_t D, double scale, double softcap) {
    return {scale > 0 ? (float)scale : 1.0f / std::sqrt((float)D), (float)softcap};
}
