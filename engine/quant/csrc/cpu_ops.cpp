// Fused float32 CPU operations of a decoder layer, for the few-token steps of decoding and
// verification. At batch 1 a layer's glue (norms, rotary, KV write, attention, SiLU) is ~150
// small torch ops at a few microseconds of dispatch each, more than its 4-bit matmuls cost;
// here each is one call. The torch code in engine/models and engine/attention is the reference
// these are tested against (tests/engine/quant/test_cpu_ops.py) and the path on other devices.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "vec_ops.h"

namespace {

void check_float_rows(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
                name, " must be a contiguous CPU float32 tensor");
}

// Multiply-adds of attention (query rows x heads x keys x head_dim) below which one thread does
// it all (at 1 << 13, a batch-1 step splits from ~15 keys on; see git log for the figures).
constexpr int64_t kParallelAttentionWork = 1 << 13;

}  // namespace

// out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps), in float32 like the reference RMSNorm.
void rms_norm_rows(const float* x, int64_t rows, int64_t hidden, const float* weight, float eps,
                   float* out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * hidden;
        float sum = 0.0f;
        for (int64_t i = 0; i < hidden; ++i) sum += xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt(sum / (float)hidden + eps);
        float* orow = out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) orow[i] = weight[i] * (xr[i] * inv);
    }
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
    check_float_rows(x, "x");
    check_float_rows(weight, "weight");
    const int64_t hidden = weight.numel();
    TORCH_CHECK(x.size(-1) == hidden, "x's last dimension must equal the weight's size");
    auto out = torch::empty_like(x);
    rms_norm_rows(x.data_ptr<float>(), x.numel() / hidden, hidden, weight.data_ptr<float>(),
                  (float)eps, out.data_ptr<float>());
    return out;
}

// [T, 2I] (gate | up) -> [T, I] silu(gate) * up.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
    check_float_rows(gate_up, "gate_up");
    const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
    auto out = torch::empty({rows, width}, gate_up.options());
    const float* gp = gate_up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const VecOps ops = vec_ops();
    for (int64_t r = 0; r < rows; ++r)
        ops.silu_mul_row(gp + r * 2 * width, gp + r * 2 * width + width, op + r * width, width);
    return out;
}

// [N, V] -> int64 [N]: torch.argmax(x, dim=-1), bitwise (ties to the first, NaN first).
torch::Tensor argmax_rows(const torch::Tensor& x) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                    x.stride(1) == 1 && x.size(1) > 0,
                "x must be a CPU float32 [N, V] tensor with unit column stride and V > 0");
    const int64_t N = x.size(0), V = x.size(1), stride = x.stride(0);
    auto out = torch::empty({N}, torch::kLong);
    const float* xp = x.data_ptr<float>();
    int64_t* op = out.data_ptr<int64_t>();
    const VecOps ops = vec_ops();
    at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) op[r] = ops.argmax_row(xp + r * stride, V);
    });
    return out;
}

// [N, V] logits and [N, W] int32 grammar bitmask words (bit t % 32 of word t / 32 allows token
// t, W * 32 >= V) -> a new [N, V] tensor with every disallowed token at -inf: the torch path
// (unpack to [N, W, 32] int32, then masked_fill) moved ~1 MB of temporaries per row.
torch::Tensor mask_logits(const torch::Tensor& logits, const torch::Tensor& bitmask) {
    check_float_rows(logits, "logits");
    TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() &&
                    bitmask.dim() == 2 && logits.dim() == 2 && bitmask.size(0) == logits.size(0) &&
                    bitmask.size(1) * 32 >= logits.size(1),
                "bitmask must be contiguous int32 [rows, words] covering the logits' columns");
    const int64_t N = logits.size(0), V = logits.size(1), W = bitmask.size(1);
    auto out = torch::empty_like(logits);
    const float* in = logits.data_ptr<float>();
    const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
    float* o = out.data_ptr<float>();
    const float ninf = -std::numeric_limits<float>::infinity();
    // Up to 16 rows in one thread: measured on 2 cores, splitting them gained nothing
    // (89.7 vs 92.1 us), while 64 rows went from 385 to 216 us in two.
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            for (int64_t w = 0; w * 32 < V; ++w) {
                const uint32_t word = words[r * W + w];
                const int64_t base = r * V + w * 32, n = std::min<int64_t>(32, V - w * 32);
                if (word == 0xFFFFFFFFu) {
                    std::memcpy(o + base, in + base, n * sizeof(float));
                } else if (word == 0) {  // most words of a constrained row
                    std::fill(o + base, o + base + n, ninf);
                } else {
                    for (int64_t b = 0; b < n; ++b) o[base + b] = (word >> b) & 1u ? in[base + b] : ninf;
                }
            }
    });
    return out;
}

