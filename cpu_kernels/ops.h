// The Custom op bodies each kernel family defines, for registry.cc, which exports them as extern "C" functions.
// Each takes MindSpore's aot CPU arguments (nparam, params, ndims, shapes, dtypes; registry.cc lists the tensors)
// and returns 0, or the error code registry.cc's comment gives.
#ifndef MSLITE_LLM_CPU_KERNELS_OPS_H_
#define MSLITE_LLM_CPU_KERNELS_OPS_H_

#include <cstdint>

namespace msllm {

// matmul16.cc: float32/float16/bfloat16 weights
int gemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_bias,
         bool prompt_rows);
int embed(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

// attention.cc
int decode_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

// decode_ops.cc
int rms_norm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int qkv_rope(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int gemv_add(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int decode_qkv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int write_cache(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int norm_swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int decode_tail(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int decode_layer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

// int8/int4 weights: the op body in matmul16.cc (its matmul() dispatches by rows), the rest in matmul_quant.cc
int quant_matmul_op(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_offset,
                    bool prompt_rows);
int weight_quant_batch_matmul(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

// moe.cc: a mixture of experts' sparse MLP (the router, the routing, the chosen experts; float or quantized)
int moe(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int decode_moe_layer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_OPS_H_
