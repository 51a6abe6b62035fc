// mslite-llm CPU kernels for weight-only quantized linear layers (W8A16, W4A16), as MindSpore aot Custom ops:
// y = x . W^T with W kept as its integers and a float scale (and offset) per group of inputs (the op bodies
// quant_matmul_op and weight_quant_batch_matmul; registry.cc exports them).
//
// Why: the quantized folders of issue 31 keep GPTQ/AWQ weights as integers; on `--device cpu` they need int8 and int4
// matmuls, and a fused Atlas folder's WeightQuantBatchMatmul needs a CPU stand-in for `check` (as atlas_ops.cc's).
//
// Format: W is logically [N, K] (N outputs, K inputs), quantized per group along K: G groups of g = K / G consecutive
// inputs per output row (G = 1: per channel), dequantized as Ascend's aclnnWeightQuantBatchMatmulV2 antiquant does,
//   W[n, k] = (q[n, k] + offset[k / g, n]) * scale[k / g, n]        (offset absent: 0)
// q int8 [N, K] (-128..127), or uint8 [N, K / 2] (int4): byte j of row n holds q[n, 2j] in its low nibble and
// q[n, 2j + 1] in its high nibble, each a two's-complement 4-bit value (-8..7); K even. scale, offset [G, N].
//
// How: tasks are tiles of NT outputs by MB rows of x; the float weight matrix is never whole. All arithmetic is
// float32 with float32 accumulation, and every form uses the same float32 weight, (q + offset) * scale.
//   Few rows of x (decode, M <= FUSED_MAX_ROWS; AVX2, groups a multiple of 8): each weight is dequantized in registers
//     as it is loaded and multiplied into 1-4 rows of x (1 row by 8 weight rows, 2 by 4, 3-4 by 2): one pass over the
//     integers, nothing stored (2-3x the buffered form at 1-4 rows).
//   Otherwise, per task and block of KC inputs: the tile's weights are dequantized into a per-thread buffer of
//     NT x KC floats (L1), then either dot products of 3 rows of x by 4 weight rows (1 by 8 for one row) run over
//     it, or (AVX2, from PANEL_MIN_ROWS rows) it is transposed into a panel and 6 rows of x at a time are broadcast
//     against its 16 outputs; each weight is dequantized once per MB rows of x.
//
// Threads: the library's pool (pool.h), with its one thread count. Each thread takes its own contiguous share of
// tiles first (one weight stream per thread: pool.h's Shares), then what is left of the others'; a call with little
// work (MIN_PARALLEL_WORK) runs on the caller alone.
//
// ISA: the dequantization and the dot products have an AVX2+FMA form (target attributes; the AVX2 and AVX-512 paths
// of common.h's isa() run it) and a plain C++ one (elsewhere, or with MSLITE_LLM_CPU_KERNELS_ISA=generic, read at
// load).
// The dequantized weights are bit-identical in both; the sums differ only in their order.
//
// Interface (MindSpore aot CPU): int F(int nparam, void** params, int* ndims, int64_t** shapes,
// const char** dtypes, void* stream, void* extra); 0 on success, else 1 wrong number of tensors,
// 2 unsupported dtype, 3 wrong ranks, 4 shapes that do not fit (K not a multiple of G, an odd K for int4, the group
// size against K), 6 an antiquant_group_size that is not a whole number >= 0. q is int8 [N, K] or uint8 [N, K / 2].
//   MsliteLlmQuantMatmul:       x [M, K] f32, q, scale [G, N] f32 -> y [M, N] f32
//   MsliteLlmQuantMatmulOffset: x [M, K] f32, q, scale [G, N] f32, offset [G, N] f32 -> y [M, N] f32
//   MsliteLlmAtlasWeightQuantBatchMatmul (the stand-in of WeightQuantBatchMatmul, weight given transposed as [N, K]):
//     x [M, K] T, q, scale [G, N] T, [offset [G, N] T,] attrs [antiquant_group_size] f32 -> y [M, N] T
//     (T float16, bfloat16 or float32; with or without offset told apart by the number of tensors). Group size 0 is
//     per channel (G must be 1), else G * group_size must be K. As the op is documented: the weight (q + offset) *
//     scale is computed in float32 from the T values and rounded to T (the weight Ascend multiplies in T), then
//     x . W^T accumulated in float32 and rounded to T.
#include "common.h"
#include "dtypes.h"
#include "ops.h"
#include "pool.h"

