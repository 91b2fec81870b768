// The extension module: each file registers its own functions here, and no file calls back
// into this one. Files and what they own:
//   isa.cpp              which instruction-set variant each kernel family runs
//   gguf_cpu.cpp         GGUF block-quantized matmul and dequantize (float activations)
//   gguf_int8.cpp        the integer path for weights repacked in 16-row groups
//   vec_ops.cpp          float vector kernels: one head's attention, SiLU, argmax
//   cpu_ops.cpp          a decoder layer's glue on raw rows (RMSNorm, rotary, masks)
//   paged_attention.cpp  attention over a paged KV cache
//   decoder_stack.cpp    a whole decoder stack in one call
#include <torch/extension.h>

#include "vec_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "specserve's CPU kernels: GGUF weight-only matmuls (float and integer), paged "
              "attention and a fused decoder stack";
    register_gguf_ops(m);
    register_int8_ops(m);
    register_cpu_ops(m);
    register_paged_attention(m);
    register_decoder_stack(m);
}
