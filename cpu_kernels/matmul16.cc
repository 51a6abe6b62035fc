// mslite-llm CPU kernels: y = x . W^T (+ b) for float32, float16 or bfloat16 weights, and the embedding lookup, as
// MindSpore aot Custom ops (the op bodies gemv and embed; registry.cc exports them). matmul() is also the fused decode
// ops' matmul (decode_ops.cc), and the rows kernels the attention's scores (attention.cc).
//
// Why: MindSpore 2.10's CPU MatMul reads the weights with one core when x has one row
// (about 7.5 GB/s here), and decoding one token is that GEMV, 1.98 GB of weights for the
// Qwen2-0.5B shape. This kernel splits the output rows across threads and reads W once
// (docs/architecture.md, "Facts the design rests on"; docs/performance-log.md, "Decode: our own GEMV kernel",
// 2026-11-21). MindSpore has no fast CPU kernel for 16-bit weights either, so W may be float16 or bfloat16: each
// weight is widened to float32 in registers as it is loaded and all arithmetic is float32 (FMA). x, b and y are
// always float32.
//
// Two forms, chosen by the rows of x (M):
//   M <= GEMV_MAX_ROWS (decode): dot products that read each weight once per call (M=1: one weight row
//     at a time, a sequential stream per thread; 4 weight rows against 2 rows of x, or 3 against 4 from
//     M=4, in register tiles); threads split the output rows.
//   larger M (prefill): a cache-blocked GEMM. A block of W (KC inputs x NC outputs) is widened and
//     packed into a per-thread buffer in 16-output panels, then a 6x16 microkernel (6 rows of x
//     by 16 outputs, 12 ymm accumulators, x broadcast from its rows) runs over it; threads split
//     the outputs (and the rows of x when there are few outputs), each packing its own blocks.
//
// The forms of each ISA side by side below: plain C++, AVX2 + FMA + F16C (the GEMV tiles, the GEMM's packing and
// microkernel), AVX-512 (the GEMM's microkernel, the GEMV for one row of x), NEON (the GEMV forms; no GEMM); the
// table of this machine's forms is chosen at load from isa() (common.h).
#include "matmul16.h"

#include <type_traits>

#include "matmul_quant.h"
#include "ops.h"
#include "pool.h"

namespace msllm {
namespace {

constexpr int64_t GEMV_WIDE_ROWS = 4;  // GEMV: from this many rows of x on, 4x3 tiles instead of 2x4
constexpr int64_t PACK_PREFETCH = 128;  // GEMM: weights the pack prefetches ahead in each row
constexpr int64_t MR = 6, NR = 16;  // GEMM microkernel: rows of x by outputs
constexpr int64_t KC = 1024;  // GEMM: at most this many inputs per packed block (blocks of equal size);
                              // 256..1024 measured within 3 %, 1024 reads W in longer runs
constexpr int64_t MC = 48;    // GEMM: rows of x per pass over a packed block (MC x KC floats, with it in L2)
constexpr int64_t NC = 64;    // GEMM: outputs per task (its packed block, KC x NC floats, in L2)
constexpr int64_t MIN_PARALLEL_WORK = int64_t(1) << 20;  // GEMM (MACs), embed (floats): less runs on the caller

template <class T>
inline void widen_generic(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

// A per-thread float buffer that only grows: the GEMM's packed blocks, the generic path's widened rows.
class Scratch {
 public:
  ~Scratch() { std::free(ptr_); }
  float* get(size_t floats) {
    if (floats > size_) {
      std::free(ptr_);
      ptr_ = nullptr;
      size_ = 0;
      void* p = nullptr;
      if (posix_memalign(&p, 64, floats * sizeof(float)) != 0) return nullptr;
      ptr_ = static_cast<float*>(p);
      size_ = floats;
    }
    return ptr_;
  }

 private:
  float* ptr_ = nullptr;
  size_t size_ = 0;
};

thread_local Scratch t_scratch;

// ---- generic C++ ------------------------------------------------------------------------------

template <class T>
void rows_generic(const float* x, int64_t rows, const void* wv, const float* b, int64_t in, float* y, int64_t ldy,
                  int64_t o0, int64_t o1) {
  const T* w = static_cast<const T*>(wv);
  const bool f32 = std::is_same<T, float>::value;
  float* row = f32 ? nullptr : t_scratch.get(size_t(std::max<int64_t>(in, 1)));
  for (int64_t o = o0; o < o1; ++o) {
    const float* wo = reinterpret_cast<const float*>(w + o * in);
    if (row != nullptr) {
      widen_generic(w + o * in, in, row);  // once per weight row, whatever the rows of x
      wo = row;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float s;
      if (f32 || row != nullptr) {
        s = dot_generic(wo, x + r * in, in);
      } else {  // no memory for a widened row
        s = 0.f;
        for (int64_t i = 0; i < in; ++i) s += to_f32(w[o * in + i]) * x[r * in + i];
      }
      y[r * ldy + o] = s + (b ? b[o] : 0.f);
    }
  }
}

template <class T>
void widen_rows_generic(const void* src, int64_t n, float* dst) {
  widen_generic(static_cast<const T*>(src), n, dst);
}

// ---- AVX2 + FMA + F16C --------------------------------------------------------------------------

#ifdef MSLLM_X86
MSLLM_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
MSLLM_AVX2 inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
MSLLM_AVX2 inline __m256 load8(const bf16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

// GEMV: R rows of x by C rows of W at a time, R*C accumulators in registers: each load feeds several FMAs.
template <class T, int R, int C>
MSLLM_AVX2 inline void tile_avx2(const float* x, const T* w, const float* b, int64_t in, float* y, int64_t ldy,
                                 int64_t o) {
  const int64_t in8 = in & ~int64_t(7);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const T* wo = w + o * in;
  // The next C weight rows follow these in memory: prefetch them, an equal share per step. Short rows are
  // short streams for the hardware prefetcher; measured on the 0.5B shapes (weights not in cache), this
  // reads 16-bit rows of 896 up to 1.6x faster, float32 ones only with 4 rows of x (at 1-2 rows they
  // already come at the memory's pace and the extra instructions cost ~5 %). 16-bit rows of 4864
  // (down_proj) gain 1.4x on an EPYC with AVX-512 (0.23 -> 0.17 ms), float32 ones nothing.
  const bool prefetch = sizeof(T) == 2 || (in * int64_t(sizeof(T)) <= 4096 && R >= 4);
  constexpr int64_t PREFETCH_STEP = C * 8 * int64_t(sizeof(T));
  const char* next = reinterpret_cast<const char*>(wo + C * in);
  for (int64_t i = 0; i < in8; i += 8) {
    if (prefetch) {
      for (int64_t off = 0; off < PREFETCH_STEP; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      next += PREFETCH_STEP;
    }
    __m256 wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = load8(wo + c * in + i);
      __asm__("" : "+x"(wv[c]));  // in a register: else GCC folds float weights into each FMA, loading them R times
    }
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * in + i);
      __asm__("" : "+x"(xv));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t i = in8; i < in; ++i) s += to_f32(wo[c * in + i]) * x[r * in + i];
      y[r * ldy + o + c] = s + (b ? b[o + c] : 0.f);
    }
  }
}

// All rows of x against C weight rows: R rows of x at a time, again for the next R while the weight rows are in cache.
template <class T, int R, int C>
MSLLM_AVX2 inline void tiles_avx2(const float* x, int64_t rows, const T* w, const float* b, int64_t in, float* y,
                                  int64_t ldy, int64_t o) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) tile_avx2<T, R, C>(x + r * in, w, b, in, y + r * ldy, ldy, o);
  for (; r + 2 <= rows; r += 2) tile_avx2<T, 2, C>(x + r * in, w, b, in, y + r * ldy, ldy, o);
  if (r < rows) tile_avx2<T, 1, C>(x + r * in, w, b, in, y + r * ldy, ldy, o);
}

template <class T>
MSLLM_AVX2 void rows_avx2(const float* x, int64_t rows, const void* wv, const float* b, int64_t in, float* y,
                          int64_t ldy, int64_t o0, int64_t o1) {
  const T* w = static_cast<const T*>(wv);
  int64_t o = o0;
  // Decode at batch 1: 1x2 tiles, each output summed in the very order of every tile (one accumulator over the
  // inputs 8 at a time), so a row of x comes out bit for bit alike in a call of any number of rows: a step's logits
  // are its verify's (speculative decoding's greedy tokens are plain decoding's; on a bfloat16 KV cache a sum that
  // differs in its last bit can round a key to another bfloat16 and move the logits by 5e-3, which parted the tokens
  // at a near tie). The 4-accumulator row-at-a-time form it replaces summed otherwise; on an AMD EPYC Zen 3 (AVX2)
  // the tiles ran SmolLM2's bfloat16 step 1.04x as fast, in-process alternating (docs/performance-log.md 65; 1x4
  // tiles 1.03x; on an AVX-512 EPYC in 2026-11-24, 1x4 tiles ran 0.89x: four streams, there this path is not the
  // default).
  if (rows == 1) {
    for (; o + 2 <= o1; o += 2) tile_avx2<T, 1, 2>(x, w, b, in, y, ldy, o);
    for (; o < o1; ++o) tile_avx2<T, 1, 1>(x, w, b, in, y, ldy, o);
    return;
  }
  if (rows < GEMV_WIDE_ROWS) {  // 2x4 tiles: 8 accumulators
    for (; o + 4 <= o1; o += 4) tiles_avx2<T, 2, 4>(x, rows, w, b, in, y, ldy, o);
  } else {  // 4x3 tiles: 12 accumulators, each weight widened once per 4 rows of x
    for (; o + 3 <= o1; o += 3) tiles_avx2<T, 4, 3>(x, rows, w, b, in, y, ldy, o);
  }
  for (; o < o1; ++o) tiles_avx2<T, 2, 1>(x, rows, w, b, in, y, ldy, o);
}

template <class T>
MSLLM_AVX2 void widen_rows_avx2(const void* src, int64_t n, float* dst) {
  const T* s = static_cast<const T*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(s + i));
  for (; i < n; ++i) dst[i] = to_f32(s[i]);
}