namespace msllm {
namespace {

constexpr int64_t NT = 16;   // outputs per tile (a multiple of the dot products' 4 and 8)
constexpr int64_t KC = 256;  // inputs per dequantized block (even: an int4 block starts on a byte); NT x KC floats: L1
constexpr int64_t MB = 48;   // rows of x per task (a multiple of 3); MB x KC floats of x: L2
constexpr int64_t PANEL_MIN_ROWS = 6;  // rows of x from which the AVX2 buffered form packs the tile and broadcasts x
                                        // (no sums across lanes): even with the dot products at 6, ~10 % ahead at 16
constexpr int64_t FUSED_MAX_ROWS = 12;  // rows of x up to which the AVX2 form dequantizes in registers (decode; 2-3x
                                        // the buffered form's speed at 1-4 rows, ahead up to 12, behind at 16)
constexpr int64_t MIN_PARALLEL_WORK = int64_t(1) << 20;  // multiply-adds below which the caller runs alone (set
                                                         // when each call started its own threads; kept with the pool)

struct Problem {
  const float* x;  // [m, k]
  int64_t m, k, n;
  const void* q;  // int8 [n, k] or, int4, uint8 [n, k / 2]
  bool int4;
  const float* scale;   // [k / group, n]
  const float* offset;  // [k / group, n], or null: 0
  int64_t group;
  Dtype round;  // each dequantized weight rounded to this (the stand-in: its T); F32: used as computed
  float* y;     // [m, n]
};

// q[2j], q[2j + 1] from the low and high nibbles of byte j, signed, for `bytes` bytes
void unpack_int4(const uint8_t* src, int64_t bytes, int8_t* dst) {
  for (int64_t j = 0; j < bytes; ++j) {
    const int b = src[j];
    dst[2 * j] = int8_t(((b & 15) ^ 8) - 8);
    dst[2 * j + 1] = int8_t(((b >> 4) ^ 8) - 8);
  }
}

// ---- the forms: plain C++ and AVX2 ----------------------------------------------------------------

// dst[i] = (q[i] + offset[(k0 + i) / group * ld]) * scale[(k0 + i) / group * ld] for i < len, float32: one row's inputs
// [k0, k0 + len) from its integers q (at k0), its scales and offsets (offset null: 0) ld apart
typedef void (*DequantFn)(const int8_t* q, int64_t k0, int64_t len, int64_t group, const float* scale,
                          const float* offset, int64_t ld, float* dst);
// y[r * ldy + c] (+)= x_r . w_c over kc inputs, for rows r < rows of x (ldx apart) and weight rows c < cols of the
// tile w (NT rows KC apart, 64-byte aligned; rows past cols are zeros); panel: NT x KC floats of scratch, aligned
typedef void (*DotsFn)(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t kc, float* y, int64_t ldy,
                       int64_t cols, bool add, float* panel);

void dequant_generic(const int8_t* q, int64_t k0, int64_t len, int64_t group, const float* scale,
                     const float* offset, int64_t ld, float* dst) {
  for (int64_t i0 = 0, i1; i0 < len; i0 = i1) {  // one piece per group
    const int64_t gi = (k0 + i0) / group;
    i1 = std::min(len, (gi + 1) * group - k0);
    const float off = offset ? offset[gi * ld] : 0.f, s = scale[gi * ld];
    for (int64_t i = i0; i < i1; ++i) dst[i] = (float(q[i]) + off) * s;
  }
}

float dot_generic(const float* a, const float* b, int64_t n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

void dots_generic(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t kc, float* y, int64_t ldy,
                  int64_t cols, bool add, float*) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float s = dot_generic(x + r * ldx, w + c * KC, kc);
      y[r * ldy + c] = add ? y[r * ldy + c] + s : s;
    }
}

#ifdef MSLLM_X86
MSLLM_AVX2 void dequant_avx2(const int8_t* q, int64_t k0, int64_t len, int64_t group, const float* scale,
                             const float* offset, int64_t ld, float* dst) {
  for (int64_t i0 = 0, i1; i0 < len; i0 = i1) {  // one piece per group (a lambda would not inherit the target)
    const int64_t gi = (k0 + i0) / group;
    i1 = std::min(len, (gi + 1) * group - k0);
    const float off = offset ? offset[gi * ld] : 0.f, s = scale[gi * ld];
    const __m256 vo = _mm256_set1_ps(off), vs = _mm256_set1_ps(s);
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vo), vs));
    }
    for (; i < i1; ++i) dst[i] = (float(q[i]) + off) * s;
  }
}

