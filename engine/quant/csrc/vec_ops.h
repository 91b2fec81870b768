// What gguf_cpu.cpp exports to cpu_ops.cpp: the attention of one head and SiLU compiled for the widest
// instruction set this CPU runs, and the registration of cpu_ops.cpp's functions in the one
// extension module.
#pragma once

#include <cstdint>

#include <torch/extension.h>

// Where key/value p of a paged cache lives: slots[p] is its cache slot (block * block_size +
// offset, worked out once per request: a division per key and head cost as much as its
// arithmetic), slots are slot_stride floats apart, and base already points at the wanted KV head.
struct PagedRows {
    const float* base;
    const int64_t* slots;
    int64_t slot_stride;
    const float* row(int64_t p) const { return base + slots[p] * slot_stride; }
};

struct VecOps {
    // One query head attending over the first n keys of its KV head (see attend_head in
    // vec_kernels_impl.h): out = softmax(scale * q K^T) V, with a scratch of n floats.
    void (*attend_head)(const float* q, int64_t D, float scale, const PagedRows& keys,
                        const PagedRows& values, int64_t n, float* scores, float* out);
    void (*silu_mul_row)(const float* gate, const float* up, float* out, int64_t n);
    // torch.argmax of one row: the first of ties, the first NaN if any.
    int64_t (*argmax_row)(const float* x, int64_t n);
};

VecOps vec_ops();
void register_cpu_ops(pybind11::module& m);

// gguf_cpu.cpp's single-format projection, for the fused decoder layer in cpu_ops.cpp.
torch::Tensor gguf_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t type);

// gguf_int8.cpp: the integer path for weights repacked in 16-row groups (int8_layout.h), reached
// through gguf_matmul_out by their type ids.
bool is_int8_type(int64_t type);
void int8_matmul_out(const torch::Tensor& x, const torch::Tensor& weights, int64_t type,
                     torch::Tensor& out, int64_t isa);
void register_int8_ops(pybind11::module& m);