MSLLM_AVX2 inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Packs W[n0 .. n0+ncols) x [k0 .. k0+kc), widened, as panels of NR outputs: bp[p][k][j] = W[n0+NR*p+j][k0+k],
// zeros past ncols.
template <class T>
MSLLM_AVX2 void pack_b(const T* w, int64_t in, int64_t n0, int64_t ncols, int64_t k0, int64_t kc, float* bp) {
  const int64_t kc8 = kc & ~int64_t(7);
  for (int64_t p = 0; p * NR < ncols; ++p) {
    float* panel = bp + p * NR * kc;
    const int64_t valid = std::min<int64_t>(NR, ncols - p * NR);
    for (int64_t h = 0; h < NR; h += 8) {  // two halves of 8 outputs
      const T* src = w + (n0 + p * NR + h) * in + k0;
      if (valid >= h + 8) {
        for (int64_t k = 0; k < kc8; k += 8) {
          for (int j = 0; j < 8; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(src + j * in + k + PACK_PREFETCH), _MM_HINT_T0);
          __m256 r[8];
          for (int j = 0; j < 8; ++j) r[j] = load8(src + j * in + k);
          transpose8(r);
          for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + (k + j) * NR + h, r[j]);
        }
        for (int64_t k = kc8; k < kc; ++k)
          for (int j = 0; j < 8; ++j) panel[k * NR + h + j] = to_f32(src[j * in + k]);
      } else {
        const int64_t rows = std::max<int64_t>(0, valid - h);
        for (int64_t k = 0; k < kc; ++k)
          for (int64_t j = 0; j < 8; ++j) panel[k * NR + h + j] = j < rows ? to_f32(src[j * in + k]) : 0.f;
      }
    }
  }
}

// C[R x ncols] (+)= A[R x kc] . panel, A rows lda apart, C rows ldc apart. first: C = bias (or 0) + product.
// The 12 accumulators are named variables, not an array: GCC keeps an array of vectors in memory here.
template <int R>
MSLLM_AVX2 void micro(int64_t kc, const float* a, int64_t lda, const float* bp, float* c, int64_t ldc, int64_t ncols,
                      bool first, const float* bias) {
  alignas(32) float tmp[R][NR];
  const bool full = ncols == NR;
  float* cc = full ? c : tmp[0];  // where the tile is read and written
  const int64_t ldcc = full ? ldc : NR;
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (first) {
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (bias != nullptr) {
      alignas(32) float bb[NR] = {0};
      for (int64_t j = 0; j < ncols; ++j) bb[j] = bias[j];
      b0 = _mm256_load_ps(bb);
      b1 = _mm256_load_ps(bb + 8);
    }
    c00 = c10 = c20 = c30 = c40 = c50 = b0;
    c01 = c11 = c21 = c31 = c41 = c51 = b1;
  } else {
    if (!full)
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < NR; ++j) tmp[r][j] = j < ncols ? c[r * ldc + j] : 0.f;
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
#define MSLLM_LOAD_ROW(r)                                 \
    if (R > r) {                                          \
      c##r##0 = _mm256_loadu_ps(cc + r * ldcc);           \
      c##r##1 = _mm256_loadu_ps(cc + r * ldcc + 8);       \
    }
    MSLLM_LOAD_ROW(0) MSLLM_LOAD_ROW(1) MSLLM_LOAD_ROW(2) MSLLM_LOAD_ROW(3) MSLLM_LOAD_ROW(4) MSLLM_LOAD_ROW(5)
#undef MSLLM_LOAD_ROW
  }
  const float* a0 = a;
  const float* a1 = a + (R > 1 ? 1 : 0) * lda;
  const float* a2 = a + (R > 2 ? 2 : 0) * lda;
  const float* a3 = a + (R > 3 ? 3 : 0) * lda;
  const float* a4 = a + (R > 4 ? 4 : 0) * lda;
  const float* a5 = a + (R > 5 ? 5 : 0) * lda;
#define MSLLM_FMA_ROW(r)                                  \
    if (R > r) {                                          \
      const __m256 av = _mm256_broadcast_ss(a##r + k);    \
      c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);         \
      c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);         \
    }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(bp + k * NR), b1 = _mm256_load_ps(bp + k * NR + 8);
    MSLLM_FMA_ROW(0) MSLLM_FMA_ROW(1) MSLLM_FMA_ROW(2) MSLLM_FMA_ROW(3) MSLLM_FMA_ROW(4) MSLLM_FMA_ROW(5)
  }
#undef MSLLM_FMA_ROW
#define MSLLM_STORE_ROW(r)                                \
  if (R > r) {                                            \
    _mm256_storeu_ps(cc + r * ldcc, c##r##0);             \
    _mm256_storeu_ps(cc + r * ldcc + 8, c##r##1);         \
  }
  MSLLM_STORE_ROW(0) MSLLM_STORE_ROW(1) MSLLM_STORE_ROW(2) MSLLM_STORE_ROW(3) MSLLM_STORE_ROW(4) MSLLM_STORE_ROW(5)
#undef MSLLM_STORE_ROW
  if (!full)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < ncols; ++j) c[r * ldc + j] = tmp[r][j];
}

// The same tile with AVX-512 (one zmm per row of 16 outputs): on CPUs with full-width AVX-512 units (AMD Zen 5,
// Intel server cores) twice the FLOPs of the AVX2 form. Two accumulators per row (even and odd k) keep 12
// independent FMA chains in flight; partial tiles use masked loads and stores.
template <int R>
MSLLM_AVX512 void micro512(int64_t kc, const float* a, int64_t lda, const float* bp, float* c, int64_t ldc,
                           int64_t ncols, bool first, const float* bias) {
  const __mmask16 mask = ncols >= NR ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  __m512 e0, e1, e2, e3, e4, e5, o0, o1, o2, o3, o4, o5;
  e0 = e1 = e2 = e3 = e4 = e5 = o0 = o1 = o2 = o3 = o4 = o5 = _mm512_setzero_ps();
  const __m512 start = (first && bias != nullptr) ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#define MSLLM_INIT_ROW(r) \
  if (R > r) e##r = first ? start : _mm512_maskz_loadu_ps(mask, c + r * ldc);
  MSLLM_INIT_ROW(0) MSLLM_INIT_ROW(1) MSLLM_INIT_ROW(2) MSLLM_INIT_ROW(3) MSLLM_INIT_ROW(4) MSLLM_INIT_ROW(5)
#undef MSLLM_INIT_ROW
  const float* a0 = a;
  const float* a1 = a + (R > 1 ? 1 : 0) * lda;
  const float* a2 = a + (R > 2 ? 2 : 0) * lda;
  const float* a3 = a + (R > 3 ? 3 : 0) * lda;
  const float* a4 = a + (R > 4 ? 4 : 0) * lda;
  const float* a5 = a + (R > 5 ? 5 : 0) * lda;
#define MSLLM_FMA2_ROW(r)                                            \
  if (R > r) {                                                       \
    e##r = _mm512_fmadd_ps(_mm512_set1_ps(a##r[k]), b0, e##r);       \
    o##r = _mm512_fmadd_ps(_mm512_set1_ps(a##r[k + 1]), b1, o##r);   \
  }
  int64_t k = 0;
#pragma GCC unroll 2
  for (; k + 2 <= kc; k += 2) {
    const __m512 b0 = _mm512_load_ps(bp + k * NR), b1 = _mm512_load_ps(bp + (k + 1) * NR);
    MSLLM_FMA2_ROW(0) MSLLM_FMA2_ROW(1) MSLLM_FMA2_ROW(2) MSLLM_FMA2_ROW(3) MSLLM_FMA2_ROW(4) MSLLM_FMA2_ROW(5)
  }
#undef MSLLM_FMA2_ROW
#define MSLLM_TAIL_STORE_ROW(r)                                                              \
  if (R > r) {                                                                               \
    if (k < kc) e##r = _mm512_fmadd_ps(_mm512_set1_ps(a##r[k]), _mm512_load_ps(bp + k * NR), e##r); \
    _mm512_mask_storeu_ps(c + r * ldc, mask, _mm512_add_ps(e##r, o##r));                   \
  }
  MSLLM_TAIL_STORE_ROW(0) MSLLM_TAIL_STORE_ROW(1) MSLLM_TAIL_STORE_ROW(2) MSLLM_TAIL_STORE_ROW(3)
  MSLLM_TAIL_STORE_ROW(4) MSLLM_TAIL_STORE_ROW(5)
#undef MSLLM_TAIL_STORE_ROW
}

typedef void (*MicroFn)(int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, bool, const float*);
const MicroFn k_micro[MR + 1] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>};
const MicroFn k_micro512[MR + 1] = {nullptr, micro512<1>, micro512<2>, micro512<3>, micro512<4>, micro512<5>,
                                    micro512<6>};

// One packed block's tiles: rows [m0, m1) of x against its panels (inputs [pc, pc + kc) of ncols outputs from n0)
// into y; the first block stores (with the bias), the others add.
template <const MicroFn* MICRO>
MSLLM_AVX2 inline void block_tiles(const float* x, const float* b, int64_t in, int64_t out, float* y, int64_t m0,
                                   int64_t m1, int64_t n0, int64_t ncols, int64_t pc, int64_t kc, const float* bp) {
  const int64_t panels = (ncols + NR - 1) / NR;
  for (int64_t ic = m0; ic < m1; ic += MC) {
    const int64_t mc = std::min(MC, m1 - ic);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t nc = std::min<int64_t>(NR, ncols - p * NR);
      const float* panel = bp + p * NR * kc;
      const float* bias = (b != nullptr && pc == 0) ? b + n0 + p * NR : nullptr;
      int64_t ir = ic;
      for (; ir + MR <= ic + mc; ir += MR)
        MICRO[MR](kc, x + ir * in + pc, in, panel, y + ir * out + n0 + p * NR, out, nc, pc == 0, bias);
      if (ir < ic + mc)
        MICRO[ic + mc - ir](kc, x + ir * in + pc, in, panel, y + ir * out + n0 + p * NR, out, nc, pc == 0, bias);
    }
  }
}

// y[m0..m1, n0..n1) = x[m0..m1) . W[n0..n1)^T (+ b): one GEMM task, with the tiles of MICRO.
template <class T, const MicroFn* MICRO>
MSLLM_AVX2 void gemm_block_avx2(const float* x, const void* wv, const float* b, int64_t in, int64_t out, float* y,
                                int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const T* w = static_cast<const T*>(wv);
  const int64_t ncols = n1 - n0;
  // the inputs in blocks of equal size (a multiple of 8), at most KC
  const int64_t blocks = (in + KC - 1) / KC, block = ((in + blocks - 1) / blocks + 7) / 8 * 8;
  float* bp = t_scratch.get(size_t(block * NC));
  if (bp == nullptr) {  // no memory for the packed block: the GEMV form needs none
    rows_avx2<T>(x + m0 * in, m1 - m0, w, b, in, y + m0 * out, out, n0, n1);
    return;
  }
  for (int64_t pc = 0; pc < in; pc += block) {
    const int64_t kc = std::min(block, in - pc);
    pack_b(w, in, n0, ncols, pc, kc, bp);
    block_tiles<MICRO>(x, b, in, out, y, m0, m1, n0, ncols, pc, kc, bp);
  }
}