// [N, W] int32 grammar bitmask words -> int64 [N]: the one token a row allows, or -1 where it
// allows none or several (grammar/masks.py `known_next_tokens`).
torch::Tensor single_token_rows(const torch::Tensor& bitmask) {
    TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() &&
                    bitmask.dim() == 2, "bitmask must be contiguous int32 [rows, words]");
    const int64_t N = bitmask.size(0), W = bitmask.size(1);
    auto out = torch::full({N}, -1, torch::kLong);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < N; ++r) {
        int64_t token = -1;
        for (int64_t w = 0; w < W; ++w) {
            const uint32_t word = words[r * W + w];
            if (word == 0) continue;
            if (token >= 0 || (word & (word - 1)) != 0) {  // a second bit
                token = -2;
                break;
            }
            token = w * 32 + __builtin_ctz(word);
        }
        o[r] = token < 0 ? -1 : token;
    }
    return out;
}

// In place on `heads` vectors of D floats per token (token i's head h at x + i * s0 + h * s1):
// rotary embedding in the two-halves layout, x * cos + rotate_half(x) * sin, tables [max_pos, D].
void rotary_rows(float* x, int64_t T, int64_t heads, int64_t s0, int64_t s1, int64_t D,
                 const int64_t* pos, const float* cos, const float* sin) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < T; ++i) {
        const float* c = cos + pos[i] * D;
        const float* s = sin + pos[i] * D;
        for (int64_t h = 0; h < heads; ++h) {
            float* v = x + i * s0 + h * s1;
            for (int64_t j = 0; j < half; ++j) {
                const float a = v[j], b = v[j + half];
                v[j] = a * c[j] - b * s[j];
                v[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
    }
}

// In place on q [T, Hq, D] and k [T, Hk, D] (views with unit stride in D).
void rotary_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos,
             const torch::Tensor& sin, const torch::Tensor& positions) {
    check_float_rows(cos, "cos");
    check_float_rows(sin, "sin");
    TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous(),
                "positions must be contiguous int64");
    const int64_t D = q.size(2);
    for (torch::Tensor* t : {&q, &k}) {
        TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->stride(2) == 1 && t->size(2) == D,
                    "q and k must be float32 [T, heads, head_dim] with unit stride in head_dim");
        rotary_rows(t->data_ptr<float>(), t->size(0), t->size(1), t->stride(0), t->stride(1), D,
                    positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
    }
}

// Which query rows a step's requests own and where their keys are, from the attention metadata
// of requests with a few new tokens each (decode, draft verification): request s owns query rows
// token_index[s, :query_lens[s]] at positions context_lens[s] - query_lens[s] + r, and sees keys
// at positions up to its own. Worked out once per step: every layer shares it.
AttentionPlan plan_attention(const torch::Tensor& token_index, const torch::Tensor& query_lens,
                             const torch::Tensor& context_lens, const torch::Tensor& block_tables,
                             int64_t num_cache_blocks, int64_t block_size) {
    for (const torch::Tensor* t : {&token_index, &query_lens, &context_lens, &block_tables})
        TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(),
                    "index tensors must be contiguous int64");
    AttentionPlan plan;
    const int64_t num_seqs = token_index.size(0), max_q = token_index.size(1);
    const int64_t max_blocks = block_tables.size(1);
    const int64_t* rows = token_index.data_ptr<int64_t>();
    const int64_t* qlens = query_lens.data_ptr<int64_t>();
    const int64_t* ctxs = context_lens.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    std::vector<int64_t> slot_start(num_seqs + 1, 0);
    for (int64_t s = 0; s < num_seqs; ++s) {
        TORCH_CHECK(qlens[s] >= 1 && qlens[s] <= max_q && qlens[s] <= ctxs[s] &&
                        ctxs[s] <= max_blocks * block_size,
                    "attention metadata of request ", s, " does not fit its tensors");
        for (int64_t p = 0; p < ctxs[s]; p += block_size) {
            const int64_t block = tables[s * max_blocks + p / block_size];
            TORCH_CHECK(block >= 0 && block < num_cache_blocks, "block ", block, " out of range");
            for (int64_t j = 0; j < block_size && p + j < ctxs[s]; ++j)
                plan.slots.push_back(block * block_size + j);
        }
        slot_start[s + 1] = (int64_t)plan.slots.size();
        plan.request_rows.push_back((int64_t)plan.rows.size());
        for (int64_t r = 0; r < qlens[s]; ++r)
            plan.rows.push_back({rows[s * max_q + r], slot_start[s], ctxs[s] - qlens[s] + r + 1});
        plan.work += qlens[s] * ctxs[s];
    }
    plan.request_rows.push_back((int64_t)plan.rows.size());
    return plan;
}

