// The float32 vector kernels of a decoder layer's glue (vec_kernels_impl.h: SiLU, argmax;
// attention_rows_impl.h and attention_blocks_impl.h: attention of query heads over paged keys and
// values), compiled once per instruction set, and
// vec_ops(): the table of the variant this process runs (isa.cpp decides), which the
// attention, glue and decoder-stack files call through.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "isa.h"
#include "vec_ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define GGUF_KERNEL_X86_SIMD 1
#define ATTENTION_QUERY_BLOCK 3  // AVX-512 has 32 vector registers (attention_blocks_impl.h)
namespace vec_avx512 {
#include "gguf_blocks.h"  // hsum
#include "vec_kernels_impl.h"
#include "attention_rows_impl.h"
#include "attention_blocks_impl.h"
}
#undef ATTENTION_QUERY_BLOCK
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace vec_avx2 {
#include "gguf_blocks.h"
#include "vec_kernels_impl.h"
#include "attention_rows_impl.h"
#include "attention_blocks_impl.h"
}
#undef GGUF_KERNEL_X86_SIMD
#pragma GCC pop_options
#define SPECSERVE_HAVE_X86_VARIANTS 1
#endif

namespace vec_generic {
#include "gguf_blocks.h"
#include "vec_kernels_impl.h"
#include "attention_rows_impl.h"
#include "attention_blocks_impl.h"
}

VecOps vec_ops(int64_t isa) {
    isa = resolve_isa(isa);
#ifdef SPECSERVE_HAVE_X86_VARIANTS
    if (isa == kAvx512)
        return {vec_avx512::attend_heads, vec_avx512::silu_mul_row, vec_avx512::argmax_row,
                vec_avx512::kQueryBlock};
    if (isa == kAvx2)
        return {vec_avx2::attend_heads, vec_avx2::silu_mul_row, vec_avx2::argmax_row,
                vec_avx2::kQueryBlock};
#endif
    return {vec_generic::attend_heads, vec_generic::silu_mul_row, vec_generic::argmax_row, 1};
}