// pack_b for int8/int4 weights (a QuantWeight): 8 rows at a time dequantized into `rows` (8 x kc floats, by
// matmul_quant.cc's dequantize_rows), then transposed into the panels as pack_b does
MSLLM_AVX2 void pack_b_quant(const QuantWeight& w, int64_t n0, int64_t ncols, int64_t k0, int64_t kc, float* bp,
                             float* rows) {
  const int64_t kc8 = kc & ~int64_t(7);
  for (int64_t p = 0; p * NR < ncols; ++p) {
    float* panel = bp + p * NR * kc;
    const int64_t valid = std::min<int64_t>(NR, ncols - p * NR);
    for (int64_t h = 0; h < NR; h += 8) {
      const int64_t got = std::max<int64_t>(0, std::min<int64_t>(8, valid - h));
      if (got > 0) dequantize_rows(w, n0 + p * NR + h, got, k0, kc, rows, kc);
      std::fill(rows + got * kc, rows + 8 * kc, 0.f);
      for (int64_t k = 0; k < kc8; k += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(rows + j * kc + k);
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + (k + j) * NR + h, r[j]);
      }
      for (int64_t k = kc8; k < kc; ++k)
        for (int j = 0; j < 8; ++j) panel[k * NR + h + j] = rows[j * kc + k];
    }
  }
}

// gemm_block_avx2 for a QuantWeight: the prompt's int8/int4 matmuls at the float GEMM's pace (the buffered form of
// matmul_quant.cc, tiles of 16 outputs, ran at half of it), the weights dequantized once per packed block
template <const MicroFn* MICRO>
MSLLM_AVX2 void gemm_block_quant_avx2(const float* x, const void* wv, const float* b, int64_t in, int64_t out, float* y,
                                      int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const QuantWeight& w = *static_cast<const QuantWeight*>(wv);
  const int64_t ncols = n1 - n0;
  const int64_t blocks = (in + KC - 1) / KC, block = ((in + blocks - 1) / blocks + 7) / 8 * 8;
  float* bp = t_scratch.get(size_t(block * (NC + 8)));  // the packed block, then 8 dequantized rows
  if (bp == nullptr) {  // no memory for the packed block: each weight row dequantized in pieces on the stack, dotted
    alignas(32) float row[256];  // (an even number of inputs per piece: int4's bytes)
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = m0; m < m1; ++m) y[m * out + n] = b ? b[n] : 0.f;
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k0 = 0; k0 < in; k0 += 256) {
        const int64_t len = std::min<int64_t>(256, in - k0);
        dequantize_rows(w, n, 1, k0, len, row, len);
        for (int64_t m = m0; m < m1; ++m) {
          float t = 0.f;
          for (int64_t i = 0; i < len; ++i) t += x[m * in + k0 + i] * row[i];
          y[m * out + n] += t;
        }
      }
    return;
  }
  float* rows = bp + block * NC;
  for (int64_t pc = 0; pc < in; pc += block) {
    const int64_t kc = std::min(block, in - pc);
    pack_b_quant(w, n0, ncols, pc, kc, bp, rows);
    block_tiles<MICRO>(x, b, in, out, y, m0, m1, n0, ncols, pc, kc, bp);
  }
}
#endif

typedef void (*GemmFn)(const float* x, const void* w, const float* b, int64_t in, int64_t out, float* y, int64_t m0,
                       int64_t m1, int64_t n0, int64_t n1);

// ---- AVX-512 GEMV for one row of x (the decode step at batch 1) ----------------------------------
// 16 weights per load instead of 8: half the instructions per byte read, so the loads come closer to the
// memory's pace (docs/performance-log.md, "The decode step: where the time goes, and fused ops", 2026-11-23).
// Other row counts use the AVX2 tiles.
#ifdef MSLLM_X86
MSLLM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MSLLM_AVX512 inline __m512 load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
MSLLM_AVX512 inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// One row of x against one weight row at a time, 64 inputs a step in four accumulators of 16 lanes: half the
// instructions per byte read (tiles of four weight rows in this width took 35-38 ms for the float32 step against
// 50-57 for AVX2 ones: docs/performance-log.md, "The decode step: where the time goes, and fused ops", 2026-11-23;
// one sequential row at a time took 0.89x (float32) to 0.78x (bfloat16) of those tiles: the same log, "The CPU
// decode step on the AVX2 path", 2026-11-24). It sums in another order than the AVX2 tiles that take 2 rows and more
// here: a step and its verify agree to float rounding, not bit for bit, on this path (rows_avx2's note).
template <class T>
MSLLM_AVX512 inline void seq_rows512(const float* x, const T* w, const float* b, int64_t in, float* y, int64_t o0,
                                     int64_t o1) {
  const int64_t in64 = in & ~int64_t(63);
  for (int64_t o = o0; o < o1; ++o) {
    const T* wo = w + o * in;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i < in64; i += 64) {
      a0 = _mm512_fmadd_ps(load16(wo + i), _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(load16(wo + i + 16), _mm512_loadu_ps(x + i + 16), a1);
      a2 = _mm512_fmadd_ps(load16(wo + i + 32), _mm512_loadu_ps(x + i + 32), a2);
      a3 = _mm512_fmadd_ps(load16(wo + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i + 16 <= in; i += 16) a0 = _mm512_fmadd_ps(load16(wo + i), _mm512_loadu_ps(x + i), a0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; i < in; ++i) s += to_f32(wo[i]) * x[i];
    y[o] = s + (b ? b[o] : 0.f);
  }
}

template <class T>
MSLLM_AVX512 void rows_avx512(const float* x, int64_t rows, const void* wv, const float* b, int64_t in, float* y,
                              int64_t ldy, int64_t o0, int64_t o1) {
  if (rows != 1) {
    rows_avx2<T>(x, rows, wv, b, in, y, ldy, o0, o1);
    return;
  }
  seq_rows512<T>(x, static_cast<const T*>(wv), b, in, y, o0, o1);
}
#endif

// ---- AVX512-BF16: bfloat16 weights against x rounded to bfloat16, for many rows of x ---------------------------
// vdpbf16ps multiplies 32 bfloat16 pairs and adds them into 16 float32 sums an instruction: twice the multiply-adds
// of a float32 FMA of the same width, and the weights go in as stored, unwidened. Where x has many rows (a step of 8
// to 16 sequences, a verify's piece, a chunk call, a short prompt: up to BF16_MAX_ROWS, past the float32 GEMV's 16)
// the float32 forms are bound by their FMAs (62-70 % of their peak, docs/performance-log.md 36); this form rounds
// each row of x to bfloat16 (to nearest, ties to even) once per call and sums the products in float32. Fewer than
// BF16_MIN_ROWS rows keep the float32 form: bound by the weights' bytes, they measured slower in this one
// (docs/performance-log.md 37). So does every call under ACTIVATIONS_EXACT (matmul_quant.h: check's replays held to
// the float32 reference), and every CPU without AVX512_BF16. check's limit for this rounding is derived for each
// bfloat16 folder at export (export/writers/golden.py, the "bf16" lane; lite_runtime/golden.py derived_limits).
#ifdef MSLLM_X86
#define MSLLM_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

inline uint16_t round_to_bf16(float v) {  // to nearest, ties to even (as vcvtne2ps2bf16); a NaN stays a NaN
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

MSLLM_AVX512_BF16 void x_to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, (__m512i)v);
  }
  for (; i < n; ++i) out[i] = round_to_bf16(x[i]);
}

