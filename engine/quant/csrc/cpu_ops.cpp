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
// t, W * 32 >= V): every disallowed token at -inf, into a new tensor (mask_logits) or in place
// (mask_logits_, for callers that never read the raw logits again: a free-text row of a JSON
// string allows nearly every word, and is then mostly left as it is). The torch path (unpack to
// [N, W, 32] int32, then masked_fill) moved ~1 MB of temporaries per row.
namespace {

void check_bitmask(const torch::Tensor& logits, const torch::Tensor& bitmask) {
    check_float_rows(logits, "logits");
    TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() &&
                    bitmask.dim() == 2 && logits.dim() == 2 && bitmask.size(0) == logits.size(0) &&
                    bitmask.size(1) * 32 >= logits.size(1),
                "bitmask must be contiguous int32 [rows, words] covering the logits' columns");
}

// out may be in: then allowed words are not touched.
void mask_rows(const float* in, const uint32_t* words, int64_t N, int64_t V, int64_t W, float* out) {
    const float ninf = -std::numeric_limits<float>::infinity();
    // Up to 16 rows in one thread: measured on 2 cores, splitting them gained nothing
    // (89.7 vs 92.1 us), while 64 rows went from 385 to 216 us in two.
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
            for (int64_t w = 0; w * 32 < V; ++w) {
                const uint32_t word = words[r * W + w];
                const int64_t base = r * V + w * 32, n = std::min<int64_t>(32, V - w * 32);
                if (word == 0xFFFFFFFFu) {
                    if (out != in) std::memcpy(out + base, in + base, n * sizeof(float));
                } else if (word == 0) {  // most words of a constrained row
                    std::fill(out + base, out + base + n, ninf);
                } else {
                    for (int64_t b = 0; b < n; ++b) out[base + b] = (word >> b) & 1u ? in[base + b] : ninf;
                }
            }
    });
}

const uint32_t* bitmask_words(const torch::Tensor& bitmask) {
    return reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
}

}  // namespace

torch::Tensor mask_logits(const torch::Tensor& logits, const torch::Tensor& bitmask) {
    check_bitmask(logits, bitmask);
    auto out = torch::empty_like(logits);
    mask_rows(logits.data_ptr<float>(), bitmask_words(bitmask), logits.size(0), logits.size(1),
              bitmask.size(1), out.data_ptr<float>());
    return out;
}

void mask_logits_(torch::Tensor& logits, const torch::Tensor& bitmask) {
    check_bitmask(logits, bitmask);
    float* x = logits.data_ptr<float>();
    mask_rows(x, bitmask_words(bitmask), logits.size(0), logits.size(1), bitmask.size(1), x);
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

// Every function below releases the GIL while it runs (they touch no Python object): the
// server's event loop thread streams tokens while the engine thread is in a layer.
void register_cpu_ops(pybind11::module& m) {
    m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "weight * x / rms(x)", py::arg("x"), py::arg("weight"),
          py::arg("eps"));
    m.def("mask_logits", &mask_logits, py::call_guard<py::gil_scoped_release>(),
          "logits with every token the bitmask does not allow at -inf", py::arg("logits"),
          py::arg("bitmask"));
    m.def("mask_logits_", &mask_logits_, py::call_guard<py::gil_scoped_release>(),
          "mask_logits in place", py::arg("logits"), py::arg("bitmask"));
    m.def("single_token_rows", &single_token_rows, py::call_guard<py::gil_scoped_release>(),
          "per bitmask row, the one token it allows, or -1", py::arg("bitmask"));
    m.def("argmax_rows", &argmax_rows, py::call_guard<py::gil_scoped_release>(),
          "torch.argmax(x, dim=-1) of a float32 [N, V] tensor", py::arg("x"));
    m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>(), "silu(gate) * up of [T, 2I]", py::arg("gate_up"));
    m.def("rotary_", &rotary_, py::call_guard<py::gil_scoped_release>(), "rotary embedding in place on q and k", py::arg("q"),
          py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("positions"));
}