// the sums of a, b, c, d, in that order
MSLLM_AVX2 inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// R rows of x by C weight rows (C a multiple of 4), one accumulator each; writes the first `cols` columns
template <int R, int C>
MSLLM_AVX2 inline void tile_avx2(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kc, float* y,
                                 int64_t ldy, int64_t cols, bool add) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * ldw + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c0 = 0; c0 < C; c0 += 4) {
      float s[4];
      _mm_storeu_ps(s, hsum4(acc[r][c0], acc[r][c0 + 1], acc[r][c0 + 2], acc[r][c0 + 3]));
      for (int c = c0; c < c0 + 4 && c < cols; ++c) {
        float v = s[c - c0];
        for (int64_t i = k; i < kc; ++i) v += x[r * ldx + i] * w[c * ldw + i];  // inputs past the last 8
        y[r * ldy + c] = add ? y[r * ldy + c] + v : v;
      }
    }
}

MSLLM_AVX2 inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// The tile's kc inputs as a panel: panel[k * NT + c] = w[c * KC + k]
MSLLM_AVX2 inline void pack_avx2(const float* w, int64_t kc, float* panel) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8)
    for (int64_t c0 = 0; c0 < NT; c0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(w + (c0 + i) * KC + k);
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(panel + (k + i) * NT + c0, r[i]);
    }
  for (; k < kc; ++k)
    for (int64_t c = 0; c < NT; ++c) panel[k * NT + c] = w[c * KC + k];
}

// y[c] (+)= (lo, hi)[c] for c < cols
MSLLM_AVX2 inline void panel_store_avx2(__m256 lo, __m256 hi, float* y, int64_t cols, bool add) {
  if (cols == NT) {
    if (add) lo = _mm256_add_ps(lo, _mm256_loadu_ps(y)), hi = _mm256_add_ps(hi, _mm256_loadu_ps(y + 8));
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float t[NT];
  _mm256_store_ps(t, lo);
  _mm256_store_ps(t + 8, hi);
  for (int64_t c = 0; c < cols; ++c) y[c] = add ? y[c] + t[c] : t[c];
}

// R rows of x by the panel's NT = 16 outputs: x broadcast, 2R accumulators, no horizontal sums
template <int R>
MSLLM_AVX2 inline void panel_tile_avx2(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y,
                                       int64_t ldy, int64_t cols, bool add) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * NT), w1 = _mm256_load_ps(panel + k * NT + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) panel_store_avx2(acc[r][0], acc[r][1], y + r * ldy, cols, add);
}

