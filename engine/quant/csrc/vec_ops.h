// What gguf_cpu.cpp exports to cpu_ops.cpp: the attention inner loop and SiLU compiled for the widest
// instruction set this CPU runs, and the registration of cpu_ops.cpp's functions in the one
// extension module.
#pragma once

#include <cstdint>

#include <torch/extension.h>

struct VecOps {
    // One query row's GQA group of heads attending over one KV head's paged keys and values
    // (see attend_group in gguf_kernels_impl.h).
    void (*attend_group)(const float* q, int64_t group, int64_t D, float scale,
                         const float* k_base, const float* v_base, const int64_t* table,
                         int64_t block_size, int64_t slot_stride, int64_t num_keys,
                         float* scores, float* out);
    void (*silu_mul_row)(const float* gate, const float* up, float* out, int64_t n);
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