// The sums of 16 vectors at once: lane j of the result is the sum of v[j]'s 16 lanes (45 instructions where 16
// separate reductions take some 130: a tile's work per output is only in / 32 instructions here).
MSLLM_AVX512 inline __m512 reduce16(const __m512* v) {
  __m512 two[8], four[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of a = v[2i], b = v[2i + 1]
    two[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the partial sums of v[4i .. 4i + 3]
    const __m512d a = _mm512_castps_pd(two[2 * i]), b = _mm512_castps_pd(two[2 * i + 1]);
    four[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(four[0], four[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(four[0], four[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(four[2], four[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(four[2], four[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// the sums of n accumulators (n <= 32) into out[0 .. n)
MSLLM_AVX512 inline void sums_of(const __m512* acc, int n, float* out) {
  alignas(64) float tmp[16];
  for (int i = 0; i < n; i += 16) {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) v[j] = i + j < n ? acc[i + j] : _mm512_setzero_ps();
    _mm512_store_ps(tmp, reduce16(v));
    for (int j = 0; j < 16 && i + j < n; ++j) out[i + j] = tmp[j];
  }
}

// R rows of x (as bfloat16) by C weight rows, 32 inputs a step: the C weight vectors held in registers while each
// row's x is loaded against them (R*C accumulators + C + 1 <= 32 zmm registers)
template <int R, int C>
MSLLM_AVX512_BF16 inline void tile_dpbf16(const uint16_t* xb, const bf16* w, const float* b, int64_t in, float* y,
                                          int64_t ldy, int64_t o) {
  static_assert(R * C + C + 1 <= 32, "the tile's accumulators, weights and x fit the 32 zmm registers");
  const int64_t in32 = in & ~int64_t(31);
  __m512 acc[R * C];
  for (int k = 0; k < R * C; ++k) acc[k] = _mm512_setzero_ps();
  const bf16* wo = w + o * in;
  const char* next = reinterpret_cast<const char*>(wo + C * in);  // the next C weight rows, a line each a step
  for (int64_t i = 0; i < in32; i += 32) {
    for (int c = 0; c < C; ++c) _mm_prefetch(next + c * 64, _MM_HINT_T0);
    next += C * 64;
    __m512i wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = _mm512_loadu_si512(wo + c * in + i);
      __asm__("" : "+v"(wv[c]));  // in a register, loaded once for the R rows
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * in + i);
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], xv, (__m512bh)wv[c]);
    }
  }
  float sums[R * C];
  sums_of(acc, R * C, sums);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = sums[r * C + c];
      for (int64_t i = in32; i < in; ++i) s += to_f32(wo[c * in + i]) * bits_to_float(uint32_t(xb[r * in + i]) << 16);
      y[r * ldy + o + c] = s + (b ? b[o + c] : 0.f);
    }
  }
}

// tile_dpbf16 for a tile of `rows` rows (1 to 8; with C <= 3 weight rows every R fits the registers)
template <int C>
MSLLM_AVX512_BF16 inline void tile_dpbf16_rows(int64_t rows, const uint16_t* xb, const bf16* w, const float* b,
                                               int64_t in, float* y, int64_t ldy, int64_t o) {
  static_assert(C <= 3, "8 rows by C weight rows fit the 32 zmm registers");
  switch (rows) {
    case 1: return tile_dpbf16<1, C>(xb, w, b, in, y, ldy, o);
    case 2: return tile_dpbf16<2, C>(xb, w, b, in, y, ldy, o);
    case 3: return tile_dpbf16<3, C>(xb, w, b, in, y, ldy, o);
    case 4: return tile_dpbf16<4, C>(xb, w, b, in, y, ldy, o);
    case 5: return tile_dpbf16<5, C>(xb, w, b, in, y, ldy, o);
    case 6: return tile_dpbf16<6, C>(xb, w, b, in, y, ldy, o);
    case 7: return tile_dpbf16<7, C>(xb, w, b, in, y, ldy, o);
    default: return tile_dpbf16<8, C>(xb, w, b, in, y, ldy, o);
  }
}

// The rows kernel of the form, on x rounded once for the whole call (bf16_prepare; `op` a Bf16Operand: a weight and
// that x): rows of x in tiles of at most 8, as even as can be (9 rows: 5 + 4, not 8 + 1), each against 3 weight rows
// at a time (in cache for the next tile); the outputs past a multiple of 3 one weight row at a time.
MSLLM_AVX512_BF16 void rows_dpbf16_prepared(const float*, int64_t rows, const void* op, const float* b, int64_t in,
                                            float* y, int64_t ldy, int64_t o0, int64_t o1) {
  constexpr int C = 3, MOST = 8;
  const Bf16Operand& a = *static_cast<const Bf16Operand*>(op);
  const bf16* w = static_cast<const bf16*>(a.w);
  const int64_t tiles = (rows + MOST - 1) / MOST, base = rows / tiles, extra = rows % tiles;
  int64_t o = o0;
  for (; o + C <= o1; o += C)
    for (int64_t t = 0, r = 0; t < tiles; r += base + (t < extra), ++t)
      tile_dpbf16_rows<C>(base + (t < extra), a.xb + r * in, w, b, in, y + r * ldy, ldy, o);
  for (; o < o1; ++o)
    for (int64_t t = 0, r = 0; t < tiles; r += base + (t < extra), ++t)
      tile_dpbf16_rows<1>(base + (t < extra), a.xb + r * in, w, b, in, y + r * ldy, ldy, o);
}

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return isa() == ISA_AVX512 && isa_extensions() && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

const bool g_bf16_form = cpu_has_bf16();
const bool g_bf16_tiles = g_bf16_form && amx_granted() && __builtin_cpu_supports("amx-bf16");

// ---- bfloat16 weights by AMX tiles (tdpbf16ps) ------------------------------------------------------------------
// Where AMX is granted (common.h amx_granted) and the CPU has AMX-BF16 beside AVX512_BF16, bfloat16 weights take the
// tiles for every call of BF16_MIN_ROWS rows of x or more, the prompt's rows too (no upper bound: the GEMM on widened
// weights past BF16_MAX_ROWS was bound by float32 FMAs): x rounded to bfloat16 as the vector form rounds it, products
// summed in float32 (in the tile unit's order: another order of float32 sums than the vector form's). A is 16 weight
// rows by 32 inputs as they are stored (row-major: no repacking), B 16 rows of x by 32 inputs as bfloat16 pairs (x's
// tile layout, x_to_bf16_pairs), C [16 weight rows, 16 rows of x] float32 summed over all the inputs: one store and a
// transposition in registers per 16 x 16 outputs. Blocked 2 x 2 (pairs_amx_bf16: 2 A, 2 B, 4 C, each load taken by
// two products), the next pair of blocks' weights prefetched into L2 while a pair runs.
// (docs/architecture.md "AMX tiles: int8, int4 and bfloat16", docs/performance-log.md 49.)
#define MSLLM_AMX_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")))

// a 16 x 16 matrix of 32-bit elements, one row a register, transposed in place
MSLLM_AVX512 inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) {
      t[8 * h + j] = _mm512_shuffle_i32x4(r[8 * h + j], r[8 * h + 4 + j], 0x88);
      t[8 * h + 4 + j] = _mm512_shuffle_i32x4(r[8 * h + j], r[8 * h + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// x [rows, in] rounded to bfloat16 into tiles of 16 rows (the last padded with zeros): per tile t and pair of inputs
// i, the 16 rows' (x[m][2i], x[m][2i + 1]) in row order, as one uint32 each: B of inputs 32j..32j+31 is 16 such pair
// rows of 64 bytes, contiguous. `in` a multiple of 32 (bf16_prepare): per tile its 16 rows rounded, then 16 pairs of
// the 16 rows at a time transposed in registers (a scalar scatter of each pair was 5 % of a 0.5B bfloat16 prefill).
MSLLM_AVX512_BF16 void x_to_bf16_pairs_tile(const float* x, int64_t rows, int64_t in, uint16_t* out, int64_t t) {
  const int64_t half = in / 2;
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(static_cast<size_t>(16 * in));
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(rounded.data());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t m = 0; m < 16; ++m) {
    if (t * 16 + m < rows)
      x_to_bf16(x + (t * 16 + m) * in, in, rounded.data() + m * in);
    else
      std::fill(rounded.begin() + m * in, rounded.begin() + (m + 1) * in, uint16_t(0));
  }
  for (int64_t i0 = 0; i0 < half; i0 += 16) {
    __m512i r[16];
    for (int m = 0; m < 16; ++m) r[m] = _mm512_loadu_si512(pairs + m * half + i0);
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (t * half + i0 + j) * 16, r[j]);
  }
}

// every tile of x, the tiles split across the threads (on the caller alone it was 3-4 % of a 128-token piece, the
// workers waiting)
struct PairsJob : Job {
  const float* x;
  int64_t rows, in;
  uint16_t* out;
  void work() override {
    const int64_t tiles = (rows + 15) / 16;
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tiles;) x_to_bf16_pairs_tile(x, rows, in, out, t);
  }
};

void x_to_bf16_pairs(const float* x, int64_t rows, int64_t in, uint16_t* out) {
  PairsJob job;
  job.x = x, job.rows = rows, job.in = in, job.out = out;
  run(&job, rows > 16);
}

// C tile `c` (16 weight rows from o, 16 rows of x from 16t) into y, transposed in registers, with the biases (0 added
// where there are none, as the other forms add it)
MSLLM_AVX512 inline void tile_out(const float* c, int64_t o, int64_t t, int64_t rows, const float* b, float* y,
                                  int64_t ldy) {
  const int64_t valid = std::min<int64_t>(16, rows - 16 * t);
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(c + n * 16);
  transpose16(r);
  const __m512 bias = b ? _mm512_loadu_ps(b + o) : _mm512_setzero_ps();
  for (int64_t m = 0; m < valid; ++m)
    _mm512_storeu_ps(y + (16 * t + m) * ldy + o, _mm512_add_ps(_mm512_castsi512_ps(r[m]), bias));
}

// 2 blocks of 16 weight rows (from o) by 2 tiles of x (from tile t; the second left out when NT is 1): tiles 0-1 A,
// 2-3 B, 4-7 C, each load taken by two products (the 3 x 1 blocking reloaded every block of weights for each tile
// of x: 4 loads for 3 products, the weights read again from L2 by every 16 rows of x)
template <int NT>
MSLLM_AMX_BF16 void pair_amx_bf16(const bf16* w, const uint16_t* xp, int64_t in, int64_t o, int64_t t, bool first,
                                  const bf16* next, int r0, int r1, float (*c)[256]) {
  const int64_t stride = in * int64_t(sizeof(bf16));
  const bf16* w0 = w + o * in;
  const bf16* w1 = w0 + 16 * in;
  const uint16_t* x0 = xp + t * in * 16;
  const uint16_t* x1 = x0 + in * 16;
  _tile_zero(4);
  _tile_zero(5);
  if (NT > 1) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t k = 0; k < in; k += 32) {
    if (first)  // the weights' first pass comes from memory: each row's line 4 steps ahead
      for (int r = 0; r < 32; ++r) _mm_prefetch(reinterpret_cast<const char*>(w0 + r * in + k + 128), _MM_HINT_T0);
    if (next != nullptr)  // rows [r0, r1) of the next pair of blocks into L2 meanwhile (each pass of x its share)
      for (int r = r0; r < r1; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * in + k), _MM_HINT_T1);
    _tile_loadd(0, w0 + k, stride);
    _tile_loadd(2, x0 + k * 16, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(1, w1 + k, stride);
    _tile_dpbf16ps(5, 1, 2);
    if (NT > 1) {
      _tile_loadd(3, x1 + k * 16, 64);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, c[0], 64);
  _tile_stored(5, c[1], 64);
  if (NT > 1) {
    _tile_stored(6, c[2], 64);
    _tile_stored(7, c[3], 64);
  }
}

// outputs [o, o + 32) for every row of x: tiles of x two at a time
MSLLM_AMX_BF16 void pairs_amx_bf16(const bf16* w, const uint16_t* xp, int64_t rows, int64_t in, const float* b,
                                   float* y, int64_t ldy, int64_t o, bool first, const bf16* next) {
  const int64_t tiles = (rows + 15) / 16, passes = (tiles + 1) / 2;
  alignas(64) float c[4][256];
  int64_t t = 0;
  for (; t + 2 <= tiles; t += 2) {
    const int p = int(t / 2);
    pair_amx_bf16<2>(w, xp, in, o, t, first && t == 0, next, int(32 * p / passes), int(32 * (p + 1) / passes), c);
    tile_out(c[0], o, t, rows, b, y, ldy);
    tile_out(c[1], o + 16, t, rows, b, y, ldy);
    tile_out(c[2], o, t + 1, rows, b, y, ldy);
    tile_out(c[3], o + 16, t + 1, rows, b, y, ldy);
  }
  if (t < tiles) {
    const int p = int(t / 2);
    pair_amx_bf16<1>(w, xp, in, o, t, first && t == 0, next, int(32 * p / passes), int(32 * (p + 1) / passes), c);
    tile_out(c[0], o, t, rows, b, y, ldy);
    tile_out(c[1], o + 16, t, rows, b, y, ldy);
  }
}

// outputs [o, o + 16) for every row of x (a matrix whose outputs are not whole pairs of blocks: its last 16)
MSLLM_AMX_BF16 void block_amx_bf16(const bf16* w, const uint16_t* xp, int64_t rows, int64_t in, const float* b,
                                   float* y, int64_t ldy, int64_t o) {
  const int64_t tiles = (rows + 15) / 16, stride = in * int64_t(sizeof(bf16));
  alignas(64) float c[256];
  for (int64_t t = 0; t < tiles; ++t) {
    _tile_zero(4);
    const uint16_t* xt = xp + t * in * 16;
    for (int64_t k = 0; k < in; k += 32) {
      _tile_loadd(2, xt + k * 16, 64);
      _tile_loadd(0, w + o * in + k, stride);
      _tile_dpbf16ps(4, 0, 2);
    }
    _tile_stored(4, c, 64);
    tile_out(c, o, t, rows, b, y, ldy);
  }
}

// The rows kernel of the tiles (bf16_prepare: `op` a Bf16Operand whose x is in x_to_bf16_pairs' layout): outputs
// [o0, o1) in pairs of blocks of 16 (pairs_amx_bf16), then 16; the last few (o1 - o0 not a multiple of 16: a
// matrix's last outputs) one by one
MSLLM_AMX_BF16 void rows_amx_bf16(const float*, int64_t rows, const void* op, const float* b, int64_t in, float* y,
                                  int64_t ldy, int64_t o0, int64_t o1) {
  const Bf16Operand& a = *static_cast<const Bf16Operand*>(op);
  const bf16* w = static_cast<const bf16*>(a.w);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  tile_configure(cfg);
  int64_t o = o0;
  for (; o + 32 <= o1; o += 32)  // the task's first block from memory, each next one prefetched while this one runs
    pairs_amx_bf16(w, a.xb, rows, in, b, y, ldy, o, o == o0, o + 64 <= o1 ? w + (o + 32) * in : nullptr);
  for (; o + 16 <= o1; o += 16) block_amx_bf16(w, a.xb, rows, in, b, y, ldy, o);
  tile_release();
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(a.xb);
  for (; o < o1; ++o)
    for (int64_t m = 0; m < rows; ++m) {
      const uint32_t* xm = pairs + (m / 16) * (in / 2) * 16 + m % 16;
      float s = 0.f;
      for (int64_t i = 0; i < in / 2; ++i) {
        const uint32_t p = xm[i * 16];
        s += to_f32(w[o * in + 2 * i]) * bits_to_float(p << 16) +
             to_f32(w[o * in + 2 * i + 1]) * bits_to_float(p & 0xffff0000u);
      }
      y[m * ldy + o] = s + (b ? b[o] : 0.f);
    }
}

// the AVX-512 rows kernel for bfloat16 weights, for a caller that hands it float32 x (matmul() and the q/k/v
// dispatch prepare x once for all their tasks instead): this form where it runs, x rounded in each call (not the
// tiles: their x layout is made once per call of matmul(), their tasks whole pairs of blocks, bf16_task_rows)
MSLLM_AVX512 void rows_avx512_bf16(const float* x, int64_t rows, const void* wv, const float* b, int64_t in,
                                   float* y, int64_t ldy, int64_t o0, int64_t o1) {
  thread_local std::vector<uint16_t> xb;
  if (const RowsFn fn = bf16_prepare(x, rows, in, xb, false)) {
    const Bf16Operand a{wv, xb.data()};
    return fn(x, rows, &a, b, in, y, ldy, o0, o1);
  }
  rows_avx512<bf16>(x, rows, wv, b, in, y, ldy, o0, o1);
}

// ---- AVX512-BF16 GEMM: a prompt's rows against bfloat16 weights where there are no AMX tiles ---------------------
// From BF16_GEMM_ROWS rows (a chunk call's 16 step rows and a piece of up to 128 tokens, a prompt, a step of 32
// sequences) the rows form's dot products (a horizontal sum per output, x reloaded per weight row) fall behind a
// GEMM, and the float32 GEMM on widened weights is bound by its FMAs (377 GF/s at 144 rows of 4864 x 896 on an AMD
// EPYC Zen 5, 2 cores: docs/performance-log.md 53). This GEMM multiplies x rounded to bfloat16 once per call (as the rows form and the
// tiles round it) by vdpbf16ps, two multiply-adds a lane an instruction: a block of W (inputs [pc, pc + kc) of 64
// outputs) is packed once per task as bfloat16 pairs, 64 outputs a pair of inputs (bp[i][j] = (W[j][2i], W[j][2i+1])
// as one uint32: 16 rows of W transposed as 32-bit elements in registers), in L2 while every row of x passes over it;
// a tile is 6 rows of x by those 64 outputs, 24 float32 accumulators, each pair of x broadcast against 4 vectors of W.
constexpr int64_t BF16_GEMM_NR = 64;    // outputs per packed block and per tile (NC: a GEMM task's outputs)
constexpr int64_t BF16_GEMM_KC = 1024;  // at most this many inputs per packed block (128 KB of pairs)
static_assert(BF16_GEMM_NR == NC, "a task's outputs are one packed block");

// W[n0 .. n0 + ncols) x [k0 .. k0 + kc) (kc a multiple of 32) as bfloat16 pairs into bp (zeros past ncols)
MSLLM_AVX512 void pack_bf16_pairs(const bf16* w, int64_t in, int64_t n0, int64_t ncols, int64_t k0, int64_t kc,
                                  uint32_t* bp) {
  for (int64_t h = 0; h < BF16_GEMM_NR; h += 16) {
    const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(16, ncols - h));
    const bf16* src = w + (n0 + h) * in + k0;
    for (int64_t k = 0; k < kc; k += 32) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        if (j < valid) {
          _mm_prefetch(reinterpret_cast<const char*>(src + j * in + k + 128), _MM_HINT_T0);
          r[j] = _mm512_loadu_si512(src + j * in + k);
        } else {
          r[j] = _mm512_setzero_si512();
        }
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(bp + (k / 2 + i) * BF16_GEMM_NR + h, r[i]);
    }
  }
}

// y[R x ncols] (+)= xb[R x kc] . block (pairs bp), xb rows lda apart (bfloat16), y rows ldy apart; first: y = bias
// (or 0) + product. ncols <= 64 (masked past it).
template <int R>
MSLLM_AVX512_BF16 void micro_dpbf16(int64_t kc, const uint16_t* xb, int64_t lda, const uint32_t* bp, float* y,
                                    int64_t ldy, int64_t ncols, bool first, const float* bias) {
  __mmask16 mask[4];
  for (int q = 0; q < 4; ++q) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, ncols - 16 * q));
    mask[q] = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  }
  __m512 acc[R][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q)
      acc[r][q] = first ? (bias != nullptr ? _mm512_maskz_loadu_ps(mask[q], bias + 16 * q) : _mm512_setzero_ps())
                        : _mm512_maskz_loadu_ps(mask[q], y + r * ldy + 16 * q);
  const int64_t pairs = kc / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    const uint32_t* bi = bp + i * BF16_GEMM_NR;
    const __m512bh b0 = (__m512bh)_mm512_load_si512(bi), b1 = (__m512bh)_mm512_load_si512(bi + 16);
    const __m512bh b2 = (__m512bh)_mm512_load_si512(bi + 32), b3 = (__m512bh)_mm512_load_si512(bi + 48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xb + r * lda + 2 * i, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, b3);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) _mm512_mask_storeu_ps(y + r * ldy + 16 * q, mask[q], acc[r][q]);
}

