// Fused float32 CPU operations of a decoder layer, for the few-token steps of decoding and
// verification. At batch 1 a layer's glue (norms, rotary, KV write, attention, SiLU) is ~150
// small torch ops at a few microseconds of dispatch each, more than its 4-bit matmuls cost;
// here each is one call. The torch code in engine/models and engine/attention is the reference
// these are tested against (tests/engine/quant/test_cpu_ops.py) and the path on other devices.
#include <torch/extension.h>

#include <ATen/Parallel.h>

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
// it all: about 10 us of work at batch 1, less than the other thread's share would save.
constexpr int64_t kParallelAttentionWork = 1 << 16;

}  // namespace

// out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps), in float32 like the reference RMSNorm.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
    check_float_rows(x, "x");
    check_float_rows(weight, "weight");
    const int64_t hidden = weight.numel();
    TORCH_CHECK(x.size(-1) == hidden, "x's last dimension must equal the weight's size");
    auto out = torch::empty_like(x);
    const int64_t rows = x.numel() / hidden;
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + r * hidden;
        float sum = 0.0f;
        for (int64_t i = 0; i < hidden; ++i) sum += xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt(sum / (float)hidden + (float)eps);
        float* orow = op + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) orow[i] = wp[i] * (xr[i] * inv);
    }
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

// In place on q [T, Hq, D] and k [T, Hk, D] (views with unit stride in D): rotary embedding in
// the two-halves layout, x * cos + rotate_half(x) * sin, cos/sin tables [max_pos, D].
void rotary_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos,
             const torch::Tensor& sin, const torch::Tensor& positions) {
    check_float_rows(cos, "cos");
    check_float_rows(sin, "sin");
    TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous(),
                "positions must be contiguous int64");
    const int64_t T = q.size(0), D = q.size(2), half = D / 2;
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    for (torch::Tensor* t : {&q, &k}) {
        TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->stride(2) == 1 && t->size(2) == D,
                    "q and k must be float32 [T, heads, head_dim] with unit stride in head_dim");
        float* base = t->data_ptr<float>();
        const int64_t heads = t->size(1), s0 = t->stride(0), s1 = t->stride(1);
        for (int64_t i = 0; i < T; ++i) {
            const float* c = cp + pos[i] * D;
            const float* s = sp + pos[i] * D;
            for (int64_t h = 0; h < heads; ++h) {
                float* x = base + i * s0 + h * s1;
                for (int64_t j = 0; j < half; ++j) {
                    const float a = x[j], b = x[j + half];
                    x[j] = a * c[j] - b * s[j];
                    x[j + half] = b * c[j + half] + a * s[j + half];
                }
            }
        }
    }
}

// Paged attention for requests with a few new tokens each (decode, draft verification).
// q [T, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hk, D] already holding this step's KV;
// request s owns query rows token_index[s, :query_lens[s]] at positions
// context_lens[s] - query_lens[s] + r, and sees keys at positions up to its own.
// Writes out[token_index[s, r]] for every real row; other rows of out are left untouched.
void paged_attention_small(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& token_index,
                           const torch::Tensor& query_lens, const torch::Tensor& context_lens,
                           const torch::Tensor& block_tables, torch::Tensor& out) {
    check_float_rows(q, "q");
    check_float_rows(k_cache, "k_cache");
    check_float_rows(v_cache, "v_cache");
    check_float_rows(out, "out");
    for (const torch::Tensor* t : {&token_index, &query_lens, &context_lens, &block_tables})
        TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(),
                    "index tensors must be contiguous int64");
    const int64_t num_heads = q.size(1), D = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_seqs = token_index.size(0), max_q = token_index.size(1);
    const int64_t max_blocks = block_tables.size(1);
    const float scale = 1.0f / std::sqrt((float)D);
    const float* qp = q.data_ptr<float>();
    const float* kp = k_cache.data_ptr<float>();
    const float* vp = v_cache.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t* rows = token_index.data_ptr<int64_t>();
    const int64_t* qlens = query_lens.data_ptr<int64_t>();
    const int64_t* ctxs = context_lens.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t slot_stride = num_kv_heads * D;  // floats between consecutive cache slots
    for (int64_t s = 0; s < num_seqs; ++s)
        TORCH_CHECK(qlens[s] >= 1 && qlens[s] <= max_q && qlens[s] <= ctxs[s] &&
                        ctxs[s] <= max_blocks * block_size,
                    "attention metadata of request ", s, " does not fit its tensors");
    const VecOps ops = vec_ops();
    // Work items are (query row, head) pairs, each computed whole by one thread, so a row's
    // result never depends on how the items were split. Splitting costs a few microseconds
    // (more where the other thread sleeps): worth it only for enough multiply-adds.
    std::vector<std::pair<int64_t, int64_t>> row_owner;  // (request, row within it)
    std::vector<int64_t> slot_start(num_seqs + 1, 0), slots;  // each request's key slots
    int64_t work = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t r = 0; r < qlens[s]; ++r) row_owner.emplace_back(s, r);
        work += qlens[s] * ctxs[s];
        for (int64_t p = 0; p < ctxs[s]; p += block_size) {
            const int64_t block = tables[s * max_blocks + p / block_size];
            TORCH_CHECK(block >= 0 && block < k_cache.size(0), "block ", block, " out of range");
            for (int64_t j = 0; j < block_size && p + j < ctxs[s]; ++j)
                slots.push_back(block * block_size + j);
        }
        slot_start[s + 1] = (int64_t)slots.size();
    }
    const int64_t items = (int64_t)row_owner.size() * num_heads;
    const int64_t grain = work * num_heads * D < kParallelAttentionWork ? items : 1;
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> scores;
        for (int64_t item = begin; item < end; ++item) {
            const auto [s, r] = row_owner[item / num_heads];
            const int64_t h = item % num_heads, kvh = h / group;
            const int64_t row = rows[s * max_q + r];
            const int64_t num_keys = ctxs[s] - qlens[s] + r + 1;  // up to this row's position
            if ((int64_t)scores.size() < num_keys) scores.resize(num_keys);
            const int64_t* request_slots = slots.data() + slot_start[s];
            ops.attend_head(qp + (row * num_heads + h) * D, D, scale,
                            PagedRows{kp + kvh * D, request_slots, slot_stride},
                            PagedRows{vp + kvh * D, request_slots, slot_stride}, num_keys,
                            scores.data(), op + (row * num_heads + h) * D);
        }
    });
}

