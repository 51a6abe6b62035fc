// The float-weight matmul (matmul16.cc) as the other families use it: the fused decode ops (decode_ops.cc) call
// matmul() and run the rows kernels in their own dispatches; the attention (attention.cc) computes its scores with
// the float32 rows kernel.
#ifndef MSLITE_LLM_CPU_KERNELS_MATMUL16_H_
#define MSLITE_LLM_CPU_KERNELS_MATMUL16_H_

#include "common.h"

namespace msllm {

constexpr int64_t GEMV_MAX_ROWS = 16;  // rows of x up to which the GEMV form wins (benchmarks/bench_kernels.py: by
                                       // 5-30 % at 10-16 rows, weights not in cache; the GEMM from 24)

// y [rows, out] = x [rows, in] . W^T (+ b), shapes already checked, rows, out and in positive. The fused ops'
// epilogue: `up` [out, in] of W's dtype for SwiGLU (y = silu(x . W^T) * (x . up^T)), `residual` [rows, out] to add.
void matmul(const float* x, int64_t rows, const void* w, WType wt, const float* b, int64_t in, int64_t out, float* y,
            const void* up = nullptr, const float* residual = nullptr);

// The rows kernel (common.h's RowsFn) of this machine's code path for weights of type wt.
RowsFn rows_kernel(WType wt);

// Whether this machine's code path has a GEMM form for wt (else the rows form takes every M, as matmul() does).
bool has_gemm(WType wt);

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_MATMUL16_H_