typedef void (*MicroBf16Fn)(int64_t, const uint16_t*, int64_t, const uint32_t*, float*, int64_t, int64_t, bool,
                            const float*);
const MicroBf16Fn k_micro_dpbf16[MR + 1] = {nullptr, micro_dpbf16<1>, micro_dpbf16<2>, micro_dpbf16<3>,
                                            micro_dpbf16<4>, micro_dpbf16<5>, micro_dpbf16<6>};

// y[m0..m1, n0..n1) = x[m0..m1) . W[n0..n1)^T (+ b), a GemmFn whose `wv` is a Bf16Operand (x rounded in its xb, `in`
// a multiple of 32: bf16_gemm_takes): one GEMM task, n1 - n0 <= 64.
MSLLM_AVX512_BF16 void gemm_block_dpbf16(const float* x, const void* wv, const float* b, int64_t in, int64_t out,
                                         float* y, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const Bf16Operand& a = *static_cast<const Bf16Operand*>(wv);
  const bf16* w = static_cast<const bf16*>(a.w);
  const int64_t ncols = n1 - n0;
  const int64_t blocks = (in + BF16_GEMM_KC - 1) / BF16_GEMM_KC;
  const int64_t block = ((in + blocks - 1) / blocks + 31) / 32 * 32;
  uint32_t* bp = reinterpret_cast<uint32_t*>(t_scratch.get(size_t(block / 2 * BF16_GEMM_NR)));
  if (bp == nullptr) {  // no memory for the packed block: the float32 rows form needs none
    rows_avx512<bf16>(x + m0 * in, m1 - m0, w, b, in, y + m0 * out, out, n0, n1);
    return;
  }
  const float* bias = b != nullptr ? b + n0 : nullptr;
  for (int64_t pc = 0; pc < in; pc += block) {
    const int64_t kc = std::min(block, in - pc);
    pack_bf16_pairs(w, in, n0, ncols, pc, kc, bp);
    for (int64_t ic = m0; ic < m1; ic += MC) {
      const int64_t mc = std::min(MC, m1 - ic);
      int64_t ir = ic;
      for (; ir + MR <= ic + mc; ir += MR)
        micro_dpbf16<MR>(kc, a.xb + ir * in + pc, in, bp, y + ir * out + n0, out, ncols, pc == 0, bias);
      if (ir < ic + mc)
        k_micro_dpbf16[ic + mc - ir](kc, a.xb + ir * in + pc, in, bp, y + ir * out + n0, out, ncols, pc == 0, bias);
    }
  }
}
#endif

// ---- NEON (AArch64: the Atlas hosts' Kunpeng 920, ARMv8.2) -------------------------------------------
// The AVX2 forms' shapes in 128-bit registers: one row of x against one weight row at a time (a sequential stream
// per thread), more rows of x in tiles of up to 4 that widen each weight once per tile. 16-bit weights are widened
// in registers (float16: FCVTL; bfloat16: a 16-bit shift left), all arithmetic float32 FMA. No GEMM form (the rows
// form takes every M, as the generic path does). Compile-tested with Debian's cross compiler and run under
// qemu-user against float64 references (tests/test_neon_kernels.py); its speed on a Kunpeng has not been measured.
#ifdef MSLLM_NEON
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const f16* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
inline float32x4_t load4(const bf16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}

// R rows of x (R <= 4) against one weight row: two accumulators per row of x, 8 inputs a step
template <class T, int R>
inline void tile_neon(const float* x, const T* wo, int64_t in, float* out) {
  const int64_t in8 = in & ~int64_t(7);
  float32x4_t acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vdupq_n_f32(0.f);
  for (int64_t i = 0; i < in8; i += 8) {
    const float32x4_t w0 = load4(wo + i), w1 = load4(wo + i + 4);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = vfmaq_f32(acc[r][0], w0, vld1q_f32(x + r * in + i));
      acc[r][1] = vfmaq_f32(acc[r][1], w1, vld1q_f32(x + r * in + i + 4));
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1]));
    for (int64_t i = in8; i < in; ++i) s += to_f32(wo[i]) * x[r * in + i];
    out[r] = s;
  }
}

