// What gguf_cpu.cpp exports to cpu_ops.cpp: float32 vector primitives of the widest instruction
// set this CPU runs, and the registration of cpu_ops.cpp's functions in the one extension module.
#pragma once

#include <cstdint>

#include <torch/extension.h>

struct VecOps {
    float (*dot)(const float* a, const float* b, int64_t n);
    void (*axpy)(float alpha, const float* x, float* y, int64_t n);  // y += alpha * x
};

VecOps vec_ops();
void register_cpu_ops(pybind11::module& m);

// gguf_cpu.cpp's single-format projection, for the fused decoder layer in cpu_ops.cpp.
torch::Tensor gguf_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t type);
