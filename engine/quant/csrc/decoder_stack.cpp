// A decode or verify step's decoder layers in one call, with the weights held here.
//
// At batch 1 on CPU a layer's matmuls take ~50 us and its glue (norms, rotary, KV write,
// attention, SiLU, residual adds) a few more; one Python-to-C++ call per layer with 27 arguments,
// and ~12 torch tensor ops inside it, cost as much again. Here the weights are bound once, the
// step passes its metadata once, every layer works on raw rows in buffers kept between steps,
// and the attention plan (which keys each query row sees) is worked out once for all layers.
//
// The arithmetic is the Python layer's (engine/models/llama.py) operation for operation: the same
// kernels, the same float32 operations in the same order (tests/engine/quant/test_cpu_ops.py
// compares them), and each row's result depends only on that row, so a verify row computes bit for
// bit what a decode step computes at its position.
#include <torch/extension.h>

#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "vec_ops.h"

namespace {

struct Projection {
    torch::Tensor weight;  // GGUF rows, or integer-path rows repacked in 16-row groups
    int64_t type;
    c10::optional<torch::Tensor> bias;
};

struct Layer {
    torch::Tensor input_norm, post_attention_norm;
    Projection qkv, o, gate_up, down;
};

// (input_norm, post_attention_norm, qkv, qkv type, qkv bias, o, o type, o bias, gate_up,
//  gate_up type, down, down type): llama.py's DecoderLayer.fused_weights() minus eps.
using LayerWeights = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t,
                                c10::optional<torch::Tensor>, torch::Tensor, int64_t,
                                c10::optional<torch::Tensor>, torch::Tensor, int64_t,
                                torch::Tensor, int64_t>;

void check_floats(const torch::Tensor& t, int64_t numel, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                    (numel < 0 || t.numel() == numel),
                name, " must be a contiguous CPU float32 tensor", numel < 0 ? "" : " of the layer's size");
}

void check_longs(const torch::Tensor& t, int64_t numel, const char* name) {
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous() && t.numel() == numel, name,
                " must be contiguous int64 with one entry per token");
}

Projection projection(const torch::Tensor& weight, int64_t type,
                      const c10::optional<torch::Tensor>& bias, int64_t out_features,
                      const char* name) {
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == out_features, name, " has ",
                weight.size(0), " output rows, expected ", out_features);
    if (bias) check_floats(*bias, out_features, name);
    return {weight, type, bias};
}

// y[T, M] = x[T, K] W^T (+ bias): rows packed, M and K their widths.
void project(const Projection& p, const float* x, int64_t T, int64_t K, float* y) {
    const int64_t M = p.weight.size(0);
    gguf_matmul_rows(x, T, K, K, p.weight, p.type, y, M);
    if (!p.bias) return;
    const float* b = p.bias->data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < M; ++j) y[t * M + j] += b[j];
}