// one row of x: four accumulators, 16 inputs a step
template <class T>
inline float dot_neon(const float* x, const T* wo, int64_t in) {
  const int64_t in16 = in & ~int64_t(15);
  float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i < in16; i += 16) {
    a0 = vfmaq_f32(a0, load4(wo + i), vld1q_f32(x + i));
    a1 = vfmaq_f32(a1, load4(wo + i + 4), vld1q_f32(x + i + 4));
    a2 = vfmaq_f32(a2, load4(wo + i + 8), vld1q_f32(x + i + 8));
    a3 = vfmaq_f32(a3, load4(wo + i + 12), vld1q_f32(x + i + 12));
  }
  for (; i + 4 <= in; i += 4) a0 = vfmaq_f32(a0, load4(wo + i), vld1q_f32(x + i));
  float s = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
  for (; i < in; ++i) s += to_f32(wo[i]) * x[i];
  return s;
}

template <class T>
void rows_neon(const float* x, int64_t rows, const void* wv, const float* b, int64_t in, float* y, int64_t ldy,
               int64_t o0, int64_t o1) {
  const T* w = static_cast<const T*>(wv);
  float out[4];
  for (int64_t o = o0; o < o1; ++o) {
    const T* wo = w + o * in;
    const float bias = b ? b[o] : 0.f;
    if (rows == 1) {
      y[o] = dot_neon(x, wo, in) + bias;
      continue;
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      tile_neon<T, 4>(x + r * in, wo, in, out);
      for (int k = 0; k < 4; ++k) y[(r + k) * ldy + o] = out[k] + bias;
    }
    for (; r + 2 <= rows; r += 2) {
      tile_neon<T, 2>(x + r * in, wo, in, out);
      for (int k = 0; k < 2; ++k) y[(r + k) * ldy + o] = out[k] + bias;
    }
    if (r < rows) y[r * ldy + o] = dot_neon(x + r * in, wo, in) + bias;
  }
}

template <class T>
void widen_rows_neon(const void* src, int64_t n, float* dst) {
  const T* s = static_cast<const T*>(src);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, load4(s + i));
  for (; i < n; ++i) dst[i] = to_f32(s[i]);
}
#endif

// ---- the kernels this machine runs ---------------------------------------------------------------

struct Kernels {
  RowsFn rows[3];
  GemmFn gemm[3];  // null: no GEMM form, the rows form takes every M
  WidenFn widen[3];
  GemmFn gemm_quant;  // int8/int4 weights (a QuantWeight) past QUANT_ROWS_MAX rows; null: matmul_quant.cc's own
};

Kernels pick_kernels() {
  const Kernels generic = {{rows_generic<float>, rows_generic<f16>, rows_generic<bf16>},
                           {nullptr, nullptr, nullptr},
                           {widen_rows_generic<float>, widen_rows_generic<f16>, widen_rows_generic<bf16>}, nullptr};
  switch (isa()) {
#ifdef MSLLM_X86
    // AVX-512: the GEMM's tiles, and the GEMV for one row of x; the packing and the GEMV for more rows stay AVX2
    case ISA_AVX512:
      return {{rows_avx512<float>, rows_avx512<f16>, rows_avx512_bf16},
              {gemm_block_avx2<float, k_micro512>, gemm_block_avx2<f16, k_micro512>,
               gemm_block_avx2<bf16, k_micro512>},
              {widen_rows_avx2<float>, widen_rows_avx2<f16>, widen_rows_avx2<bf16>}, gemm_block_quant_avx2<k_micro512>};
    case ISA_AVX2:
      return {{rows_avx2<float>, rows_avx2<f16>, rows_avx2<bf16>},
              {gemm_block_avx2<float, k_micro>, gemm_block_avx2<f16, k_micro>, gemm_block_avx2<bf16, k_micro>},
              {widen_rows_avx2<float>, widen_rows_avx2<f16>, widen_rows_avx2<bf16>}, gemm_block_quant_avx2<k_micro>};
#endif
#ifdef MSLLM_NEON
    case ISA_NEON:
      return {{rows_neon<float>, rows_neon<f16>, rows_neon<bf16>},
              {nullptr, nullptr, nullptr},
              {widen_rows_neon<float>, widen_rows_neon<f16>, widen_rows_neon<bf16>}, nullptr};
#endif
    default:
      return generic;
  }
}

const Kernels g_kernels = pick_kernels();

// ---- the jobs ------------------------------------------------------------------------------------

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

#ifdef MSLLM_X86
// y[i] = silu(y[i]) * u[i] for n values, 16 a vector (the last ones masked: every value the same operations wherever
// a task's outputs begin and end). exp(-v) as Cephes' expf: 2^k e^r with k = round(-v log2 e), r = -v - k ln 2 in two
// parts, e^r = 1 + r + r^2 P(r) (common.h EXP_POLY: within 1 ulp of exp on |r| <= ln2 / 2), scaled by vscalefps
// (overflow to inf, underflow to 0 as exp); -v clamped to [-104, 89] first, past which exp is 0 or inf in float32
// (NaN passes through). The scalar std::exp took 17 % of a 128-token SmolLM2 piece with bfloat16 AMX tiles.
MSLLM_AVX512 void silu_times_avx512(float* y, const float* u, int64_t n) {
  const __m512 lo = _mm512_set1_ps(-104.f), hi = _mm512_set1_ps(89.f), log2e = _mm512_set1_ps(EXP_LOG2E);
  const __m512 c1 = _mm512_set1_ps(EXP_LN2_HI), c2 = _mm512_set1_ps(EXP_LN2_LO), one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, y + i);
    const __m512 x = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_sub_ps(_mm512_setzero_ps(), v)));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(k, c2, _mm512_fnmadd_ps(k, c1, x));
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int j = 1; j < 6; ++j) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[j]));
    const __m512 e = _mm512_scalef_ps(_mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), one), k);
    const __m512 s = _mm512_div_ps(v, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
  }
}
#endif

// y[i] = silu(y[i]) * u[i]: the AVX-512 form's exp on that path, std::exp elsewhere (one form per process: a value is
// the same in a step, a verify and a prompt)
inline void silu_times(float* y, const float* u, int64_t n) {
#ifdef MSLLM_X86
  if (isa() == ISA_AVX512) return silu_times_avx512(y, u, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = silu(y[i]) * u[i];
}

// What follows a matmul in the fused ops, on y's columns [o0, o1) of `rows` rows (y and r have `out` columns,
// u `ldu`): with `up`, y = silu(y) * u (u = x . Wup^T); with a residual r, y += r.
void epilogue(float* y, int64_t rows, int64_t out, int64_t o0, int64_t o1, const float* u, int64_t ldu,
              const float* r) {
  for (int64_t m = 0; m < rows; ++m) {
    float* ym = y + m * out;
    if (u != nullptr) silu_times(ym + o0, u + m * ldu + o0, o1 - o0);
    if (r != nullptr)
      for (int64_t o = o0; o < o1; ++o) ym[o] += r[m * out + o];
  }
}

// The epilogue of a GEMM's product(s) (y and u [rows, out]), threads splitting the rows of x.
struct EpilogueJob : Job {
  float* y;
  int64_t rows, out;
  const float* u;
  const float* residual;
  void work() override {
    for (int64_t m; (m = next.fetch_add(1, std::memory_order_relaxed)) < rows;)
      epilogue(y + m * out, 1, out, 0, out, u != nullptr ? u + m * out : nullptr, out,
               residual != nullptr ? residual + m * out : nullptr);
  }
};

void epilogue_tasks(float* y, int64_t rows, int64_t out, const float* u, const float* residual) {
  EpilogueJob job;
  job.y = y, job.rows = rows, job.out = out, job.u = u, job.residual = residual;
  run(&job, rows * out >= 64 * 1024);
}

// The GEMV form, threads splitting the output rows; optionally the fused ops' epilogue on each task's rows.
struct GemvJob : Job {
  RowsFn fn;
  const float* x;
  int64_t rows;
  const void* w;
  const float* b;
  int64_t in, out, step;
  float* y;
  const void* up = nullptr;  // SwiGLU: y = silu(x . W^T) * (x . up^T)
  const float* residual = nullptr;  // y += residual

  Shares shares;

  void work() override {
    // x . up^T for this task's outputs, u[m * step + o - o0]: sized by the task (a form's task may be longer than
    // ROWS_PER_TASK: bf16_task_rows rounds to whole pairs of blocks of 16) and by the rows (a prompt's, by the tiles)
    thread_local std::vector<float> ubuf;
    if (up != nullptr && ubuf.size() < size_t(rows * step)) ubuf.resize(size_t(rows * step));
    float* u = ubuf.data();
    shares.claim([&](int64_t t) {
      const int64_t o0 = t * step, o1 = std::min(out, o0 + step);
      fn(x, rows, w, b, in, y, out, o0, o1);
      if (up != nullptr) fn(x, rows, up, nullptr, in, u - o0, step, o0, o1);
      if (up != nullptr || residual != nullptr)
        epilogue(y, rows, out, o0, o1, up != nullptr ? u - o0 : nullptr, step, residual);
    });
  }
};

struct GemmJob : Job {
  GemmFn fn;
  const float* x;
  const void* w;
  const float* b;
  int64_t rows, in, out;
  float* y;
  int64_t col_tasks, row_step, tasks;

  void work() override {
    for (;;) {
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= tasks) return;
      const int64_t n0 = (t % col_tasks) * NC, m0 = (t / col_tasks) * row_step;
      fn(x, w, b, in, out, y, m0, std::min(rows, m0 + row_step), n0, std::min(out, n0 + NC));
    }
  }
};

// A lookup's i-th id, of int64 or int32 ids.
inline int64_t id_at(const void* ids, bool ids64, int64_t i) {
  return ids64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
}

struct EmbedJob : Job {
  WidenFn widen;
  const void* ids;
  bool ids64;
  const char* table;
  int64_t row_bytes, width, n;
  float* y;

  void work() override {
    constexpr int64_t IDS_PER_TASK = 16;
    for (;;) {
      const int64_t i0 = next.fetch_add(IDS_PER_TASK, std::memory_order_relaxed);
      if (i0 >= n) return;
      for (int64_t i = i0; i < std::min(n, i0 + IDS_PER_TASK); ++i) {
        const int64_t id = id_at(ids, ids64, i);
        widen(table + id * row_bytes, width, y + i * width);
      }
    }
  }
};