// One decoder layer of a decode or verify step, in place on the residual stream x [T, hidden]:
//   x += o_proj(attention(rotary(qkv_proj(rms_norm(x)))))
//   x += down_proj(silu_mul(gate_up_proj(rms_norm(x))))
// with every projection a single-format GGUF weight. The same arithmetic as the Python layer
// over the functions above, minus ~30 tensor ops and module calls of Python dispatch per layer.
// Valid when every request of the step is in the short-query group (no prefill chunk).
void decoder_layer(torch::Tensor& x, const torch::Tensor& positions,
                   const torch::Tensor& input_norm, const torch::Tensor& post_attention_norm,
                   double eps, const torch::Tensor& qkv, int64_t qkv_type,
                   const c10::optional<torch::Tensor>& qkv_bias, const torch::Tensor& o,
                   int64_t o_type, const c10::optional<torch::Tensor>& o_bias,
                   const torch::Tensor& gate_up, int64_t gate_up_type, const torch::Tensor& down,
                   int64_t down_type, const torch::Tensor& cos, const torch::Tensor& sin,
                   const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& slot_mapping, const torch::Tensor& token_index,
                   const torch::Tensor& query_lens, const torch::Tensor& context_lens,
                   const torch::Tensor& block_tables, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim) {
    check_float_rows(x, "x");
    const int64_t T = x.size(0);
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == T,
                "slot_mapping must be contiguous int64 with one slot per token");
    TORCH_CHECK(k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim,
                "KV cache shape does not match the heads");

    auto projected = gguf_matmul(rms_norm(x, input_norm, eps), qkv, qkv_type);  // [T, q+2kv]
    if (qkv_bias) projected.add_(*qkv_bias);
    auto q = projected.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    auto k = projected.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    rotary_(q, k, cos, sin, positions);

    // The new tokens' keys and values into their cache slots.
    const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    float* k_base = k_cache.data_ptr<float>();
    float* v_base = v_cache.data_ptr<float>();
    const float* rows = projected.data_ptr<float>();
    const int64_t row_stride = projected.size(1);
    for (int64_t t = 0; t < T; ++t) {
        TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
        const float* row = rows + t * row_stride;
        std::memcpy(k_base + slots[t] * kv_size, row + q_size, kv_size * sizeof(float));
        std::memcpy(v_base + slots[t] * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
    }

    auto attended = torch::empty({T, num_heads, head_dim}, x.options());
    paged_attention_small(q.contiguous(), k_cache, v_cache, token_index, query_lens,
                          context_lens, block_tables, attended);
    auto attention_out = gguf_matmul(attended.view({T, q_size}), o, o_type);
    if (o_bias) attention_out.add_(*o_bias);
    x.add_(attention_out);

    auto mlp_in = rms_norm(x, post_attention_norm, eps);
    x.add_(gguf_matmul(silu_mul(gguf_matmul(mlp_in, gate_up, gate_up_type)), down, down_type));
}

// Every function below releases the GIL while it runs (they touch no Python object): the
// server's event loop thread streams tokens while the engine thread is in a layer.
void register_cpu_ops(pybind11::module& m) {
    m.def("decoder_layer", &decoder_layer, py::call_guard<py::gil_scoped_release>(), "one fused decoder layer of a decode/verify step");
    m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "weight * x / rms(x)", py::arg("x"), py::arg("weight"),
          py::arg("eps"));
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