void add_into(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace

class DecoderStack {
  public:
    // sliding_window > 0: every layer attends to that many keys at most (Mistral).
    DecoderStack(const std::vector<LayerWeights>& layers, double eps, torch::Tensor cos,
                 torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t sliding_window)
        : eps_((float)eps), cos_(std::move(cos)), sin_(std::move(sin)), num_heads_(num_heads),
          num_kv_heads_(num_kv_heads), head_dim_(head_dim), sliding_window_(sliding_window) {
        TORCH_CHECK(!layers.empty() && num_heads % num_kv_heads == 0 && sliding_window >= 0,
                    "bad stack shape");
        check_floats(cos_, -1, "cos");
        check_floats(sin_, -1, "sin");
        TORCH_CHECK(cos_.sizes() == sin_.sizes() && cos_.dim() == 2 && cos_.size(1) == head_dim,
                    "cos and sin must be [max_positions, head_dim]");
        hidden_ = std::get<0>(layers[0]).numel();
        const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
        intermediate_ = std::get<8>(layers[0]).size(0) / 2;
        for (const auto& w : layers) {
            Layer layer;
            layer.input_norm = std::get<0>(w);
            layer.post_attention_norm = std::get<1>(w);
            check_floats(layer.input_norm, hidden_, "input_norm");
            check_floats(layer.post_attention_norm, hidden_, "post_attention_norm");
            layer.qkv = projection(std::get<2>(w), std::get<3>(w), std::get<4>(w),
                                   q_size + 2 * kv_size, "qkv");
            layer.o = projection(std::get<5>(w), std::get<6>(w), std::get<7>(w), hidden_, "o");
            layer.gate_up = projection(std::get<8>(w), std::get<9>(w), c10::nullopt,
                                       2 * intermediate_, "gate_up");
            layer.down = projection(std::get<10>(w), std::get<11>(w), c10::nullopt, hidden_,
                                    "down");
            layers_.push_back(std::move(layer));
        }
    }

    // In place on the residual stream x [T, hidden]: the layers `layer_ids` (all when empty), in
    // that order. kv [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] (KVCache's
    // storage); every request of the step is in the short-query group (no prefill chunk).
    void run(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& kv,
             const torch::Tensor& slot_mapping, const torch::Tensor& token_index,
             const torch::Tensor& query_lens, const torch::Tensor& context_lens,
             const torch::Tensor& block_tables, const std::vector<int64_t>& layer_ids) {
        check_floats(x, -1, "x");
        TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_, "x must be [tokens, hidden]");
        const int64_t T = x.size(0), num_layers = (int64_t)layers_.size();
        check_longs(positions, T, "positions");
        check_longs(slot_mapping, T, "slot_mapping");
        check_floats(kv, -1, "the KV cache");
        TORCH_CHECK(kv.dim() == 6 && kv.size(0) == num_layers && kv.size(1) == 2 &&
                        kv.size(4) == num_kv_heads_ && kv.size(5) == head_dim_,
                    "the KV cache must be [layers, 2, blocks, block_size, kv_heads, head_dim]");
        const int64_t num_slots = kv.size(2) * kv.size(3);
        const int64_t* pos = positions.data_ptr<int64_t>();
        const int64_t* slots = slot_mapping.data_ptr<int64_t>();
        for (int64_t t = 0; t < T; ++t) {
            TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
            TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "position ", pos[t], " out of range");
        }
        const AttentionPlan plan = plan_attention(token_index, query_lens, context_lens,
                                                  block_tables, kv.size(2), kv.size(3),
                                                  sliding_window_);
        for (const AttentionPlan::Row& row : plan.rows)
            TORCH_CHECK(row.index >= 0 && row.index < T, "token index ", row.index, " out of range");
        for (int64_t id : layer_ids)
            TORCH_CHECK(id >= 0 && id < num_layers, "layer ", id, " out of range");
        grow_buffers(T);
        float* xs = x.data_ptr<float>();
        float* cache = kv.data_ptr<float>();
        if (layer_ids.empty())
            for (int64_t i = 0; i < num_layers; ++i) run_layer(i, xs, T, pos, slots, plan, cache, kv);
        for (int64_t i : layer_ids) run_layer(i, xs, T, pos, slots, plan, cache, kv);
    }

  private:
    void grow_buffers(int64_t T) {
        const int64_t q_size = num_heads_ * head_dim_;
        const int64_t qkv_width = layers_[0].qkv.weight.size(0);
        const std::pair<std::vector<float>*, int64_t> buffers[] = {
            {&normed_, hidden_},    {&qkv_, qkv_width},          {&attended_, q_size},
            {&projected_, hidden_}, {&gate_up_, 2 * intermediate_}, {&activated_, intermediate_}};
        for (const auto& [buffer, width] : buffers)
            if ((int64_t)buffer->size() < T * width) buffer->resize(T * width);
    }

    //   x += o_proj(attention(rotary(qkv_proj(rms_norm(x)))))
    //   x += down_proj(silu_mul(gate_up_proj(rms_norm(x))))
    void run_layer(int64_t i, float* x, int64_t T, const int64_t* pos, const int64_t* slots,
                   const AttentionPlan& plan, float* cache, const torch::Tensor& kv) {
        const Layer& layer = layers_[i];
        const int64_t D = head_dim_, q_size = num_heads_ * D, kv_size = num_kv_heads_ * D;
        const int64_t width = q_size + 2 * kv_size, I = intermediate_;
        float* qkv = qkv_.data();
        rms_norm_rows(x, T, hidden_, layer.input_norm.data_ptr<float>(), eps_, normed_.data());
        project(layer.qkv, normed_.data(), T, hidden_, qkv);
        const float* cos = cos_.data_ptr<float>();
        const float* sin = sin_.data_ptr<float>();
        rotary_rows(qkv, T, num_heads_, width, D, D, pos, cos, sin);
        rotary_rows(qkv + q_size, T, num_kv_heads_, width, D, D, pos, cos, sin);
        float* k_cache = cache + i * kv.stride(0);
        float* v_cache = k_cache + kv.stride(1);
        for (int64_t t = 0; t < T; ++t) {  // the new tokens' keys and values into their slots
            std::memcpy(k_cache + slots[t] * kv_size, qkv + t * width + q_size, kv_size * 4);
            std::memcpy(v_cache + slots[t] * kv_size, qkv + t * width + q_size + kv_size,
                        kv_size * 4);
        }
        attend(plan, qkv, width, k_cache, v_cache, num_heads_, num_kv_heads_, D, attended_.data(),
               q_size, score_form(D, 0.0, 0.0));
        project(layer.o, attended_.data(), T, q_size, projected_.data());
        add_into(x, projected_.data(), T * hidden_);

        rms_norm_rows(x, T, hidden_, layer.post_attention_norm.data_ptr<float>(), eps_,
                      normed_.data());
        project(layer.gate_up, normed_.data(), T, hidden_, gate_up_.data());
        const VecOps ops = vec_ops();
        for (int64_t t = 0; t < T; ++t)
            ops.silu_mul_row(gate_up_.data() + t * 2 * I, gate_up_.data() + t * 2 * I + I,
                             activated_.data() + t * I, I);
        project(layer.down, activated_.data(), T, I, projected_.data());
        add_into(x, projected_.data(), T * hidden_);
    }

    std::vector<Layer> layers_;
    float eps_;
    torch::Tensor cos_, sin_;
    int64_t num_heads_, num_kv_heads_, head_dim_, sliding_window_, hidden_ = 0, intermediate_ = 0;
    // Rows of one step, kept between steps: [T, hidden], [T, q + 2 kv], [T, q], [T, hidden],
    // [T, 2 intermediate], [T, intermediate].
    std::vector<float> normed_, qkv_, attended_, projected_, gate_up_, activated_;
};

void register_decoder_stack(pybind11::module& m) {
    pybind11::class_<DecoderStack>(m, "DecoderStack",
                                   "a decode/verify step's decoder layers in one call")
        .def(pybind11::init<const std::vector<LayerWeights>&, double, torch::Tensor,
                            torch::Tensor, int64_t, int64_t, int64_t, int64_t>(),
             py::arg("layers"), py::arg("eps"), py::arg("cos"), py::arg("sin"),
             py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
             py::arg("sliding_window") = 0)
        .def("run", &DecoderStack::run, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
             py::arg("positions"), py::arg("kv"), py::arg("slot_mapping"),
             py::arg("token_index"), py::arg("query_lens"), py::arg("context_lens"),
             py::arg("block_tables"), py::arg("layer_ids"));
}