// A quantized table's lookup (embed_quant): rows of int8 [V, E], or int4 two per byte [V, E / 2] (input 2j in the
// low nibble, two's complement), and float32 scale [G, V] (and offset [G, V]) per group of E / G inputs of a row:
// y = (q + offset) * scale in float32, as the plain ops compute it (export/network/layers.py Embedding).
struct EmbedQuantJob : Job {
  const void* ids;
  bool ids64, packed;
  const uint8_t* q;
  const float *scale, *offset;
  int64_t vocab, width, groups, n;
  float* y;

  void work() override {
    constexpr int64_t IDS_PER_TASK = 16;
    const int64_t group = width / groups, row_bytes = packed ? width / 2 : width;
    for (;;) {
      const int64_t i0 = next.fetch_add(IDS_PER_TASK, std::memory_order_relaxed);
      if (i0 >= n) return;
      for (int64_t i = i0; i < std::min(n, i0 + IDS_PER_TASK); ++i) {
        const int64_t id = id_at(ids, ids64, i);
        const uint8_t* row = q + id * row_bytes;
        float* out = y + i * width;
        for (int64_t g = 0; g < groups; ++g) {
          const float s = scale[g * vocab + id], o = offset ? offset[g * vocab + id] : 0.f;
          float* dst = out + g * group;
          if (packed) {
            const uint8_t* src = row + g * group / 2;
            for (int64_t j = 0; j < group / 2; ++j) {
              const int lo = src[j] & 15, hi = src[j] >> 4;
              dst[2 * j] = offset ? (float(lo - ((lo & 8) << 1)) + o) * s : float(lo - ((lo & 8) << 1)) * s;
              dst[2 * j + 1] = offset ? (float(hi - ((hi & 8) << 1)) + o) * s : float(hi - ((hi & 8) << 1)) * s;
            }
          } else {
            const int8_t* src = reinterpret_cast<const int8_t*>(row) + g * group;
            if (offset) {
              for (int64_t j = 0; j < group; ++j) dst[j] = (float(src[j]) + o) * s;
            } else {
              for (int64_t j = 0; j < group; ++j) dst[j] = float(src[j]) * s;
            }
          }
        }
      }
    }
  }
};

}  // namespace

RowsFn rows_kernel(WType wt) { return wt == W_QUANT ? quant_rows_kernel() : g_kernels.rows[wt]; }

WidenFn widen_kernel(WType wt) { return wt == W_QUANT ? nullptr : g_kernels.widen[wt]; }

bool has_gemm(WType wt) { return wt == W_QUANT || g_kernels.gemm[wt] != nullptr; }

RowsFn bf16_prepare(const float* x, int64_t rows, int64_t in, std::vector<uint16_t>& xb, bool tiles) {
#ifdef MSLLM_X86
  if (tiles && rows >= BF16_MIN_ROWS && in % 32 == 0 && g_bf16_tiles && tiles_on() &&
      quant_activations() != ACTIVATIONS_EXACT) {
    xb.resize(size_t((rows + 15) / 16 * 16 * in));
    x_to_bf16_pairs(x, rows, in, xb.data());
    return rows_amx_bf16;
  }
  if (rows >= BF16_MIN_ROWS && rows <= BF16_MAX_ROWS && g_bf16_form && quant_activations() != ACTIVATIONS_EXACT) {
    xb.resize(size_t(rows * in));
    x_to_bf16(x, rows * in, xb.data());
    return rows_dpbf16_prepared;
  }
#endif
  (void)x, (void)rows, (void)in, (void)xb, (void)tiles;
  return nullptr;
}

namespace {

// matmul()'s bfloat16 GEMM (gemm_block_dpbf16) where it runs: from BF16_GEMM_ROWS rows of x (fewer: bf16_prepare's
// rows form), `in` whole blocks of 32 (else the rows form up to BF16_MAX_ROWS, the float32 GEMM past it), the
// AVX512-BF16 form here and the tiles not (they take every count from BF16_MIN_ROWS), activations not held exact: x
// rounded to bfloat16 into `xb` (row-major), and the GemmFn that reads Bf16Operands as its weights; else nullptr.
GemmFn bf16_gemm_prepare(const float* x, int64_t rows, int64_t in, std::vector<uint16_t>& xb) {
#ifdef MSLLM_X86
  if (rows >= BF16_GEMM_ROWS && in % 32 == 0 && g_bf16_form && !(g_bf16_tiles && tiles_on()) &&
      quant_activations() != ACTIVATIONS_EXACT) {
    xb.resize(size_t(rows * in));
    x_to_bf16(x, rows * in, xb.data());
    return gemm_block_dpbf16;
  }
#endif
  (void)x, (void)rows, (void)in, (void)xb;
  return nullptr;
}

}  // namespace

bool bf16_tiles_here() {
#ifdef MSLLM_X86
  return g_bf16_tiles;
#else
  return false;
#endif
}

int64_t bf16_task_rows(RowsFn fn, int64_t out) {
#ifdef MSLLM_X86
  if (fn == rows_amx_bf16)
    return std::max<int64_t>(32, (task_rows(out) + 16) / 32 * 32);  // whole pairs of blocks, the nearest count
#endif
  (void)fn, (void)out;
  return 0;
}

const char* bf16_form() {
#ifdef MSLLM_X86
  if (g_bf16_form) return "avx512_bf16";
#endif
  return "float32";
}

namespace {

void gemm_tasks(GemmFn gemm, const float* x, int64_t rows, const void* w, const float* b, int64_t in, int64_t out,
                float* y);

// The GEMV form of matmul(): threads split the output rows, each task with the fused ops' epilogue on its rows
void gemv_rows(RowsFn fn, const float* x, int64_t rows, const void* w, const float* b, int64_t in, int64_t out,
               float* y, const void* up, const float* residual, int64_t step = 0) {
  GemvJob job;
  job.fn = fn;
  job.x = x, job.rows = rows, job.w = w, job.b = b, job.in = in, job.out = out, job.y = y;
  job.up = up, job.residual = residual;
  job.step = step > 0 ? step : task_rows(out);
  job.shares.split((out + job.step - 1) / job.step, out >= MIN_PARALLEL_ROWS ? threads_to_use() : 1);
  run(&job, out >= MIN_PARALLEL_ROWS);
}

// The rows of x [rows, in] past the zero rows at either end: [*first, *last). A graph's layers leave out a step's idle
// rows and a piece's padding and write them zero (decode_ops.cc decode_layer, ops.h ValidRows), and the final norm
// keeps them zero: the head (the one matmul after the layers, over every row of the graph) then computes only the
// rows between (docs/architecture.md "Step graphs of fewer rows"; a verify of 2 tokens on an int8 SmolLM2 folder
// 1.70 -> 1.12 steps, performance-log.md 65). A row of zeros gives y = b (x . W^T is 0 for finite W), which
// `matmul_rows_between` writes for them; such rows are never read but are written as computed.
void nonzero_rows(const float* x, int64_t rows, int64_t in, int64_t* first, int64_t* last) {
  const auto zero = [&](int64_t r) {
    const float* xr = x + r * in;
    for (int64_t i = 0; i < in; ++i)
      if (xr[i] != 0.f) return false;
    return true;
  };
  int64_t f = 0, l = rows;
  while (f < l && zero(f)) ++f;
  while (l > f && zero(l - 1)) --l;
  *first = f, *last = l;
}

// matmul() of the rows between the zero rows at either end (nonzero_rows), y = b (or 0) for those
void matmul_rows_between(const float* x, int64_t rows, const void* w, WType wt, const float* b, int64_t in,
                         int64_t out, float* y) {
  int64_t first = 0, last = rows;
  if (rows > 1) nonzero_rows(x, rows, in, &first, &last);
  const auto bias_rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = 0; o < out; ++o) y[r * out + o] = b ? b[o] : 0.f;
  };
  bias_rows(0, first);
  bias_rows(last, rows);
  if (last > first) matmul(x + first * in, last - first, w, wt, b, in, out, y + first * out);
}

}  // namespace

// x [M, I] . W[O, I]^T (+ b [O]) -> y [M, O]. With `prompt_rows` (the full graph's form, MsliteLlmGemmValid) a
// valid_length [B] int32 input comes before y: x holds B rows of n = M / B tokens, right-padded, and only each
// row's first valid_length tokens are computed, the padding rows zeroed: a prompt of 100 tokens in the
// 128-token graph costs 100 rows, not 128.
int gemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_bias,
         bool prompt_rows) {
  const int expected = 3 + (with_bias ? 1 : 0) + (prompt_rows ? 1 : 0);
  if (nparam != expected) return 1;
  const int vi = nparam - 2;  // valid_length, with prompt_rows
  const WType wt = weight_type(dtypes[1]);
  if (!is_f32(dtypes[0]) || wt == W_NONE || !is_f32(dtypes[nparam - 1]) || (with_bias && !is_f32(dtypes[2])) ||
      (prompt_rows && std::strcmp(dtypes[vi], "int32") != 0))
    return 2;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[nparam - 1] != 2 || (with_bias && ndims[2] != 1) ||
      (prompt_rows && ndims[vi] != 1))
    return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], out = shapes[1][0];
  const int64_t batch = prompt_rows ? shapes[vi][0] : 1;
  if (shapes[1][1] != in || shapes[nparam - 1][0] != rows || shapes[nparam - 1][1] != out) return 4;
  if ((with_bias && shapes[2][0] != out) || batch <= 0 || rows % batch) return 4;
  const float* x = static_cast<const float*>(params[0]);
  const void* w = params[1];
  const float* b = with_bias ? static_cast<const float*>(params[2]) : nullptr;
  float* y = static_cast<float*>(params[nparam - 1]);
  if (rows <= 0 || out <= 0) return 0;
  if (in <= 0) {  // an empty sum
    if (prompt_rows) return 4;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) y[r * out + o] = b ? b[o] : 0.f;
    return 0;
  }
  if (!prompt_rows) {
    matmul_rows_between(x, rows, w, wt, b, in, out, y);
    return 0;
  }
  const int32_t* valid = static_cast<const int32_t*>(params[vi]);
  const int64_t n = rows / batch;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t used = std::max<int64_t>(0, std::min<int64_t>(n, valid[r]));
    if (used > 0) matmul(x + r * n * in, used, w, wt, b, in, out, y + r * n * out);
    std::fill(y + (r * n + used) * out, y + (r + 1) * n * out, 0.f);
  }
  return 0;
}