MSLLM_AVX2 void dots_avx2(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t kc, float* y,
                          int64_t ldy, int64_t cols, bool add, float* panel) {
  if (rows >= PANEL_MIN_ROWS) {  // prefill: the tile packed once, then 6 rows of x at a time against it
    pack_avx2(w, kc, panel);
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) panel_tile_avx2<6>(x + r * ldx, ldx, panel, kc, y + r * ldy, ldy, cols, add);
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    switch (rows - r) {
      case 5: panel_tile_avx2<5>(xr, ldx, panel, kc, yr, ldy, cols, add); break;
      case 4: panel_tile_avx2<4>(xr, ldx, panel, kc, yr, ldy, cols, add); break;
      case 3: panel_tile_avx2<3>(xr, ldx, panel, kc, yr, ldy, cols, add); break;
      case 2: panel_tile_avx2<2>(xr, ldx, panel, kc, yr, ldy, cols, add); break;
      case 1: panel_tile_avx2<1>(xr, ldx, panel, kc, yr, ldy, cols, add); break;
    }
    return;
  }
  if (rows == 1) {  // decode: 8 weight rows, 8 independent sums
    for (int64_t c = 0; c < cols; c += 8)
      tile_avx2<1, 8>(x, ldx, w + c * KC, KC, kc, y + c, ldy, std::min<int64_t>(8, cols - c), add);
    return;
  }
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3)
    for (int64_t c = 0; c < cols; c += 4)
      tile_avx2<3, 4>(x + r * ldx, ldx, w + c * KC, KC, kc, y + r * ldy + c, ldy, std::min<int64_t>(4, cols - c), add);
  for (int64_t c = 0; c < cols && r < rows; c += 4) {
    if (rows - r == 2)
      tile_avx2<2, 4>(x + r * ldx, ldx, w + c * KC, KC, kc, y + r * ldy + c, ldy, std::min<int64_t>(4, cols - c), add);
    else
      tile_avx2<1, 4>(x + r * ldx, ldx, w + c * KC, KC, kc, y + r * ldy + c, ldy, std::min<int64_t>(4, cols - c), add);
  }
}

// The decode form: R (1..4) rows of x against C weight rows over all K, each weight dequantized in registers as it is
// loaded ((q + offset) * scale: the same float32 value the buffered forms store), so no float buffer and one pass over
// the integers (int4: unpacked to int8 per block of KC first). Groups a multiple of 8 inputs. Weight rows past `cols`
// repeat the last one (read, not written).
template <int R, int C, bool INT4, bool OFFSET>
MSLLM_AVX2 void fused_tile_avx2(const Problem& p, int64_t n0, int64_t cols, int64_t m0, int8_t* qbuf) {
  const int64_t K = p.k, N = p.n;
  int64_t n[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) n[c] = n0 + std::min<int64_t>(c, cols - 1);
  const float* x = p.x + m0 * K;
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < K; kb += KC) {
    const int64_t kc = std::min(KC, K - kb);
    const int8_t* src[C];  // src[c][i]: weight row c's integer at input kb + i
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      if (INT4) {
        unpack_int4(static_cast<const uint8_t*>(p.q) + n[c] * (K / 2) + kb / 2, kc / 2, qbuf + c * KC);
        src[c] = qbuf + c * KC;
      } else {
        src[c] = static_cast<const int8_t*>(p.q) + n[c] * K + kb;
      }
    }
    for (int64_t i0 = 0, i1; i0 < kc; i0 = i1) {  // one piece per group
      const int64_t gi = (kb + i0) / p.group;
      i1 = std::min(kc, (gi + 1) * p.group - kb);
      __m256 s[C], o[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        s[c] = _mm256_broadcast_ss(p.scale + gi * N + n[c]);
        o[c] = OFFSET ? _mm256_broadcast_ss(p.offset + gi * N + n[c]) : _mm256_setzero_ps();
      }
      for (int64_t i = i0; i < i1; i += 8) {
        __m256 xv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + kb + i);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src[c] + i));
          __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
          if (OFFSET) w = _mm256_add_ps(w, o[c]);
          w = _mm256_mul_ps(w, s[c]);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], w, acc[r][c]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* y = p.y + (m0 + r) * N + n0;