// out[row, h] = softmax(q[row, h] K^T / sqrt(D)) V for every planned row and query head; q and out
// rows are row_stride floats apart (heads D apart), the caches [num_blocks, block_size, Hk, D].
void attend(const AttentionPlan& plan, const float* q, int64_t q_row_stride, const float* k_cache,
            const float* v_cache, int64_t num_heads, int64_t num_kv_heads, int64_t D, float* out,
            int64_t out_row_stride) {
    const int64_t group = num_heads / num_kv_heads, slot_stride = num_kv_heads * D;
    const float scale = 1.0f / std::sqrt((float)D);
    const VecOps ops = vec_ops();
    const int64_t num_seqs = (int64_t)plan.request_rows.size() - 1;
    // An item is a request's query heads on one KV head, sharing its key tiles: all its rows,
    // and the whole GQA group where that leaves every thread two items (else one head of it).
    // One thread computes an item, and a query's result never depends on the others in it
    // (attend_heads), so a row's result is the same however rows are batched. Splitting costs a
    // few microseconds: worth it only for enough multiply-adds.
    const int64_t heads_per_item =
        num_seqs * num_kv_heads >= 2 * at::get_num_threads() ? group : 1;
    const int64_t parts = group / heads_per_item;
    const int64_t items = num_seqs * num_kv_heads * parts;
    const int64_t grain = plan.work * num_heads * D < kParallelAttentionWork ? items : 1;
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> scratch;
        thread_local std::vector<HeadQuery> queries;
        for (int64_t item = begin; item < end; ++item) {
            const int64_t s = item / (num_kv_heads * parts), kvh = item / parts % num_kv_heads;
            const int64_t first_head = kvh * group + item % parts * heads_per_item;
            const int64_t row_begin = plan.request_rows[s], row_end = plan.request_rows[s + 1];
            queries.clear();
            int64_t max_keys = 0;
            for (int64_t r = row_begin; r < row_end; ++r) {
                const AttentionPlan::Row& row = plan.rows[r];
                max_keys = std::max(max_keys, row.num_keys);
                for (int64_t h = first_head; h < first_head + heads_per_item; ++h)
                    queries.push_back({q + row.index * q_row_stride + h * D,
                                       out + row.index * out_row_stride + h * D, row.num_keys});
            }
            const int64_t need = attend_scratch_floats((int64_t)queries.size(), max_keys, D);
            if ((int64_t)scratch.size() < need) scratch.resize(need);
            const int64_t* slots = plan.slots.data() + plan.rows[row_begin].slot_start;
            ops.attend_heads(queries.data(), (int64_t)queries.size(), D, scale,
                             PagedRows{k_cache + kvh * D, slots, slot_stride},
                             PagedRows{v_cache + kvh * D, slots, slot_stride}, scratch.data());
        }
    });
}

// q [T, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hk, D] already holding this step's KV.
// Writes out[token_index[s, r]] for every real row; other rows of out are left untouched.
void paged_attention_small(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& token_index,
                           const torch::Tensor& query_lens, const torch::Tensor& context_lens,
                           const torch::Tensor& block_tables, torch::Tensor& out) {
    check_float_rows(q, "q");
    check_float_rows(k_cache, "k_cache");
    check_float_rows(v_cache, "v_cache");
    check_float_rows(out, "out");
    const AttentionPlan plan = plan_attention(token_index, query_lens, context_lens, block_tables,
                                              k_cache.size(0), k_cache.size(1));
    const int64_t num_heads = q.size(1), D = q.size(2);
    attend(plan, q.data_ptr<float>(), num_heads * D, k_cache.data_ptr<float>(),
           v_cache.data_ptr<float>(), num_heads, k_cache.size(2), D, out.data_ptr<float>(),
           num_heads * D);
}

// Every function below releases the GIL while it runs (they touch no Python object): the
// server's event loop thread streams tokens while the engine thread is in a layer.
void register_cpu_ops(pybind11::module& m) {
    m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "weight * x / rms(x)", py::arg("x"), py::arg("weight"),
          py::arg("eps"));
    m.def("mask_logits", &mask_logits, py::call_guard<py::gil_scoped_release>(),
          "logits with every token the bitmask does not allow at -inf", py::arg("logits"),
          py::arg("bitmask"));
    m.def("single_token_rows", &single_token_rows, py::call_guard<py::gil_scoped_release>(),
          "per bitmask row, the one token it allows, or -1", py::arg("bitmask"));
    m.def("argmax_rows", &argmax_rows, py::call_guard<py::gil_scoped_release>(),
          "torch.argmax(x, dim=-1) of a float32 [N, V] tensor", py::arg("x"));
    m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>(), "silu(gate) * up of [T, 2I]", py::arg("gate_up"));
    m.def("rotary_", &rotary_, py::call_guard<py::gil_scoped_release>(), "rotary embedding in place on q and k", py::arg("q"),
          py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("positions"));
    m.def("paged_attention_small", &paged_attention_small, py::call_guard<py::gil_scoped_release>(),
          "paged attention of short queries over the KV cache", py::arg("q"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("token_index"), py::arg("query_lens"),
          py::arg("context_lens"), py::arg("block_tables"), py::arg("out"));
}