// y [rows, out] = x [rows, in] . W^T (+ b), shapes already checked, rows, out and in positive. The fused ops'
// epilogue (see `epilogue`): `up` [out, in] of W's dtype for SwiGLU, `residual` [rows, out] to add.
void matmul(const float* x, int64_t rows, const void* w, WType wt, const float* b, int64_t in, int64_t out,
            float* y, const void* up, const float* residual) {
  const bool fused = up != nullptr || residual != nullptr;
  // A rows kernel (any count of rows: the GEMV form's, the quantized forms', the tiles') takes the epilogue in each
  // of its tasks, on the outputs it has just computed; the GEMMs compute the product(s), then the epilogue
  // (epilogue_tasks). Either way each output is the same float32 operations.
  if (wt == W_QUANT) {  // matmul_quant.cc's: its rows kernel reads x prepared, once per call (and per layout)
    const QuantWeight& wq = *static_cast<const QuantWeight*>(w);
    if (quant_rows_take(wq, rows)) {
      if (!fused) return quant_matmul(x, rows, wq, b, y);
      QuantWeight ws[2] = {wq, up != nullptr ? *static_cast<const QuantWeight*>(up) : wq};
      PreparedX px[2];
      prepare_each(x, rows, ws, up != nullptr ? 2 : 1, px);
      return gemv_rows(quant_rows_kernel(), x, rows, &ws[0], b, in, out, y, up != nullptr ? &ws[1] : nullptr,
                       residual, quant_task_rows(ws[0]));
    }
  }
  thread_local std::vector<uint16_t> xb;
  Bf16Operand ops[2] = {{w, nullptr}, {up, nullptr}};
  GemmFn gemm = wt == W_QUANT ? g_kernels.gemm_quant : g_kernels.gemm[wt];  // (gemm[] has no W_QUANT entry)
  if (wt == W_BF16) {  // the AVX512-BF16 GEMM, rows form or tiles where they run: x rounded once
    if (const GemmFn g = bf16_gemm_prepare(x, rows, in, xb)) {
      gemm = g;
      ops[0].xb = ops[1].xb = xb.data();
    } else if (const RowsFn fn = bf16_prepare(x, rows, in, xb)) {
      ops[0].xb = ops[1].xb = xb.data();
      return gemv_rows(fn, x, rows, &ops[0], b, in, out, y, up != nullptr ? &ops[1] : nullptr, residual,
                       bf16_task_rows(fn, out));
    }
  }
  if (wt != W_QUANT && (rows <= GEMV_MAX_ROWS || gemm == nullptr))
    return gemv_rows(g_kernels.rows[wt], x, rows, w, b, in, out, y, up, residual);
  const auto product = [&](const void* wm, const float* bm, float* ym) {
    if (wt == W_QUANT && gemm == nullptr)  // the prompt: the float GEMM on packed weights, or quant_matmul's own
      return quant_matmul(x, rows, *static_cast<const QuantWeight*>(wm), bm, ym);
    gemm_tasks(gemm, x, rows, wm, bm, in, out, ym);
  };
  const bool pairs = ops[0].xb != nullptr;  // the bfloat16 GEMM reads Bf16Operands as its weights
  product(pairs ? &ops[0] : w, b, y);
  if (!fused) return;
  thread_local std::vector<float> u;
  if (up != nullptr) {
    u.resize(size_t(rows * out));
    product(pairs ? &ops[1] : up, nullptr, u.data());
  }
  epilogue_tasks(y, rows, out, up != nullptr ? u.data() : nullptr, residual);
}

namespace {

// The GEMM form of matmul(): tasks of NC outputs (and of rows of x when there are few outputs) over the pool
void gemm_tasks(GemmFn gemm, const float* x, int64_t rows, const void* w, const float* b, int64_t in, int64_t out,
                float* y) {
  GemmJob job;
  job.fn = gemm;
  job.x = x, job.w = w, job.b = b, job.rows = rows, job.in = in, job.out = out, job.y = y;
  job.col_tasks = (out + NC - 1) / NC;
  // few outputs (k/v projections): split the rows of x too, so that every thread has work
  const int threads = threads_to_use();
  int64_t row_tasks = 1;
  if (job.col_tasks < 4 * threads) row_tasks = std::min((4 * threads + job.col_tasks - 1) / job.col_tasks,
                                                        (rows + 4 * MR - 1) / (4 * MR));
  row_tasks = std::max<int64_t>(row_tasks, 1);
  job.row_step = ((rows + row_tasks - 1) / row_tasks + MR - 1) / MR * MR;
  job.tasks = job.col_tasks * ((rows + job.row_step - 1) / job.row_step);
  run(&job, rows * out * in >= MIN_PARALLEL_WORK);
}

}  // namespace

// x [M, K] f32, q (int8 [N, K] / uint8 [N, K / 2]), scale [G, N] f32[, offset [G, N] f32] -> y [M, N] f32
// (MsliteLlmQuantMatmul[Offset]): matmul_quant.cc's decode form up to 16 rows, the GEMM above beyond. With
// `prompt_rows` (MsliteLlmQuantMatmul[Offset]Valid, the full graph's form, as MsliteLlmGemmValid) a valid_length [B]
// int32 comes before y: x holds B rows of n = M / B tokens, right-padded, and only each row's first valid_length
// tokens are computed, the padding rows zeroed (a 100-token prompt in the 128-token graph costs 100 rows).
int quant_matmul_op(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_offset,
                    bool prompt_rows) {
  if (nparam != (with_offset ? 5 : 4) + (prompt_rows ? 1 : 0)) return 1;
  const int yi = nparam - 1, vi = nparam - 2;
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[yi]) || (prompt_rows && std::strcmp(dtypes[vi], "int32") != 0)) return 2;
  QuantWeight w;
  if (const int bad = read_quant_weight(params, ndims, shapes, dtypes, 1, with_offset, &w)) return bad;
  if (ndims[0] != 2 || ndims[yi] != 2 || (prompt_rows && ndims[vi] != 1)) return 3;
  const int64_t m = shapes[0][0], batch = prompt_rows ? shapes[vi][0] : 1;
  if (shapes[0][1] != w.k || shapes[yi][0] != m || shapes[yi][1] != w.n || batch <= 0 || m % batch) return 4;
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[yi]);
  if (m <= 0 || w.n <= 0) return 0;
  if (w.k <= 0) {  // an empty sum
    std::fill(y, y + m * w.n, 0.f);
    return 0;
  }
  if (!prompt_rows) {
    matmul_rows_between(x, m, &w, W_QUANT, nullptr, w.k, w.n, y);
    return 0;
  }
  const int32_t* valid = static_cast<const int32_t*>(params[vi]);
  const int64_t n = m / batch;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t used = std::max<int64_t>(0, std::min<int64_t>(n, valid[r]));
    if (used > 0) matmul(x + r * n * w.k, used, &w, W_QUANT, nullptr, w.k, w.n, y + r * n * w.n);
    std::fill(y + (r * n + used) * w.n, y + (r + 1) * n * w.n, 0.f);
  }
  return 0;
}

namespace {

// A lookup's ids (params[0], of rank ndims[0]) against its output y (params[yi]: ids' shape plus [width]) and a table
// of `vocab` rows: 0 with the ids' count in *n, else 4 (y's shape) or 5 (an id outside the table). Every id is read
// before anything is written: nothing is written for a bad call.
int lookup_ids(void** params, int* ndims, int64_t** shapes, bool ids64, int yi, int64_t width, int64_t vocab,
               int64_t* n) {
  int64_t count = 1;
  for (int d = 0; d < ndims[0]; ++d) {
    if (shapes[yi][d] != shapes[0][d]) return 4;
    count *= shapes[0][d];
  }
  if (shapes[yi][ndims[0]] != width) return 4;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = id_at(params[0], ids64, i);
    if (id < 0 || id >= vocab) return 5;
  }
  *n = count;
  return 0;
}

}  // namespace

int embed(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 3) return 1;
  const bool ids64 = std::strcmp(dtypes[0], "int64") == 0;
  const WType wt = weight_type(dtypes[1]);
  if ((!ids64 && std::strcmp(dtypes[0], "int32") != 0) || wt == W_NONE || !is_f32(dtypes[2])) return 2;
  if (ndims[0] < 0 || ndims[1] != 2 || ndims[2] != ndims[0] + 1) return 3;
  const int64_t vocab = shapes[1][0], width = shapes[1][1];
  int64_t n = 0;
  if (const int code = lookup_ids(params, ndims, shapes, ids64, 2, width, vocab, &n)) return code;
  EmbedJob job;
  job.widen = g_kernels.widen[wt];
  job.ids = params[0];
  job.ids64 = ids64;
  job.table = static_cast<const char*>(params[1]);
  job.row_bytes = width * (wt == W_F32 ? 4 : 2);
  job.width = width;
  job.n = n;
  job.y = static_cast<float*>(params[2]);
  run(&job, n * width >= MIN_PARALLEL_WORK);
  return 0;
}

int embed_quant(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 4 && nparam != 5) return 1;
  const bool ids64 = std::strcmp(dtypes[0], "int64") == 0, with_offset = nparam == 5;
  const bool packed = std::strcmp(dtypes[1], "uint8") == 0;
  const int yi = nparam - 1;
  if ((!ids64 && std::strcmp(dtypes[0], "int32") != 0) || (!packed && std::strcmp(dtypes[1], "int8") != 0) ||
      !is_f32(dtypes[2]) || (with_offset && !is_f32(dtypes[3])) || !is_f32(dtypes[yi]))
    return 2;
  if (ndims[0] < 0 || ndims[1] != 2 || ndims[2] != 2 || (with_offset && ndims[3] != 2) || ndims[yi] != ndims[0] + 1)
    return 3;
  const int64_t vocab = shapes[1][0], width = shapes[1][1] * (packed ? 2 : 1), groups = shapes[2][0];
  if (groups < 1 || shapes[2][1] != vocab || width % groups != 0 || (packed && (width / groups) % 2 != 0)) return 4;
  if (with_offset && (shapes[3][0] != groups || shapes[3][1] != vocab)) return 4;
  int64_t n = 0;
  if (const int code = lookup_ids(params, ndims, shapes, ids64, yi, width, vocab, &n)) return code;
  EmbedQuantJob job;
  job.ids = params[0];
  job.ids64 = ids64;
  job.packed = packed;
  job.q = static_cast<const uint8_t*>(params[1]);
  job.scale = static_cast<const float*>(params[2]);
  job.offset = with_offset ? static_cast<const float*>(params[3]) : nullptr;
  job.vocab = vocab;
  job.width = width;
  job.groups = groups;
  job.n = n;
  job.y = static_cast<float*>(params[yi]);
  run(&job, n * width >= MIN_PARALLEL_WORK);
  return 0;
}

}  // namespace msllm