#pragma GCC unroll 8
    for (int c0 = 0; c0 < C; c0 += 4) {
      alignas(16) float sums[4];
      // C is 2, 4 or 8 (with 2, the last two sums repeat the second)
      _mm_store_ps(sums, hsum4(acc[r][c0], acc[r][std::min(c0 + 1, C - 1)], acc[r][std::min(c0 + 2, C - 1)],
                               acc[r][std::min(c0 + 3, C - 1)]));
      for (int c = c0; c < c0 + 4 && c < C && c < cols; ++c) y[c] = sums[c - c0];
    }
  }
}

template <int R, int C>
MSLLM_AVX2 void fused_rows_avx2(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int8_t* qbuf) {
  for (int64_t c0 = n0; c0 < n1; c0 += C) {
    const int64_t cols = std::min<int64_t>(C, n1 - c0);
    if (p.int4)
      p.offset ? fused_tile_avx2<R, C, true, true>(p, c0, cols, m0, qbuf)
               : fused_tile_avx2<R, C, true, false>(p, c0, cols, m0, qbuf);
    else
      p.offset ? fused_tile_avx2<R, C, false, true>(p, c0, cols, m0, qbuf)
               : fused_tile_avx2<R, C, false, false>(p, c0, cols, m0, qbuf);
  }
}

// y's outputs [n0, n1) for the rows [m0, m1) of x, 4 rows at a time (the tile's integers are read again from cache
// for each 4); qbuf 8 x KC bytes. Accumulators: 1 row by 8 weight rows, 2 by 4, 3 or 4 by 2.
MSLLM_AVX2 void fused_avx2(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t m1, int8_t* qbuf) {
  for (int64_t r0 = m0; r0 < m1; r0 += 4) {
    switch (std::min<int64_t>(4, m1 - r0)) {
      case 1: fused_rows_avx2<1, 8>(p, n0, n1, r0, qbuf); break;
      case 2: fused_rows_avx2<2, 4>(p, n0, n1, r0, qbuf); break;
      case 3: fused_rows_avx2<3, 2>(p, n0, n1, r0, qbuf); break;
      default: fused_rows_avx2<4, 2>(p, n0, n1, r0, qbuf); break;
    }
  }
}
#endif

// y's outputs [n0, n1) for the rows [m0, m1) of x (at most MB) without a float buffer; qbuf 8 x KC bytes
typedef void (*FusedFn)(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t m1, int8_t* qbuf);

struct Kernels {
  DequantFn dequant;
  DotsFn dots;
  FusedFn fused;  // null: the buffered form takes every M
};

Kernels pick_kernels() {
  switch (isa()) {
#ifdef MSLLM_X86
    case ISA_AVX512:  // the AVX2 forms (no AVX-512 ones yet)
    case ISA_AVX2:
      return {dequant_avx2, dots_avx2, fused_avx2};
#endif
    default:
      return {dequant_generic, dots_generic, nullptr};
  }
}

const Kernels g_kernels = pick_kernels();

// ---- the matmul ----------------------------------------------------------------------------------

