// The float-weight matmul (matmul16.cc) as the other families use it: the fused decode ops (decode_ops.cc) call
// matmul() and run the rows kernels in their own dispatches; the attention (attention.cc) computes its scores with
// the float32 rows kernel.
#ifndef MSLITE_LLM_CPU_KERNELS_MATMUL16_H_
#define MSLITE_LLM_CPU_KERNELS_MATMUL16_H_

#include <vector>

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

// n values of type wt (a float type) as float32, exactly, in this machine's code path: the GEMM's packing, and the
// attention's reads of a bfloat16 KV cache's blocks (attention.cc). Asked at call time (not in a static initializer:
// the kernels are picked in one).
typedef void (*WidenFn)(const void* src, int64_t n, float* dst);
WidenFn widen_kernel(WType wt);

// Rows of x for which bfloat16 weights take the AVX512-BF16 form: from BF16_MIN_ROWS (measured on SmolLM2's step,
// AMD EPYC Zen 4, docs/performance-log.md 37: 2 and 4 rows slower in it than in float32's form, bound by the weights'
// bytes; 8 level; 9, a verify of 8, and 16 faster; from 5 since a step of 5-7 sequences computes its live rows only,
// not the 8-row graph's 8, which it ran in this form: on an AMD EPYC Zen 5 5 rows 1.06-1.15x and 6 rows 1.15-1.17x
// the float32 form, 4 rows 0.94-0.99x, performance-log.md 55) to BF16_MAX_ROWS (its rows form against float32's GEMM beyond
// GEMV_MAX_ROWS: 1.2-1.5x faster at 18-64 rows, a chunk call of 16 step rows and a piece of 2 among them; longer
// prompts keep the GEMM; a width in whole blocks of 32 takes the GEMM below from BF16_GEMM_ROWS).
// cpu_kernels/__init__.py says the same.
constexpr int64_t BF16_MIN_ROWS = 5;
constexpr int64_t BF16_MAX_ROWS = 64;
// From this many rows of x, matmul() multiplies bfloat16 weights of a width in whole blocks of 32 by the AVX512-BF16
// GEMM instead (matmul16.cc gemm_block_dpbf16: a block of W packed as bfloat16 pairs, tiles of 6 rows by 64 outputs;
// x rounded as the rows form rounds it): on an AMD EPYC Zen 5, 2 cores, 1.0-1.4x the rows form at 17-28 rows, 1.5-1.9x
// at 32-64, and 2.1-2.5x the float32 GEMM from 65 rows on (docs/performance-log.md 54). Not where AMX tiles run.
constexpr int64_t BF16_GEMM_ROWS = 17;
static_assert(BF16_GEMM_ROWS > GEMV_MAX_ROWS, "matmul() takes a GEMM past the GEMV's rows");

// The form of the rows kernel for bfloat16 weights at BF16_MIN_ROWS to BF16_MAX_ROWS rows of x: "avx512_bf16" (x
// rounded to bfloat16, vdpbf16ps; the AVX-512 path on a CPU with AVX512_BF16) or "float32" (the weights widened,
// float32 FMA).
const char* bf16_form();

// A bfloat16 weight and x rounded to bfloat16 for it: what bf16_prepare's rows kernel reads in place of the weight.
struct Bf16Operand {
  const void* w;
  const uint16_t* xb;
};

// Where the AVX512-BF16 form runs for `rows` rows of x (bf16_form, BF16_MIN_ROWS to BF16_MAX_ROWS, activations not
// held exact), or AMX tiles (from BF16_MIN_ROWS, any number): x rounded to bfloat16 into `xb` once (the tiles: in
// their layout), and the rows kernel that takes Bf16Operands as its weights; else nullptr. The one place that decides
// whether the forms run.
// `tiles` false: the vector form only (a caller whose tasks are not bf16_task_rows').
RowsFn bf16_prepare(const float* x, int64_t rows, int64_t in, std::vector<uint16_t>& xb, bool tiles = true);

// Whether bfloat16 weights may take AMX tiles on this machine (AMX-BF16 granted: matmul16.cc rows_amx_bf16; tiles_on()
// the switch), and the outputs a task of bf16_prepare's rows kernel `fn` takes (0: the default, task_rows)
bool bf16_tiles_here();
int64_t bf16_task_rows(RowsFn fn, int64_t out);

// Whether this machine's code path has a GEMM form for wt (else the rows form takes every M, as matmul() does).
bool has_gemm(WType wt);

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_MATMUL16_H_