// y's outputs [n0, n1) for rows [m0, m1) of x; wbuf NT x KC floats (rows past n1 - n0 zeros), qbuf KC bytes
void run_task(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t m1, float* wbuf, float* panel,
              int8_t* qbuf) {
  const int64_t cols = n1 - n0;
  std::fill(wbuf + cols * KC, wbuf + NT * KC, 0.f);
  for (int64_t kb = 0; kb < p.k; kb += KC) {
    const int64_t kc = std::min(KC, p.k - kb);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t n = n0 + c;
      const int8_t* src;
      if (p.int4) {  // kb and kc are even
        unpack_int4(static_cast<const uint8_t*>(p.q) + n * (p.k / 2) + kb / 2, kc / 2, qbuf);
        src = qbuf;
      } else {
        src = static_cast<const int8_t*>(p.q) + n * p.k + kb;
      }
      float* dst = wbuf + c * KC;
      g_kernels.dequant(src, kb, kc, p.group, p.scale + n, p.offset ? p.offset + n : nullptr, p.n, dst);
      if (p.round != F32)
        for (int64_t i = 0; i < kc; ++i) dst[i] = round_to(p.round, dst[i]);
    }
    g_kernels.dots(p.x + m0 * p.k + kb, p.k, m1 - m0, wbuf, kc, p.y + m0 * p.n + n0, p.n, cols, kb > 0, panel);
  }
}

// y = x . W^T, shapes already checked, m, n and k positive: tiles of NT outputs by MB rows of x as the pool's tasks
struct QuantJob : Job {
  const Problem* problem;
  bool fused;
  int64_t m_blocks;
  Shares shares;

  void work() override {
    alignas(64) float wbuf[NT * KC], panel[NT * KC];  // 16 KB each: on the stack, aligned for the vector stores
    alignas(64) int8_t qbuf[8 * KC];
    const Problem& p = *problem;
    shares.claim([&](int64_t t) {  // n-tile major: a thread's share is a stretch of consecutive weight rows
      const int64_t n0 = (t / m_blocks) * NT, n1 = std::min(p.n, n0 + NT);
      const int64_t m0 = (t % m_blocks) * MB, m1 = std::min(p.m, m0 + MB);
      if (fused)
        g_kernels.fused(p, n0, n1, m0, m1, qbuf);
      else
        run_task(p, n0, n1, m0, m1, wbuf, panel, qbuf);
    });
  }
};

void quant_matmul(const Problem& p) {
  const bool fused = g_kernels.fused != nullptr && p.m <= FUSED_MAX_ROWS && p.group % 8 == 0 && p.round == F32;
  const int64_t n_tiles = (p.n + NT - 1) / NT, m_blocks = (p.m + MB - 1) / MB, tasks = n_tiles * m_blocks;
  const double work = double(p.m) * double(p.n) * double(p.k);
  const int threads = work < double(MIN_PARALLEL_WORK)
                          ? 1
                          : int(std::max<int64_t>(1, std::min<int64_t>(tasks, threads_to_use())));
  QuantJob job;
  job.problem = &p, job.fused = fused, job.m_blocks = m_blocks;
  job.shares.split(tasks, threads);
  run(&job, threads > 1);
}

// ---- the Custom ops ------------------------------------------------------------------------------

int64_t count(int ndim, const int64_t* shape) {
  int64_t c = 1;
  for (int i = 0; i < ndim; ++i) c *= shape[i];
  return c;
}

bool is_weight_dtype(const char* dtype) { return !std::strcmp(dtype, "int8") || !std::strcmp(dtype, "uint8"); }

// x [M, K], q (int8 [N, K] / uint8 [N, K / 2]) and scale [G, N] at params 0, 1, 2, offset [G, N] at oi (none when
// oi < 0), y [M, N] at yi; dtypes already checked and all 2-D: 0 with *p's shapes and q filled, or 4
int fit(void** params, int64_t** shapes, const char** dtypes, int oi, int yi, Problem* p) {
  const int64_t m = shapes[0][0], k = shapes[0][1], n = shapes[1][0], groups = shapes[2][0];
  p->int4 = !std::strcmp(dtypes[1], "uint8");
  if (p->int4 ? (k % 2 || shapes[1][1] * 2 != k) : shapes[1][1] != k) return 4;
  if (groups < 1 || shapes[2][1] != n || k % groups) return 4;
  if (oi >= 0 && (shapes[oi][0] != groups || shapes[oi][1] != n)) return 4;
  if (shapes[yi][0] != m || shapes[yi][1] != n) return 4;
  p->m = m, p->k = k, p->n = n, p->group = k / groups;
  p->q = params[1];
  return 0;
}

// The problem's work, into y (float32 [M, N]): zeros for an empty sum
void compute(const Problem& p) {
  if (p.m <= 0 || p.n <= 0) return;
  if (p.k <= 0) {
    std::fill(p.y, p.y + p.m * p.n, 0.f);
    return;
  }
  quant_matmul(p);
}

}  // namespace

int quant_matmul_op(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_offset) {
  if (nparam != (with_offset ? 5 : 4)) return 1;
  const int oi = with_offset ? 3 : -1, yi = nparam - 1;
  const char* f32 = "float32";
  if (std::strcmp(dtypes[0], f32) || !is_weight_dtype(dtypes[1]) || std::strcmp(dtypes[2], f32) ||
      (with_offset && std::strcmp(dtypes[oi], f32)) || std::strcmp(dtypes[yi], f32))
    return 2;
  for (int i = 0; i < nparam; ++i)
    if (ndims[i] != 2) return 3;
  Problem p;
  if (const int bad = fit(params, shapes, dtypes, oi, yi, &p)) return bad;
  p.x = static_cast<const float*>(params[0]);
  p.scale = static_cast<const float*>(params[2]);
  p.offset = with_offset ? static_cast<const float*>(params[oi]) : nullptr;
  p.round = F32;
  p.y = static_cast<float*>(params[yi]);
  compute(p);
  return 0;
}

int weight_quant_batch_matmul(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 5 && nparam != 6) return 1;
  const bool with_offset = nparam == 6;
  const int oi = with_offset ? 3 : -1, ai = nparam - 2, yi = nparam - 1;
  const Dtype t = dtype_of(dtypes[0]);
  if (t == BAD || !is_weight_dtype(dtypes[1]) || dtype_of(dtypes[2]) != t ||
      (with_offset && dtype_of(dtypes[oi]) != t) || std::strcmp(dtypes[ai], "float32") || dtype_of(dtypes[yi]) != t)
    return 2;
  for (int i = 0; i < nparam; ++i)
    if (i != ai && ndims[i] != 2) return 3;
  Problem p;
  if (const int bad = fit(params, shapes, dtypes, oi, yi, &p)) return bad;
  if (count(ndims[ai], shapes[ai]) != 1) return 4;
  const float group_size = static_cast<const float*>(params[ai])[0];
  if (!(group_size >= 0.f) || group_size != std::floor(group_size)) return 6;
  const int64_t groups = shapes[2][0];
  if (group_size == 0.f ? groups != 1 : double(group_size) > double(p.k) || groups * int64_t(group_size) != p.k)
    return 4;
  if (p.m <= 0 || p.n <= 0) return 0;
  // the T tensors as float32 (exactly); y computed in float32, then rounded to T
  std::vector<float> x, scale(groups * p.n), offset(with_offset ? groups * p.n : 0), y;
  for (int64_t i = 0; i < groups * p.n; ++i) {
    scale[i] = load(params[2], t, i);
    if (with_offset) offset[i] = load(params[oi], t, i);
  }
  if (t == F32) {
    p.x = static_cast<const float*>(params[0]);
    p.y = static_cast<float*>(params[yi]);
  } else {
    x.resize(p.m * p.k);
    y.resize(p.m * p.n);
    for (int64_t i = 0; i < p.m * p.k; ++i) x[i] = load(params[0], t, i);
    p.x = x.data();
    p.y = y.data();
  }
  p.scale = scale.data();
  p.offset = with_offset ? offset.data() : nullptr;
  p.round = t;
  compute(p);
  if (t != F32)
    for (int64_t i = 0; i < p.m * p.n; ++i) store(params[yi], t, i, y[i]);
  return 0;
}

}  // namespace msllm
