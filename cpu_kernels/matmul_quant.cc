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
// How, by the rows of x (M):
//   M <= QUANT_ROWS_MAX (16: the decode step, chunk rows, short prompts): "the decode form" below, x rounded per
//     block of 32 (to int8 for int4 weights whose K is a multiple of 64 and group 32 or a multiple of 64, else to
//     int16) and exact integer products, each weight read once per call.
//   Banded int8 weights (x in int8) on a CPU with AMX: every call of 2 rows or more (int4: 8) by AMX tiles (qbands_amx,
//     docs/architecture.md "AMX tiles: int8, int4 and bfloat16"), the prompt's rows too, 16 a tile, x rounded as the
//     steps round it.
//   More rows (the prompt): on AVX2/AVX-512, matmul16.cc's float32 GEMM on weights dequantized as it packs them
//     (dequantize_rows, 8 rows at a time); elsewhere, and for WeightQuantBatchMatmul's stand-in (which rounds each
//     weight to its T), the buffered form: tasks are tiles of NT outputs by MB rows of x, per block of KC inputs the
//     tile's weights dequantized into a per-thread buffer of NT x KC floats (L1), then dot products of 3 rows of x by
//     4 weight rows (1 by 8 for one row) over it, or (AVX2, from PANEL_MIN_ROWS rows) a panel of its 16 outputs
//     against 6 broadcast rows of x; each weight dequantized once per MB rows of x.
//   Every float form uses the same float32 weight, (q + offset) * scale, with float32 sums.
//
// Threads: the library's pool (pool.h), with its one thread count. Each thread takes its own contiguous share of
// tiles first (one weight stream per thread: pool.h's Shares), then what is left of the others'; a call with little
// work (MIN_PARALLEL_WORK) runs on the caller alone.
//
// ISA: the dequantization and the dot products have an AVX2+FMA form (target attributes; the AVX2 and AVX-512 paths
// of common.h's isa() run it), the decode form also an AVX-512 VNNI one (vpdpwssd on int16 x, vpdpbusd on int4's
// bytes against int8 x: the AVX-512 path on a CPU with AVX512_VNNI, BW and VL; quant_form() names the one that runs),
// banded int8 and int4 weights also AMX tiles where the CPU and the kernel grant them (tdpbsud; common.h amx_granted),
// a NEON one and a plain C++ one (which read int8 x as the int16 integers it is; elsewhere, or with
// MSLITE_LLM_CPU_KERNELS_ISA=generic; =avx2 holds an AVX-512 machine to the AVX2 forms, =avx512 to the form of a CPU
// without VNNI), read at load.
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
#include "matmul_quant.h"
#include "ops.h"
#include "pool.h"

namespace msllm {
namespace {

constexpr int64_t QBLOCK = 32;  // the decode form's block of inputs: x's own scale each (below)
constexpr int64_t NT = 16;   // outputs per tile (a multiple of the dot products' 4 and 8)
constexpr int64_t KC = 256;  // inputs per dequantized block (even: an int4 block starts on a byte); NT x KC floats: L1
constexpr int64_t MB = 48;   // rows of x per task (a multiple of 3); MB x KC floats of x: L2
constexpr int64_t PANEL_MIN_ROWS = 6;  // rows of x from which the AVX2 buffered form packs the tile and broadcasts x
                                        // (no sums across lanes): even with the dot products at 6, ~10 % ahead at 16
constexpr int64_t MIN_PARALLEL_WORK = int64_t(1) << 20;  // multiply-adds below which the caller runs alone (set
                                                         // when each call started its own threads; kept with the pool)

struct Problem {
  const float* x;  // [m, k]
  int64_t m, k, n;
  const void* q;  // int8 [n, k] or, int4, uint8 [n, k / 2]
  bool int4;
  bool r16 = false;  // in bands of 16 rows (repack_int4_r16, repack_int8_r16)
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

// Weights in bands of 16 rows (matmul_quant.h repack_int4_r16, repack_int8_r16: a block of `block` bytes a row, 16
// rows' blocks in 4-byte runs): where row `row`'s bytes [byte0, byte0 + len) are, as stored (rows of kb bytes): in
// place for a row-major row (or a row past the bands), else gathered into buf (4 bytes at a time when whole)
const uint8_t* band_row_bytes(const void* q, bool r16, int64_t n, int64_t kb, int64_t block, int64_t row,
                              int64_t byte0, int64_t len, uint8_t* buf) {
  const uint8_t* base = static_cast<const uint8_t*>(q);
  if (!r16 || row >= n - n % 16) return base + row * kb + byte0;
  const uint8_t* band = base + (row - row % 16) * kb + (row % 16) * 4;
  for (int64_t p = byte0; p < byte0 + len;) {
    const uint8_t* at = band + (p / block) * (16 * block) + ((p % block) / 4) * 64 + p % 4;
    if (p % 4 == 0 && p + 4 <= byte0 + len) {
      std::memcpy(buf + (p - byte0), at, 4);
      p += 4;
    } else {
      buf[p - byte0] = *at;
      ++p;
    }
  }
  return buf;
}

// int4: the bytes of row `row` (k inputs) as stored, banded or not
const uint8_t* int4_row_bytes(const void* q, bool r16, int64_t n, int64_t k, int64_t row, int64_t byte0, int64_t len,
                              uint8_t* buf) {
  return band_row_bytes(q, r16, n, k / 2, QBLOCK / 2, row, byte0, len, buf);
}

// int8: row `row`'s q [i0, i0 + len) (len <= KC) as the integers they are: in place for a row-major weight, else
// gathered from its band and unbiased (repack_int8_r16) into buf
const int8_t* int8_row(const void* q, bool r16, int64_t n, int64_t k, int64_t row, int64_t i0, int64_t len,
                       int8_t* buf) {
  if (!r16) return static_cast<const int8_t*>(q) + row * k + i0;
  alignas(64) uint8_t bytes[KC];
  const uint8_t* src = band_row_bytes(q, true, n, k, QBLOCK, row, i0, len, bytes);
  for (int64_t i = 0; i < len; ++i) buf[i] = int8_t(src[i] ^ 0x80);
  return buf;
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

#endif

// ---- the decode form: integer dot products over 16-bit activations ---------------------------------------------
// Up to QUANT_ROWS_MAX rows of x (the decode step, a few chunk rows) a matmul reads each weight once. Widening each
// weight to float32 in registers (the buffered forms' arithmetic, and the 16-bit kernels') made it compute-bound on
// AVX2: 3 instructions per 8 int8 weights, 7 per 16 int4 ones; 15 and 8.6 GMAC/s on one core of this project's machine,
// where the 0.5B shape's decode at llama.cpp's Q4_0 pace needs ~22. So x is rounded to int16 once per call, per block
// of 32 inputs with its own scale (max |x| / 32767), and the weights are widened to int16 only: vpmaddwd multiplies 16
// pairs and adds them in pairs, exactly, in int32. 32-40 and 17-24 GMAC/s on the same core; llama.cpp's way, x as int8
// Q8_0 blocks against the integers with vpmaddubsw, measured 19 (int8) and 49 (int4) (docs/performance-log.md,
// "Quantized decode: int16 activations", 2026-11-26). So int4 weights whose K is a multiple of 64 and group 32 or a
// multiple of 64 take x in int8 by default (ACTIVATIONS_INT8: qtile8_avx2 / qtile8_vnni below; the int16 widening bound
// them), int8 weights keep int16 (their one row is bound by the bytes, not the arithmetic). What changes the result is
// x's rounding: at most max |x| / 65534 per input of its block in int16, max |x| / 254 in int8, so check holds these
// folders to limits derived from that rounding (lite_runtime/golden.py derived_limits; export/writers/golden.py's "int16" and
// "int8" lanes).
//
// Per call, x is prepared once (PreparedX): per row, the integer inputs as int16 (int4: the even inputs, then the odd
// ones, as a weight byte holds them; in int8's range for the int8 form, which also gets them as bytes), a scale per
// block of 32, and float sums of x per weight group (for the offsets, and for
// int4, whose kernels read a nibble v as v ^ 8 = q + 8, 0..15, and subtract 8 x the group's sum). Per block: the
// block's int32 dot product, as float, times its scale; per group, times the weight's scale, plus the group's
// constant. The same integers and scales on every path; only the float sums' order differs.
// Usable when groups and K are whole blocks; otherwise (odd shapes) a plain float32 form runs.

constexpr float LOW_STEP = 1.f / 65534.f;  // ACTIVATIONS_EXACT: the low part's step, in steps of the high part

int default_activations() {
  const char* mode = std::getenv("MSLITE_LLM_QUANT_ACTIVATIONS");
  if (mode != nullptr && !std::strcmp(mode, "exact")) return ACTIVATIONS_EXACT;
  if (mode != nullptr && !std::strcmp(mode, "int16")) return ACTIVATIONS_INT16;
  return ACTIVATIONS_INT8;
}

std::atomic<int> g_activations{default_activations()};

bool int16_fits(const QuantWeight& w) { return w.k % QBLOCK == 0 && w.group % QBLOCK == 0; }
// the x-in-int8 forms' unit: 64 inputs (two blocks; an int4 weight row's 32 bytes)
constexpr int64_t QSTEP = 2 * QBLOCK;
// whether int4 weights fit the form that takes x in int8 (below, "int4 weights against x in int8"): K whole units, the
// group too (or groups of 32, a step's two blocks two groups: G32 below)
bool int4_x8_fits(const QuantWeight& w) {
  return w.int4 && w.k % QSTEP == 0 && (w.group % QSTEP == 0 || w.group == QBLOCK);
}

// the x-in-int8 form of banded int8 weights (qbands_r16_vnni, and qtile8w_vnni for the rows past the bands): K whole
// steps of 64, the group too or 32 (llama.cpp's Q8_0 imported as it is: each block its own weight scale)
bool int8w_fits(const QuantWeight& w) {
  return !w.int4 && w.k % QSTEP == 0 && (w.group % QSTEP == 0 || w.group == QBLOCK);
}
// whether x is prepared for w in that form: int8 banded (and biased), fitting, x in int8 in force
bool takes_int8w(const QuantWeight& w) {
  return w.r16 && int8w_fits(w) && quant_activations() == ACTIVATIONS_INT8;
}
#ifdef MSLLM_X86
// the same for int4 weights: banded, K and the group whole steps of 64 (or groups of 32), x in int8 in force (bands
// are x86's only)
bool takes_int4w(const QuantWeight& w) {
  return w.r16 && int4_x8_fits(w) && quant_activations() == ACTIVATIONS_INT8;
}
#endif

// row r's int16 parts (exact: its low parts follow them, k int16 further on)
const int16_t* prepared_row(const PreparedX& p, int64_t r) { return p.xq.data() + r * (p.exact ? 2 : 1) * p.k; }
const float* block_scales(const PreparedX& p, int64_t r) {
  return p.scales.data() + r * (p.k / QBLOCK + 2 * (p.k / p.group));
}
// per row: G sums of x over each group, then (int4) G sums of x as rounded (the block scales times the int16 sums)
const float* group_sums(const PreparedX& p, int64_t r) { return block_scales(p, r) + p.k / QBLOCK; }

// What the kernels' integers carry beyond q: 8 for int4 (they read a nibble as q + 8), 128 for banded int8 in the
// x-in-int8 form (it reads the biased bytes as they are, q + 128), else 0.
inline float weight_bias(const QuantWeight& w) { return w.int4 ? 8.f : w.x->int8w ? 128.f : 0.f; }

// y[m, o] += the constants of output o's groups, for rows m < rows and outputs [o0, o1): per group g,
// scale[g, o] * (offset[g, o] * x's sum over the group, less weight_bias times the sum of x as rounded: the kernels'
// x . (q + 8) less that is x as rounded . q exactly, so x's rounding meets q, not q + 8, whose larger magnitude doubled
// the error on SmolLM2). Apart from the dot products, a pass along each group's contiguous scales and offsets (a
// scalar sum per weight row and group inside the tiles cost int4 a fifth of its speed).
inline void add_group_constants(const QuantWeight& w, int64_t rows, float* y, int64_t ldy, int64_t o0, int64_t o1) {
  const float bias = weight_bias(w);
  if (w.offset == nullptr && bias == 0.f) return;
  const int64_t groups = w.k / w.group;
  for (int64_t m = 0; m < rows; ++m) {
    const float* sums = group_sums(*w.x, m);
    float* ym = y + m * ldy;
    for (int64_t g = 0; g < groups; ++g) {
      const float* s = w.scale + g * w.n;
      const float exact = sums[g], rounded8 = bias * sums[groups + g];
      if (w.offset != nullptr) {
        const float* off = w.offset + g * w.n;
        for (int64_t o = o0; o < o1; ++o) ym[o] += s[o] * (off[o] * exact - rounded8);
      } else {
        for (int64_t o = o0; o < o1; ++o) ym[o] -= s[o] * rounded8;
      }
    }
  }
}

// The float32 form (defined after the ISA's kernels, which it uses): odd shapes (K or the group not whole blocks of
// 32), and banded weights in a mode their forms do not take (check's replays with x exact or in int16)
void qrows_float(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy, int64_t o0, int64_t o1);

// block blk's int32 dot product of weight row o with the prepared row xq (exact)
inline int32_t block_dot(const QuantWeight& w, const int16_t* xq, int64_t o, int64_t blk) {
  int32_t t = 0;
  if (w.int4) {
    const int64_t half = w.k / 2;
    const uint8_t* q = static_cast<const uint8_t*>(w.q) + o * half;
    for (int64_t j = blk * (QBLOCK / 2); j < (blk + 1) * (QBLOCK / 2); ++j) {
      const int v = q[j] ^ 0x88;
      t += int32_t(xq[j]) * (v & 15) + int32_t(xq[half + j]) * (v >> 4);
    }
  } else {
    const int8_t* q = static_cast<const int8_t*>(w.q) + o * w.k;
    for (int64_t i = blk * QBLOCK; i < (blk + 1) * QBLOCK; ++i) t += int32_t(xq[i]) * q[i];
  }
  return t;
}

void qrows_generic(const float*, int64_t rows, const void* wv, const float* b, int64_t, float* y, int64_t ldy,
                   int64_t o0, int64_t o1) {
  const QuantWeight& w = *static_cast<const QuantWeight*>(wv);
  if (!w.x->int16 || w.r16) return qrows_float(w, rows, b, y, ldy, o0, o1);
  const int64_t groups = w.k / w.group, per = w.group / QBLOCK;
  for (int64_t m = 0; m < rows; ++m) {
    const int16_t* xq = prepared_row(*w.x, m);
    const float* bs = block_scales(*w.x, m);
    for (int64_t o = o0; o < o1; ++o) {
      float total = 0.f;
      for (int64_t gi = 0; gi < groups; ++gi) {
        float acc = 0.f;
        for (int64_t blk = gi * per; blk < (gi + 1) * per; ++blk) {
          float d = float(block_dot(w, xq, o, blk));
          if (w.x->exact) d += float(block_dot(w, xq + w.k, o, blk)) * LOW_STEP;
          acc += d * bs[blk];
        }
        total += acc * w.scale[gi * w.n + o];
      }
      y[m * ldy + o] = total + (b ? b[o] : 0.f);
    }
  }
  add_group_constants(w, rows, y, ldy, o0, o1);
}

// R rows of x (from m0) by C weight rows n[0..C-1] (past `cols`, repeats of the last: read, not written). The
// per-ISA part is two functions: Wide widen(w, n, blk) (a block's 32 weights as int16) and dot(wide, xq, k, blk)
// (the block's products, in lanes summing to its dot product).
#ifdef MSLLM_X86
struct WideAvx2 {
  __m256i a, b;  // int8: inputs 0-15 and 16-31 of the block; int4: its even and its odd inputs
};

template <bool INT4>
MSLLM_AVX2 inline WideAvx2 widen_avx2(const char* row, int64_t blk) {
  if (INT4) {
    const __m128i bytes = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + blk * (QBLOCK / 2))),
                                        _mm_set1_epi8(char(0x88)));
    const __m256i v = _mm256_cvtepu8_epi16(bytes);  // one widening: each int16 holds a byte, both nibbles
    return {_mm256_and_si256(v, _mm256_set1_epi16(15)), _mm256_srli_epi16(v, 4)};
  }
  const char* q = row + blk * QBLOCK;
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))};
}

// the block's products in lanes (EXACT: the low parts' too, LOW_STEP apart)
template <bool INT4, bool EXACT>
MSLLM_AVX2 inline __m256 dot_avx2(const WideAvx2& v, const int16_t* xq, int64_t k, int64_t blk) {
  const int16_t* x0 = INT4 ? xq + blk * (QBLOCK / 2) : xq + blk * QBLOCK;
  const int16_t* x1 = INT4 ? x0 + k / 2 : x0 + 16;
  const __m256 high = _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0)), v.a),
                       _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x1)), v.b)));
  if (!EXACT) return high;
  const __m256i low =
      _mm256_add_epi32(_mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + k)), v.a),
                       _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x1 + k)), v.b));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), _mm256_set1_ps(LOW_STEP), high);
}

MSLLM_AVX2 inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

constexpr int64_t PREFETCH_TILES = 2;  // how far ahead, in tiles, each block's prefetch reads

// The outputs [o0, o1) as tiles of C weight rows: tile(n, cols) with n[0..C-1] the tile's rows (past `cols`, repeats
// of the last: read, not written). Every rows kernel's loop over its tiles.
template <int C, class Tile>
inline void each_tile(int64_t o0, int64_t o1, Tile&& tile) {
  for (int64_t o = o0; o < o1; o += C) {
    const int cols = int(std::min<int64_t>(C, o1 - o));
    int64_t n[C];
    for (int c = 0; c < C; ++c) n[c] = o + std::min(c, cols - 1);
    tile(n, cols);
  }
}

template <int R, int C, bool INT4, bool EXACT>
MSLLM_AVX2 void qtile_avx2(const QuantWeight& w, int64_t m0, const int64_t* n, int cols, const float* b, float* y,
                           int64_t ldy) {
  const PreparedX& x = *w.x;
  const int64_t groups = w.k / w.group, per = w.group / QBLOCK;
  const int64_t block_bytes = INT4 ? QBLOCK / 2 : QBLOCK, row_bytes = INT4 ? w.k / 2 : w.k;
  const char* base = static_cast<const char*>(w.q);
  const char* next = base + (n[C - 1] + 1 + (PREFETCH_TILES - 1) * C) * row_bytes;  // may run past W: a hint only
  const char* row[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) row[c] = base + n[c] * row_bytes;
  const int16_t* xq[R];
  const float* bs[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xq[r] = prepared_row(x, m0 + r), bs[r] = block_scales(x, m0 + r);
  // each group's sums in memory: held in registers beside acc they spilled acc itself at R x C = 8 (4 rows by 2 weight
  // rows: a store and a reload on every block's FMA chain); 8192 x 2048 int8, 4 to 16 rows 1.05-1.16x, a SmolLM2 int8
  // verify of 8 tokens 1.06x (docs/performance-log.md 65)
  alignas(32) float total[R][C][8];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_store_ps(total[r][c], _mm256_setzero_ps());
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t blk = gi * per; blk < (gi + 1) * per; ++blk) {
      // the rows a few tiles on follow these in memory: prefetch them, an equal share per block (as matmul16.cc's
      // tiles: short rows are short streams for the hardware prefetcher; 1.6x on the 0.5B head, weights not in cache)
      const char* ahead = next + blk * C * block_bytes;
#pragma GCC unroll 8
      for (int64_t off = 0; off < C * block_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const WideAvx2 v = widen_avx2<INT4>(row[c], blk);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm256_fmadd_ps(dot_avx2<INT4, EXACT>(v, xq[r], w.k, blk), _mm256_broadcast_ss(bs[r] + blk),
                                      acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float s = w.scale[gi * w.n + n[c]];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        _mm256_store_ps(total[r][c], _mm256_fmadd_ps(acc[r][c], _mm256_set1_ps(s), _mm256_load_ps(total[r][c])));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[(m0 + r) * ldy + n[c]] = hsum8(_mm256_load_ps(total[r][c])) + (b ? b[n[c]] : 0.f);
}

// ---- int4 weights against x in int8 (ACTIVATIONS_INT8): 64 inputs a step ---------------------------------------
// Widening nibbles to int16 bound the int16 form (performance-log 30: 17-24 GMAC/s on one core, llama.cpp's int8 x
// 49). Here a weight row's 32 bytes (64 inputs, two blocks) are used as they are: an and and a shift give the low
// nibbles (the even inputs) and the high ones (the odd), each xor 8 = q + 8 in 0..15 as unsigned bytes, multiplied by
// x's int8 (PreparedX xb) in pairs into int16 (vpmaddubsw: at most 2 x 15 x 127, exact) and summed into int32 lanes,
// lanes 0-3 block 2s and 4-7 block 2s + 1, each then scaled by its block's x scale (PreparedX xs). The group's
// constant takes 8 x the sum of x as rounded off, as in the int16 form. G32: groups of 32 (llama.cpp's Q4_0 and
// Q4_1, GPTQ's smallest), each block its own weight scale: the x scales times the two blocks' weight scales per step,
// one pass (`total` is the sum).
template <int R, int C, bool G32>
MSLLM_AVX2 void qtile8_avx2(const QuantWeight& w, int64_t m0, const int64_t* n, int cols, const float* b, float* y,
                            int64_t ldy) {
  const PreparedX& x = *w.x;
  const int64_t groups = G32 ? 1 : w.k / w.group, per = G32 ? w.k / QSTEP : w.group / QSTEP, row_bytes = w.k / 2;
  const char* base = static_cast<const char*>(w.q);
  const char* next = base + (n[C - 1] + 1 + (PREFETCH_TILES - 1) * C) * row_bytes;  // may run past W: a hint only
  const char* row[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) row[c] = base + n[c] * row_bytes;
  const int8_t* xb[R];
  const float* xs[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xb[r] = x.xb.data() + (m0 + r) * 2 * w.k, xs[r] = x.xs.data() + (m0 + r) * (w.k / 4);
  const __m256i nibble = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(0x08), ones = _mm256_set1_epi16(1);
  __m256 total[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) total[r][c] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t s = gi * per; s < (gi + 1) * per; ++s) {
      const char* ahead = next + s * C * (QSTEP / 2);
#pragma GCC unroll 8
      for (int64_t off = 0; off < C * (QSTEP / 2); off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[c] + s * (QSTEP / 2)));
        const __m256i lo = _mm256_xor_si256(_mm256_and_si256(raw, nibble), eight);
        const __m256i hi = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), eight);
        __m256 ws2 = _mm256_setzero_ps();  // G32: block 2s's weight scale in lanes 0-3, 2s + 1's in 4-7
        if (G32)
          ws2 = _mm256_setr_m128(_mm_set1_ps(w.scale[2 * s * w.n + n[c]]),
                                 _mm_set1_ps(w.scale[(2 * s + 1) * w.n + n[c]]));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[r] + s * 128));
          const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[r] + s * 128 + 64));
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o));
          const __m256 xsv = _mm256_loadu_ps(xs[r] + s * 16), scale = G32 ? _mm256_mul_ps(xsv, ws2) : xsv;
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), scale, acc[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 sc = _mm256_set1_ps(G32 ? 1.f : w.scale[gi * w.n + n[c]]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) total[r][c] = G32 ? acc[r][c] : _mm256_fmadd_ps(acc[r][c], sc, total[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[(m0 + r) * ldy + n[c]] = hsum8(total[r][c]) + (b ? b[n[c]] : 0.f);
}

template <int R, int C>
MSLLM_AVX2 void qtiles8_avx2(const QuantWeight& w, int64_t m0, const float* b, float* y, int64_t ldy, int64_t o0,
                             int64_t o1) {
  each_tile<C>(o0, o1, [&](const int64_t* n, int cols) {
    if (w.group == QBLOCK)
      qtile8_avx2<R, C, true>(w, m0, n, cols, b, y, ldy);
    else
      qtile8_avx2<R, C, false>(w, m0, n, cols, b, y, ldy);
  });
}

// Up to 4 rows of x a pass over the weights: 1 row by 4 weight rows, 2 by 2, 3 and 4 by 2 (their totals spill, once a
// group; a pass per 2 rows, which kept every accumulator in the 16 ymm registers, measured 0.84-1.46x as fast at 3-8
// rows, median ~0.9x: it reads the weights twice per 4 rows)
MSLLM_AVX2 void qrows8_avx2(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy, int64_t o0,
                            int64_t o1) {
  for (int64_t m = 0; m < rows; m += 4) {
    switch (std::min<int64_t>(4, rows - m)) {
      case 1: qtiles8_avx2<1, 4>(w, m, b, y, ldy, o0, o1); break;
      case 2: qtiles8_avx2<2, 2>(w, m, b, y, ldy, o0, o1); break;
      case 3: qtiles8_avx2<3, 2>(w, m, b, y, ldy, o0, o1); break;
      default: qtiles8_avx2<4, 2>(w, m, b, y, ldy, o0, o1); break;
    }
  }
}

// add_group_constants inlined here, so its loops over the outputs vectorize with AVX2 (3 % of an int4 step in SSE2)
MSLLM_AVX2 void add_group_constants_avx2(const QuantWeight& w, int64_t rows, float* y, int64_t ldy, int64_t o0,
                                         int64_t o1) {
  add_group_constants(w, rows, y, ldy, o0, o1);
}

// ---- int4 in bands of 16 rows (repack_int4_r16) against x in int8 ----------------------------------------------
// outputs [o0, o1) of a banded weight: band(rows, o, bo, yo, ldy) writes band o's 16 outputs of every row of x (yo:
// where output o of row 0 goes; bo: the band's biases or null). Whole bands in place; a band only partly in [o0, o1)
// into a buffer and its part copied (quant_task_rows keeps the pool's tasks whole bands); the rows past the bands
// (row-major) by tail(o0', o1).
template <class Band, class Tail>
void each_band(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy, int64_t o0, int64_t o1,
               Band&& band, Tail&& tail) {
  const int64_t n16 = w.n - w.n % 16;
  for (int64_t o = o0 - o0 % 16; o < std::min(o1, n16); o += 16) {
    const float* bo = b != nullptr ? b + o : nullptr;
    if (o >= o0 && o + 16 <= o1) {
      band(rows, o, bo, y + o, ldy);
    } else {
      alignas(64) float part[QUANT_ROWS_MAX * 16];
      std::vector<float> more(rows > QUANT_ROWS_MAX ? size_t(rows * 16) : 0);
      float* t = rows > QUANT_ROWS_MAX ? more.data() : part;
      band(rows, o, bo, t, 16);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = std::max(o, o0); c < std::min(o + 16, o1); ++c) y[m * ldy + c] = t[m * 16 + c - o];
    }
  }
  if (o1 > n16) tail(std::max(o0, n16), o1);
}

// The first byte of the whole band after band o (outputs o + 16 .. o + 31) of a banded weight of row_bytes bytes a
// row, or null where there is none: what the several-row forms fetch ahead (qband_rows_r16_vnni, qband_rows_r16_avx2)
inline const uint8_t* next_band(const QuantWeight& w, int64_t o, int64_t row_bytes) {
  return o + 32 <= w.n - w.n % 16 ? static_cast<const uint8_t*>(w.q) + (o + 16) * row_bytes : nullptr;
}

// x's inputs 4j..4j+3 of block blk's even ones and of its odd ones, as the int32s a band's lanes are broadcast
// (PreparedX xb's int8 layout: per 64 inputs, 32 evens twice, then 32 odds twice)
inline void x_quads(const int8_t* xb, int64_t blk, int j, int32_t* e4, int32_t* o4) {
  const int8_t* even = xb + (blk >> 1) * 128 + (blk & 1) * 16 + 4 * j;
  std::memcpy(e4, even, 4);
  std::memcpy(o4, even + 64, 4);
}

// How many bands one row of x reads at once (qbands_r16_vnni<1, B>, qbands_r16_avx2<1, B>: one stream of weights
// each): 4 on Intel's CPUs (the AVX2 form at most 2), 1 on others (an AMD EPYC Zen 5 read SmolLM2's int4 and int8
// bands 1.2-1.5x faster in one stream than in two, Zen 4 as fast: docs/performance-log.md 53);
// MSLITE_LLM_CPU_KERNELS_INT4_STREAMS (1 to 4, read at load) sets it, for tests and benchmarks
int row_streams() {
  static const int streams = [] {
    const char* env = std::getenv("MSLITE_LLM_CPU_KERNELS_INT4_STREAMS");
    const int n = env != nullptr ? std::atoi(env) : 0;
    return n >= 1 && n <= 4 ? n : __builtin_cpu_is("intel") ? 4 : 1;
  }();
  return streams;
}

// Outputs [o0, o1) of a banded weight for one row of x: the whole bands inside in `streams` runs of consecutive
// bands, band j of every run computed together by bands(os, count) (os: the bands' first outputs), the partial bands
// at the edges and the rows past the bands by edges(t0, t1). False (nothing done) with fewer than two whole bands.
template <class Bands, class Edges>
bool each_band_streams(const QuantWeight& w, int64_t o0, int64_t o1, int streams, Bands&& bands, Edges&& edges) {
  const int64_t first = (o0 + 15) / 16 * 16, last = std::min(o1, w.n - w.n % 16) / 16 * 16;
  const int64_t whole = last > first ? (last - first) / 16 : 0;
  if (whole < 2 || streams < 2) return false;
  const int64_t run = (whole + streams - 1) / streams;  // bands per stream
  for (int64_t j = 0; j < run; ++j) {
    int64_t os[4];
    int count = 0;
    for (int s = 0; s < streams && s < 4; ++s)
      if (s * run + j < whole) os[count++] = first + (s * run + j) * 16;
    bands(os, count);
  }
  if (first > o0) edges(o0, first);
  if (o1 > last) edges(last, o1);
  return true;
}

// Outputs [o0, o1) of a banded weight for `rows` rows of x, as each ISA's form computes them: one row in `streams`
// streams (each_band_streams, streamed(os, count)) where it can, else band by band (each_band: band_rows(rows, o, bo,
// yo, ldy)), the rows past the bands by row_major(t0, t1)
template <class BandRows, class Streamed, class RowMajor>
void run_bands(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy, int64_t o0, int64_t o1,
               int streams, BandRows&& band_rows, Streamed&& streamed, RowMajor&& row_major) {
  const auto banded = [&](int64_t t0, int64_t t1) { each_band(w, rows, b, y, ldy, t0, t1, band_rows, row_major); };
  if (rows != 1 || !each_band_streams(w, o0, o1, streams, streamed, banded)) banded(o0, o1);
}

// Fetch into the cache the 16 scales (and offsets) of group g of the band whose first output is o: 64 bytes each, in
// rows of the [G, N] arrays n floats apart, which the hardware prefetcher does not follow (a band reads one line of
// each group's row). A hint: an o past the weight fetches nothing that matters.
inline void fetch_group_params(const QuantWeight& w, int64_t g, int64_t o) {
  const float* s = w.scale + g * w.n + o;
  _mm_prefetch(reinterpret_cast<const char*>(s), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s + 15), _MM_HINT_T0);  // the arrays need not start on a line
  if (w.offset != nullptr) {
    const float* f = w.offset + g * w.n + o;
    _mm_prefetch(reinterpret_cast<const char*>(f), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(f + 15), _MM_HINT_T0);
  }
}

// The AVX2 form (vpmaddubsw): per block of 32 inputs, run j's 64 bytes are two ymm, rows 0-7 and 8-15 of the band,
// lane r 4 bytes of one weight row; their nibbles (q + 8 in 0..15, as qtile8_avx2's: the byte xor 0x88, then and and
// shift) against 4 of x's bytes broadcast, in pairs into int16 lanes (vpmaddubsw), the block's 8 such products per lane
// summed in int16 (at most 8 x 2 x 15 x 127 = 30480: exact), then one vpmaddwd gives each int32 lane its row's sum
// over the block: one conversion and one FMA (times the block's x scale and the group's weight scale) per block for 8
// rows, where the row-major form spends them per two blocks of one row, and the band read in storage order (no
// software prefetch). R rows of x (R <= 2 a pass; 3 and 4 rows in two passes, the band's second read from cache).
// (docs/performance-log.md 42, the 7B shapes, 2 threads, out of cache: 1 row 1.13-1.39x the row-major AVX2 form,
// 2 and 4 rows level, 16 rows 1.27-1.36x; the 7B int4 decode on the AVX2 path 1.24-1.30x.)
//
// Rows [m0, m0 + R) of x against B bands at once (os, bo, yo as qbands_r16_vnni's, below), R x B <= 2: the
// accumulators of more spill out of the 16 ymm. R rows share each band's unpacked block; B bands are B streams of
// weights per thread, as qbands_r16_vnni's and for the same reason (on the Intel Xeon of that measurement, this form
// too: docs/performance-log.md 45). Each band's sums are the same whatever R and B.
// Each group's constant (add_group_constants': the offset times x's sum, less 8 times x's rounded sum) is added here
// as the group ends, where a lane is a weight row, as qbands_r16_vnni adds it; the next band's scales and offsets of
// the group are fetched as the group starts (fetch_group_params). A pass over the [G, N] scales and offsets after the
// kernel read them a second time, and inline without the fetch each group waited on its lines from memory: one
// SmolLM2 int4 sequence on an AMD EPYC Zen 3 (AVX2), in-process alternating, 1.10-1.20x the step (batch-1 and
// batch-16 folders; 8 and 16 rows 1.00x and 1.06x, a verify of 8 1.03x; the Qwen2-0.5B shape's groups of 128, one
// sequence, 1.04x: docs/performance-log.md 64).
// `next`: as qbands_r16_vnni's (the next band's bytes fetched block by block), or null.
template <int R, int B>
MSLLM_AVX2 void qbands_r16_avx2(const QuantWeight& w, int64_t m0, const int64_t* os, const float* const* bo,
                                float* const* yo, int64_t ldy, const uint8_t* next = nullptr) {
  static_assert(R * B <= 2, "the accumulators of R x B > 2 spill out of the 16 ymm");
  const PreparedX& x = *w.x;
  const int64_t per = w.group / QBLOCK, blocks = w.k / QBLOCK;
  const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x88)), ones = _mm256_set1_epi16(1);
  const uint8_t* band[B];
#pragma GCC unroll 2
  for (int i = 0; i < B; ++i) band[i] = static_cast<const uint8_t*>(w.q) + os[i] * (w.k / 2);
  const int8_t* xb[R];
  const float* bs[R];
  const float* sums[R];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
    xb[r] = x.xb.data() + (m0 + r) * 2 * w.k, bs[r] = block_scales(x, m0 + r), sums[r] = group_sums(x, m0 + r);
  const int64_t groups = w.k / w.group;
  const float bias = weight_bias(w);
  __m256 total[R][B][2];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int i = 0; i < B; ++i) total[r][i][0] = total[r][i][1] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    if (next != nullptr)
#pragma GCC unroll 4
      for (int line = 0; line < 256; line += 64) _mm_prefetch(reinterpret_cast<const char*>(next + blk * 256 + line),
                                                              _MM_HINT_T0);
    const int64_t gi = blk / per;
    if (blk % per == 0)  // the next band's scales (and offsets) of this group: their own lines, a row apart
#pragma GCC unroll 2
      for (int i = 0; i < B; ++i) fetch_group_params(w, gi, os[i] + 16);
    __m256i sum[R][B][2];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int i = 0; i < B; ++i) sum[r][i][0] = sum[r][i][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i e[R], od[R];  // x's even and odd inputs 4j..4j+3 of the block (PreparedX xb's int8 layout), broadcast
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        int32_t e4, o4;
        x_quads(xb[r], blk, j, &e4, &o4);
        e[r] = _mm256_set1_epi32(e4), od[r] = _mm256_set1_epi32(o4);
      }
#pragma GCC unroll 2
      for (int i = 0; i < B; ++i)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(band[i] + blk * 256 + j * 64 + h * 32)), flip);
          const __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r)
            sum[r][i][h] = _mm256_add_epi16(sum[r][i][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, e[r]),
                                                                         _mm256_maddubs_epi16(hi, od[r])));
        }
    }
    const bool group_ends = blk % per == per - 1;
#pragma GCC unroll 2
    for (int i = 0; i < B; ++i) {
      const float* ws = w.scale + gi * w.n + os[i];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_loadu_ps(ws + 8 * h);
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r)
          total[r][i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][i][h], ones)),
                                           _mm256_mul_ps(_mm256_set1_ps(bs[r][blk]), s), total[r][i][h]);
        if (group_ends) {  // the group's constant (add_group_constants'), here where a lane is a weight row
          const __m256 off = w.offset != nullptr ? _mm256_loadu_ps(w.offset + gi * w.n + os[i] + 8 * h)
                                                 : _mm256_setzero_ps();
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r) {
            const __m256 rounded = _mm256_set1_ps(bias * sums[r][groups + gi]);
            const __m256 c = w.offset != nullptr ? _mm256_fmsub_ps(off, _mm256_set1_ps(sums[r][gi]), rounded)
                                                 : _mm256_sub_ps(_mm256_setzero_ps(), rounded);
            total[r][i][h] = _mm256_fmadd_ps(c, s, total[r][i][h]);
          }
        }
      }
    }
  }
#pragma GCC unroll 2
  for (int i = 0; i < B; ++i)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 bias = bo[i] != nullptr ? _mm256_loadu_ps(bo[i] + 8 * h) : _mm256_setzero_ps();
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(yo[i] + (m0 + r) * ldy + 8 * h, _mm256_add_ps(total[r][i][h], bias));
    }
}

// One band (o) of every row of x, 2 rows at a time; the first pass fetches the next band (qband_rows_r16_vnni's)
MSLLM_AVX2 void qband_rows_r16_avx2(const QuantWeight& w, int64_t rows, int64_t o, const float* bo, float* yo,
                                    int64_t ldy) {
  const uint8_t* next = next_band(w, o, w.k / 2);
  for (int64_t m = 0; m < rows; m += 2, next = nullptr) {
    if (rows - m == 1)
      qbands_r16_avx2<1, 1>(w, m, &o, &bo, &yo, ldy, next);
    else
      qbands_r16_avx2<2, 1>(w, m, &o, &bo, &yo, ldy, next);
  }
}

template <int R, int C, bool INT4, bool EXACT>
MSLLM_AVX2 void qtiles_avx2(const QuantWeight& w, int64_t m0, const float* b, float* y, int64_t ldy, int64_t o0,
                            int64_t o1) {
  each_tile<C>(o0, o1, [&](const int64_t* n, int cols) { qtile_avx2<R, C, INT4, EXACT>(w, m0, n, cols, b, y, ldy); });
}

// 1 row of x by 6 weight rows (ahead of 4 by 5-10 % in cache), 2 by 3, 3 or 4 by 2: the accumulators fit the 16
// ymm registers
template <bool INT4, bool EXACT>
MSLLM_AVX2 void qrows_avx2_t(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy, int64_t o0,
                             int64_t o1) {
  for (int64_t m = 0; m < rows; m += 4) {
    switch (std::min<int64_t>(4, rows - m)) {
      case 1: qtiles_avx2<1, 2, INT4, EXACT>(w, m, b, y, ldy, o0, o1); break;  // 2 weight rows: see qrows_vnni_t
      case 2: qtiles_avx2<2, 3, INT4, EXACT>(w, m, b, y, ldy, o0, o1); break;
      case 3: qtiles_avx2<3, 2, INT4, EXACT>(w, m, b, y, ldy, o0, o1); break;
      default: qtiles_avx2<4, 2, INT4, EXACT>(w, m, b, y, ldy, o0, o1); break;
    }
  }
}

MSLLM_AVX2 void qrows_avx2(const float*, int64_t rows, const void* wv, const float* b, int64_t, float* y, int64_t ldy,
                           int64_t o0, int64_t o1) {
  const QuantWeight& w = *static_cast<const QuantWeight*>(wv);
  if (!w.x->int16 || (w.r16 && !w.x->int8)) return qrows_float(w, rows, b, y, ldy, o0, o1);
  if (w.r16) {
    run_bands(
        w, rows, b, y, ldy, o0, o1, std::min(row_streams(), 2),
        [&](int64_t n, int64_t o, const float* bo, float* yo, int64_t ld) { qband_rows_r16_avx2(w, n, o, bo, yo, ld); },
        [&](const int64_t* os, int count) {
          const float* bo[2];
          float* yo[2];
          for (int i = 0; i < count; ++i) bo[i] = b != nullptr ? b + os[i] : nullptr, yo[i] = y + os[i];
          if (count == 2)
            qbands_r16_avx2<1, 2>(w, 0, os, bo, yo, ldy);
          else
            qbands_r16_avx2<1, 1>(w, 0, os, bo, yo, ldy);
        },
        [&](int64_t t0, int64_t t1) {  // the bands add their groups' constants themselves: the rows past them here
          qrows8_avx2(w, rows, b, y, ldy, t0, t1);
          add_group_constants_avx2(w, rows, y, ldy, t0, t1);
        });
    return;
  } else if (w.x->int8) {
    qrows8_avx2(w, rows, b, y, ldy, o0, o1);
  } else if (w.x->exact) {
    if (w.int4)
      qrows_avx2_t<true, true>(w, rows, b, y, ldy, o0, o1);
    else
      qrows_avx2_t<false, true>(w, rows, b, y, ldy, o0, o1);
  } else if (w.int4) {
    qrows_avx2_t<true, false>(w, rows, b, y, ldy, o0, o1);
  } else {
    qrows_avx2_t<false, false>(w, rows, b, y, ldy, o0, o1);
  }
  add_group_constants_avx2(w, rows, y, ldy, o0, o1);
}

// ---- the decode form on AVX-512 with VNNI: a block of 32 weights in one register -------------------------------
// The same integers, scales and order of float sums per block as the AVX2 form; vpdpwssd (AVX512_VNNI) multiplies the
// block's 32 int16 pairs and adds them in pairs into 16 int32 lanes, exactly, in one instruction where AVX2 needs two
// widenings, two vpmaddwd and an add. Chosen where the CPU has AVX512F, BW, VL and VNNI (kernel_form()).
#define MSLLM_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// the block's 32 weights as int16 (int4: the 16 even inputs, then the 16 odd ones, nibble ^ 8 as 0..15)
template <bool INT4>
MSLLM_AVX512_VNNI inline __m512i widen_vnni(const char* row, int64_t blk) {
  if (INT4) {
    const __m128i bytes = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + blk * (QBLOCK / 2))),
                                        _mm_set1_epi8(char(0x88)));
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bytes));  // [bytes, bytes] as int16
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(15));
    return _mm512_mask_srli_epi16(lo, __mmask32(0xFFFF0000u), v, 4);  // upper half: the high nibbles
  }
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + blk * QBLOCK)));
}

// row xq's 32 int16 inputs of block blk, laid out as widen_vnni lays the weights
template <bool INT4>
MSLLM_AVX512_VNNI inline __m512i x_vnni(const int16_t* xq, int64_t k, int64_t blk) {
  if (INT4) {
    const int16_t* even = xq + blk * (QBLOCK / 2);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + k / 2)), 1);
  }
  return _mm512_loadu_si512(xq + blk * QBLOCK);
}

// int4, blocks [b0, b1) of one group two at a time (b1 - b0 even): 32 bytes of a weight row are two blocks, their
// low nibbles the two blocks' even inputs and their high nibbles the odd ones, which x's int4 layout (the even inputs,
// then the odd) holds contiguous too. One widening, an and and a shift give both blocks; two vpdpwssd (evens, then
// odds) put block b0's sum in lanes 0-7 and b1's in lanes 8-15, each then scaled by its own block's x scale. The same
// integers as one block at a time (a lane now sums four products, exact in int32); the float sums in another order.
template <int R, int C, bool EXACT>
MSLLM_AVX512_VNNI inline void qpair_vnni(const QuantWeight& w, const int16_t* const* xq, const float* const* bs,
                                         const char* const* row, const char* next, int64_t b0, int64_t b1,
                                         __m512 (&acc)[R][C]) {
  const int64_t half = w.k / 2;
  for (int64_t blk = b0; blk < b1; blk += 2) {
    const char* ahead = next + blk * C * (QBLOCK / 2);
#pragma GCC unroll 8
    for (int64_t off = 0; off < C * QBLOCK; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    __m512i xe[R], xo[R], le[R], lo_[R];
    __m512 sb[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      xe[r] = _mm512_loadu_si512(xq[r] + blk * (QBLOCK / 2));
      xo[r] = _mm512_loadu_si512(xq[r] + half + blk * (QBLOCK / 2));
      if (EXACT) {
        le[r] = _mm512_loadu_si512(xq[r] + w.k + blk * (QBLOCK / 2));
        lo_[r] = _mm512_loadu_si512(xq[r] + w.k + half + blk * (QBLOCK / 2));
      }
      sb[r] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(bs[r][blk])),
                                                   _mm256_castps_pd(_mm256_set1_ps(bs[r][blk + 1])), 1));
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[c] + blk * (QBLOCK / 2)));
      const __m256i bytes = _mm256_xor_si256(raw, _mm256_set1_epi8(char(0x88)));
      const __m512i v = _mm512_cvtepu8_epi16(bytes);
      const __m512i even = _mm512_and_si512(v, _mm512_set1_epi16(15)), odd = _mm512_srli_epi16(v, 4);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512 d = _mm512_cvtepi32_ps(
            _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), xe[r], even), xo[r], odd));
        if (EXACT)
          d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(
                                  _mm512_dpwssd_epi32(_mm512_setzero_si512(), le[r], even), lo_[r], odd)),
                              _mm512_set1_ps(LOW_STEP), d);
        acc[r][c] = _mm512_fmadd_ps(d, sb[r], acc[r][c]);
      }
    }
  }
}

template <int R, int C, bool INT4, bool EXACT>
MSLLM_AVX512_VNNI void qtile_vnni(const QuantWeight& w, int64_t m0, const int64_t* n, int cols, const float* b,
                                  float* y, int64_t ldy) {
  const PreparedX& x = *w.x;
  const int64_t groups = w.k / w.group, per = w.group / QBLOCK;
  const int64_t block_bytes = INT4 ? QBLOCK / 2 : QBLOCK, row_bytes = INT4 ? w.k / 2 : w.k;
  const char* base = static_cast<const char*>(w.q);
  const char* next = base + (n[C - 1] + 1 + (PREFETCH_TILES - 1) * C) * row_bytes;  // may run past W: a hint only
  const char* row[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) row[c] = base + n[c] * row_bytes;
  const int16_t* xq[R];
  const float* bs[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xq[r] = prepared_row(x, m0 + r), bs[r] = block_scales(x, m0 + r);
  __m512 total[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    if (INT4 && per % 2 == 0) {  // int4, two blocks a step (qpair_vnni): half the unpacking and the conversions
      qpair_vnni<R, C, EXACT>(w, xq, bs, row, next, gi * per, (gi + 1) * per, acc);
    } else
    for (int64_t blk = gi * per; blk < (gi + 1) * per; ++blk) {
      const char* ahead = next + blk * C * block_bytes;
#pragma GCC unroll 8
      for (int64_t off = 0; off < C * block_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
      __m512i xv[R], xl[R];
      __m512 sb[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        xv[r] = x_vnni<INT4>(xq[r], w.k, blk);
        if (EXACT) xl[r] = x_vnni<INT4>(xq[r] + w.k, w.k, blk);
        sb[r] = _mm512_set1_ps(bs[r][blk]);
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m512i v = widen_vnni<INT4>(row[c], blk);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m512 d = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), xv[r], v));
          if (EXACT)
            d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), xl[r], v)),
                                _mm512_set1_ps(LOW_STEP), d);
          acc[r][c] = _mm512_fmadd_ps(d, sb[r], acc[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 s = _mm512_set1_ps(w.scale[gi * w.n + n[c]]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) total[r][c] = _mm512_fmadd_ps(acc[r][c], s, total[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[(m0 + r) * ldy + n[c]] = _mm512_reduce_add_ps(total[r][c]) + (b ? b[n[c]] : 0.f);
}

template <int R, int C, bool INT4, bool EXACT>
MSLLM_AVX512_VNNI void qtiles_vnni(const QuantWeight& w, int64_t m0, const float* b, float* y, int64_t ldy, int64_t o0,
                                   int64_t o1) {
  each_tile<C>(o0, o1, [&](const int64_t* n, int cols) { qtile_vnni<R, C, INT4, EXACT>(w, m0, n, cols, b, y, ldy); });
}

// accumulators in the 32 zmm registers: 3 and 4 rows of x by 3 weight rows (R x C x 2 + R + 1). One or two rows of x
// (the decode step of one or two sequences) take 2 weight rows a tile, not the 8 or 4 the registers hold: each weight
// row is a stream of reads, and 8 of them per thread read the int8 head (151936 x 2048) at 0.68-0.83 of a 2-thread
// read of the same bytes, 2 at 1.06-1.12 and 1 at 1.12-1.14 (the AVX2 form's 6: 0.63-0.82, 2: 1.00-1.16); at two rows
// of x 4 streams read at 0.89-0.92, 2 at 1.01-1.06; at three and four the arithmetic binds, and 2 is no better
// (docs/performance-log.md 44). 2 keeps some reuse of x's loads for matrices that sit in the cache.
template <bool INT4, bool EXACT>
MSLLM_AVX512_VNNI void qrows_vnni_t(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy,
                                    int64_t o0, int64_t o1) {
  for (int64_t m = 0; m < rows; m += 4) {
    switch (std::min<int64_t>(4, rows - m)) {
      case 1: qtiles_vnni<1, 2, INT4, EXACT>(w, m, b, y, ldy, o0, o1); break;
      case 2: qtiles_vnni<2, 2, INT4, EXACT>(w, m, b, y, ldy, o0, o1); break;
      case 3: qtiles_vnni<3, 3, INT4, EXACT>(w, m, b, y, ldy, o0, o1); break;
      default: qtiles_vnni<4, 3, INT4, EXACT>(w, m, b, y, ldy, o0, o1); break;
    }
  }
}

// int4 against x in int8 on AVX-512 VNNI: as qtile8_avx2, two weight rows' 32 bytes in one zmm (row c's in the low
// half, c + 1's in the high), their nibbles against x's bytes (PreparedX xb holds each half twice) by vpdpbusd, which
// multiplies unsigned by signed bytes and adds each four into an int32 lane, exactly: lanes 0-3 block 2s of row c, 4-7
// block 2s + 1, 8-15 the same of row c + 1. G32 as qtile8_avx2's.
template <int R, int P, bool G32>
MSLLM_AVX512_VNNI void qtile8_vnni(const QuantWeight& w, int64_t m0, const int64_t* n, int cols, const float* b,
                                   float* y, int64_t ldy) {
  constexpr int C = 2 * P;
  const PreparedX& x = *w.x;
  const int64_t groups = G32 ? 1 : w.k / w.group, per = G32 ? w.k / QSTEP : w.group / QSTEP, row_bytes = w.k / 2;
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const char* base = static_cast<const char*>(w.q);
  const char* next = base + (n[C - 1] + 1 + (PREFETCH_TILES - 1) * C) * row_bytes;  // may run past W: a hint only
  const char* row[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) row[c] = base + n[c] * row_bytes;
  const int8_t* xb[R];
  const float* xs[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xb[r] = x.xb.data() + (m0 + r) * 2 * w.k, xs[r] = x.xs.data() + (m0 + r) * (w.k / 4);
  const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(0x08);
  __m512 total[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) total[r][p] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 acc[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t s = gi * per; s < (gi + 1) * per; ++s) {
      const char* ahead = next + s * C * (QSTEP / 2);
#pragma GCC unroll 8
      for (int64_t off = 0; off < C * (QSTEP / 2); off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m512i raw = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[2 * p] + s * 32))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[2 * p + 1] + s * 32)), 1);
        // (a & 0x0F) ^ 0x08 in one instruction: ternary logic 0x6A is (A & B) ^ C
        const __m512i lo = _mm512_ternarylogic_epi32(raw, nibble, eight, 0x6A);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), nibble, eight, 0x6A);
        __m512 ws4 = _mm512_setzero_ps();  // G32: each lane's block's weight scale (lanes as the products')
        if (G32) {
          const float* s0 = w.scale + 2 * s * w.n;
          const float* s1 = s0 + w.n;
          ws4 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_setr_ps(s0[n[2 * p]], s1[n[2 * p]],
                                                                                 s0[n[2 * p + 1]], s1[n[2 * p + 1]])));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i e = _mm512_loadu_si512(xb[r] + s * 128), o = _mm512_loadu_si512(xb[r] + s * 128 + 64);
          const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, e), hi, o);
          const __m512 xsv = _mm512_loadu_ps(xs[r] + s * 16), scale = G32 ? _mm512_mul_ps(xsv, ws4) : xsv;
          acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r][p]);
        }
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m512 sc = G32 ? _mm512_set1_ps(1.f)
                            : _mm512_mask_blend_ps(__mmask16(0xFF00), _mm512_set1_ps(w.scale[gi * w.n + n[2 * p]]),
                                                   _mm512_set1_ps(w.scale[gi * w.n + n[2 * p + 1]]));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) total[r][p] = G32 ? acc[r][p] : _mm512_fmadd_ps(acc[r][p], sc, total[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) {
      const __m512d t = _mm512_castps_pd(total[r][c / 2]);
      const __m256 half = _mm256_castpd_ps(c % 2 ? _mm512_extractf64x4_pd(t, 1) : _mm512_castpd512_pd256(t));
      y[(m0 + r) * ldy + n[c]] = hsum8(half) + (b ? b[n[c]] : 0.f);
    }
}

template <int R, int P>
MSLLM_AVX512_VNNI void qtiles8_vnni(const QuantWeight& w, int64_t m0, const float* b, float* y, int64_t ldy,
                                    int64_t o0, int64_t o1) {
  each_tile<2 * P>(o0, o1, [&](const int64_t* n, int cols) {
    if (w.group == QBLOCK)
      qtile8_vnni<R, P, true>(w, m0, n, cols, b, y, ldy);
    else
      qtile8_vnni<R, P, false>(w, m0, n, cols, b, y, ldy);
  });
}

// 1 row of x by 8 weight rows, 2 by 8, 3 and 4 by 4 (acc and total 2 x R x P of the 32 zmm registers)
MSLLM_AVX512_VNNI void qrows8_vnni(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy,
                                   int64_t o0, int64_t o1) {
  for (int64_t m = 0; m < rows; m += 4) {
    switch (std::min<int64_t>(4, rows - m)) {
      case 1: qtiles8_vnni<1, 4>(w, m, b, y, ldy, o0, o1); break;
      case 2: qtiles8_vnni<2, 4>(w, m, b, y, ldy, o0, o1); break;
      case 3: qtiles8_vnni<3, 2>(w, m, b, y, ldy, o0, o1); break;
      default: qtiles8_vnni<4, 2>(w, m, b, y, ldy, o0, o1); break;
    }
  }
}

// ---- int8 against x in int8 (ACTIVATIONS_INT8), banded and biased (repack_int8_r16) -----------------------------
// x rounded to int8 per block of 32 as llama.cpp's Q8_0 rounds it, and the weights' bytes biased (q + 128, unsigned)
// so that vpdpbusd multiplies them by x's signed bytes as they are and adds each four into an int32 lane, exactly. The
// group's constant takes 128 x the sum of x as rounded off (add_group_constants), so x's rounding meets q, not q + 128.
// Why bands: per block of 32 inputs a row-major form converts and scales each (row of x, weight row)'s sum, which
// bound it (one row of x: level with the int16 form; 9 to 16 rows 1.05-1.26x it, where without those two instructions
// it ran 1.8-2.0x: docs/performance-log.md 47); in a band a lane is a weight row, so one conversion and one FMA per
// block serve 16 weight rows, as the int4 bands' (qbands_r16_vnni).
//
// The rows past the bands (n % 16, row-major, biased): a weight row's 64 bytes (two blocks) in one zmm against x's
// 64 bytes in input order: lanes 0-7 block 2s's sum, 8-15 block 2s + 1's, each scaled by its block's x scale
// (PreparedX xs).
template <int R, int C, bool G32>
MSLLM_AVX512_VNNI void qtile8w_vnni(const QuantWeight& w, int64_t m0, const int64_t* n, int cols, const float* b,
                                    float* y, int64_t ldy) {
  const PreparedX& x = *w.x;
  const int64_t groups = G32 ? 1 : w.k / w.group, per = G32 ? w.k / QSTEP : w.group / QSTEP;
  const char* base = static_cast<const char*>(w.q);
  const char* next = base + (n[C - 1] + 1 + (PREFETCH_TILES - 1) * C) * w.k;  // may run past W: a hint only
  const char* row[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) row[c] = base + n[c] * w.k;
  const int8_t* xb[R];
  const float* xs[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xb[r] = x.xb.data() + (m0 + r) * w.k, xs[r] = x.xs.data() + (m0 + r) * (w.k / 4);
  __m512 total[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t s = gi * per; s < (gi + 1) * per; ++s) {
      const char* ahead = next + s * C * QSTEP;
#pragma GCC unroll 8
      for (int64_t off = 0; off < C * QSTEP; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
      __m512i xv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(xb[r] + s * QSTEP);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(row[c] + s * QSTEP);
        __m512 ws = _mm512_setzero_ps();  // G32: the step's two blocks' weight scales of row c, 8 lanes each
        if (G32)
          ws = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(w.scale[2 * s * w.n + n[c]])),
                                                   _mm256_castps_pd(_mm256_set1_ps(w.scale[(2 * s + 1) * w.n + n[c]])),
                                                   1));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 sx = _mm512_loadu_ps(xs[r] + s * 16);
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xv[r])),
                                      G32 ? _mm512_mul_ps(sx, ws) : sx, acc[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 sc = G32 ? _mm512_set1_ps(1.f) : _mm512_set1_ps(w.scale[gi * w.n + n[c]]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) total[r][c] = _mm512_fmadd_ps(acc[r][c], sc, total[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[(m0 + r) * ldy + n[c]] = _mm512_reduce_add_ps(total[r][c]) + (b ? b[n[c]] : 0.f);
}

// rows [m, m + r) of x, r <= 4: 1 and 2 rows by 2 weight rows (two streams a thread, as qrows_vnni_t's for the same
// reason), 3 and 4 by 3
template <bool G32>
MSLLM_AVX512_VNNI void qtiles8w_vnni(const QuantWeight& w, int64_t m, int64_t r, const float* b, float* y, int64_t ldy,
                                     int64_t o0, int64_t o1) {
  if (r <= 2)
    each_tile<2>(o0, o1, [&](const int64_t* n, int cols) {
      if (r == 1)
        qtile8w_vnni<1, 2, G32>(w, m, n, cols, b, y, ldy);
      else
        qtile8w_vnni<2, 2, G32>(w, m, n, cols, b, y, ldy);
    });
  else
    each_tile<3>(o0, o1, [&](const int64_t* n, int cols) {
      if (r == 3)
        qtile8w_vnni<3, 3, G32>(w, m, n, cols, b, y, ldy);
      else
        qtile8w_vnni<4, 3, G32>(w, m, n, cols, b, y, ldy);
    });
}

MSLLM_AVX512_VNNI void qrows8w_vnni(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy,
                                    int64_t o0, int64_t o1) {
  for (int64_t m = 0; m < rows; m += 4) {
    const int64_t r = std::min<int64_t>(4, rows - m);
    if (w.group == QBLOCK)
      qtiles8w_vnni<true>(w, m, r, b, y, ldy, o0, o1);
    else
      qtiles8w_vnni<false>(w, m, r, b, y, ldy, o0, o1);
  }
}

// int4 in bands of 16 rows (repack_int4_r16) against x in int8: per block of 32 inputs, the band's 256 bytes in four
// zmm whose lane r holds 4 bytes of weight row r; their nibbles (as qtile8_vnni's, q + 8) against 4 of x's bytes
// broadcast to every lane, by vpdpbusd: each int32 lane sums one row's products over the whole block, so one
// conversion and one FMA (times the block's x scale) per block serve 16 weight rows, where the row-major form spends
// them per 4 lanes of one row; and a band is 16 rows' bytes in the order they are stored, one sequential stream for
// the hardware prefetcher (no software prefetch). The same integers, scales and per-group order of sums as
// qtile8_vnni; the float sums in another order.
// (docs/performance-log.md 41, the 7B shapes, 2 threads, out of cache: 1 row 1.19-1.48x the row-major form, 4 rows
// level, 16 rows 1.41-1.58x; the 7B int4 decode 1.48x.)
// Rows [m0, m0 + R) of x against B bands at once (band i: outputs os[i] .. os[i] + 15, written at yo[i][m * ldy + c],
// yo[i]: where output os[i] of row 0 goes, with bo[i][c] added, bo[i] null: none). R rows share each band's unpacked
// block; B bands are B sequential streams of weights per thread. Where the arithmetic between loads holds one stream
// back (the hardware prefetcher runs only so far ahead of it), more streams keep more of the reads in flight. Measured
// on an Intel Xeon (AVX-512 VNNI, AMX; 2 threads, out of cache, the 7B shapes' int4 matrices, alternating in fresh
// processes): one row at 10-12 GB/s with one stream, 11-14 with two, 13-16 with four, where a plain read does 17-20
// (docs/performance-log.md 45). On the AMD EPYC (Zen 4) of the int8 tiles' measurement (qrows_vnni_t) 4 streams a
// thread read 10 % slower than 2 and 2 as fast as 1, and on a Zen 5 one stream read 1.2-1.5x faster than two: so 4
// streams on Intel's CPUs, 1 elsewhere (row_streams, each_band_streams), for one row of x; more rows, one band at a
// time. Each band's sums are the same whatever B.
// INT4 false: banded int8 (repack_int8_r16) against x in int8 in input order (PreparedX int8w): the band's 512 bytes
// of a block in eight zmm, lane r 4 bytes of weight row r (q + 128), each against 4 of x's bytes broadcast (at most
// 32 x 255 x 127 a lane a block: exact), the even runs and the odd ones in two accumulators as int4's low and high
// nibbles; the same integers and scales as qtile8w_vnni (docs/performance-log.md 47).
// `next` (B = 1, several rows of x): the next band's first byte, each of whose blocks is fetched into the cache as this
// band's same block is computed (qband_rows_r16_vnni), or null.
template <int R, int B, bool INT4 = true>
MSLLM_AVX512_VNNI void qbands_r16_vnni(const QuantWeight& w, int64_t m0, const int64_t* os, const float* const* bo,
                                       float* const* yo, int64_t ldy, const uint8_t* next = nullptr) {
  const PreparedX& x = *w.x;
  const int64_t groups = w.k / w.group, per = w.group / QBLOCK, row_bytes = INT4 ? w.k / 2 : w.k;
  constexpr int64_t BLOCK_BYTES = INT4 ? 16 * QBLOCK / 2 : 16 * QBLOCK;
  const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(0x08);
  const uint8_t* band[B];
#pragma GCC unroll 4
  for (int i = 0; i < B; ++i) band[i] = static_cast<const uint8_t*>(w.q) + os[i] * row_bytes;
  const int8_t* xb[R];
  const float* bs[R];
  const float* sums[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    xb[r] = x.xb.data() + (m0 + r) * (INT4 ? 2 : 1) * w.k;
    bs[r] = block_scales(x, m0 + r), sums[r] = group_sums(x, m0 + r);
  }
  const float bias = weight_bias(w);
  __m512 total[R][B];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < B; ++i) total[r][i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 acc[R][B];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < B; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t blk = gi * per; blk < (gi + 1) * per; ++blk) {
#pragma GCC unroll 4
      for (int i = 0; i < B; ++i) {
        const uint8_t* wp = band[i] + blk * BLOCK_BYTES;
        if (next != nullptr)
#pragma GCC unroll 8
          for (int64_t line = 0; line < BLOCK_BYTES; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + blk * BLOCK_BYTES + line), _MM_HINT_T0);
        __m512i d0[R], d1[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) d0[r] = d1[r] = _mm512_setzero_si512();
        if (!INT4) {
#pragma GCC unroll 4
          for (int j = 0; j < 8; j += 2) {
            const __m512i v0 = _mm512_loadu_si512(wp + j * 64), v1 = _mm512_loadu_si512(wp + (j + 1) * 64);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              int32_t q0, q1;
              std::memcpy(&q0, xb[r] + blk * QBLOCK + 4 * j, 4);
              std::memcpy(&q1, xb[r] + blk * QBLOCK + 4 * j + 4, 4);
              d0[r] = _mm512_dpbusd_epi32(d0[r], v0, _mm512_set1_epi32(q0));
              d1[r] = _mm512_dpbusd_epi32(d1[r], v1, _mm512_set1_epi32(q1));
            }
          }
        } else
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m512i raw = _mm512_loadu_si512(wp + j * 64);
          const __m512i lo = _mm512_ternarylogic_epi32(raw, nibble, eight, 0x6A);
          const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), nibble, eight, 0x6A);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            int32_t e4, o4;
            x_quads(xb[r], blk, j, &e4, &o4);
            d0[r] = _mm512_dpbusd_epi32(d0[r], lo, _mm512_set1_epi32(e4));
            d1[r] = _mm512_dpbusd_epi32(d1[r], hi, _mm512_set1_epi32(o4));
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0[r], d1[r])), _mm512_set1_ps(bs[r][blk]),
                                      acc[r][i]);
      }
    }
    // the group's constant here, where a lane is a weight row (add_group_constants' pass over the scales again, after
    // the kernel, was ~4 % of a 0.5B int4 step): less the weight bias times x's rounded sum, plus the offset times x's
    // exact sum
#pragma GCC unroll 4
    for (int i = 0; i < B; ++i) {
      const __m512 s = _mm512_loadu_ps(w.scale + gi * w.n + os[i]);
      const __m512 off = w.offset != nullptr ? _mm512_loadu_ps(w.offset + gi * w.n + os[i]) : _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m512 a = _mm512_sub_ps(acc[r][i], _mm512_set1_ps(bias * sums[r][groups + gi]));
        if (w.offset != nullptr) a = _mm512_fmadd_ps(off, _mm512_set1_ps(sums[r][gi]), a);
        total[r][i] = _mm512_fmadd_ps(a, s, total[r][i]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < B; ++i) {
    const __m512 bias = bo[i] != nullptr ? _mm512_loadu_ps(bo[i]) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(yo[i] + (m0 + r) * ldy, _mm512_add_ps(total[r][i], bias));
  }
}

// One band (o) of every row of x, 4 rows at a time; the first pass fetches the next band's bytes as it goes (where
// there is a next whole band): the passes over a band read it from the cache, and without the fetch its first pass
// waited on memory with nothing to overlap (the band kernel at 9 rows out of cache took 1.7x its in-cache time;
// docs/performance-log.md 53)
template <bool INT4>
MSLLM_AVX512_VNNI void qband_rows_r16_vnni(const QuantWeight& w, int64_t rows, int64_t o, const float* bo, float* yo,
                                           int64_t ldy) {
  const uint8_t* next = next_band(w, o, INT4 ? w.k / 2 : w.k);
  for (int64_t m = 0; m < rows; m += 4, next = nullptr) {
    switch (std::min<int64_t>(4, rows - m)) {
      case 1: qbands_r16_vnni<1, 1, INT4>(w, m, &o, &bo, &yo, ldy, next); break;
      case 2: qbands_r16_vnni<2, 1, INT4>(w, m, &o, &bo, &yo, ldy, next); break;
      case 3: qbands_r16_vnni<3, 1, INT4>(w, m, &o, &bo, &yo, ldy, next); break;
      default: qbands_r16_vnni<4, 1, INT4>(w, m, &o, &bo, &yo, ldy, next); break;
    }
  }
}

bool cpu_has_vnni();

// ---- banded int8 by AMX tiles (tdpbsud), rows of x from AMX_MIN_ROWS ------------------------------------------------
// The same integers as qbands_r16_vnni's int8 form: per block of 32 inputs, every row's sum of x's int8 (PreparedX xb,
// in input order) times the band's biased bytes (q + 128), exact in int32. A band's block is already a tile of B as
// AMX lays one out (8 rows of 64 bytes: row j holds inputs 4j..4j+3 of the band's 16 weight rows, each 4 bytes), so
// one tdpbsud (x signed, the bytes unsigned) computes a block for every row of x at once: C [rows, 16] int32, stored
// and converted as the vector form converts its lanes. Where qbands_r16_vnni spends 8 vpdpbusd and 8 broadcasts per
// row of x per block, so that 9 rows cost 2.1x one row (a verify of 8 tokens 2.1 decode steps), the tile unit does
// the block's arithmetic; per row only the conversion and the FMA by the block's scale are left. The float sums in
// the same order as qbands_r16_vnni's: the same results, bit for bit (tests/test_quant_kernels.py). The prompt's rows
// (past QUANT_ROWS_MAX) take them too, 16 a tile (docs/architecture.md "AMX tiles: int8, int4 and bfloat16",
// performance-log.md 49).
// Where AMX is granted (common.h amx_granted: the CPU, the kernel, MSLITE_LLM_CPU_KERNELS_AMX) and the CPU has
// AMX-INT8; set_tiles switches it for tests and benchmarks.
#define MSLLM_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

// this machine's banded int8 weights may take the tiles: AMX granted (common.h), AMX-INT8, and the VNNI form they
// replace
const bool g_amx_here = amx_granted() && __builtin_cpu_supports("amx-int8") && cpu_has_vnni();
constexpr int64_t AMX_MIN_ROWS = 2;  // one row reads the weights in streams (each_band_streams): bound by the bytes
// int4 from 8 rows: widening a band's nibbles to a tile of bytes costs the same whatever the rows, so below 8 the
// vector form, which widens them in registers, is faster (4864 x 896 out of cache: 2 rows 0.81x, 4 0.94x, 8 1.06x,
// 9 1.13x, 16 1.34x the vector form)
constexpr int64_t AMX_MIN_ROWS_INT4 = 8;

// whether banded weights (x in int8) take the tiles for `rows` rows of x: int8 from AMX_MIN_ROWS, any number (past
// QUANT_ROWS_MAX, the prompt's rows: 16 a tile, x padded by prepare); int4 where prepare laid x out for them
// (PreparedX tiles: int4_tiles_take)
bool amx_takes(const QuantWeight& w, int64_t rows) {
  if (!w.r16 || w.x == nullptr) return false;
  if (w.int4) return w.x->tiles;
  return rows >= AMX_MIN_ROWS && g_amx_here && tiles_on() && w.x->int8w;
}

// The tile configuration of `rows` rows of x: tiles 0, 1 C [rows, 16] int32; 2 A [rows, 32] int8 (a block of x);
// 4, 5 B, a band's block (8 rows of 64 bytes)
void amx_begin(int64_t rows) {
  TileConfig c;
  for (int t : {0, 1, 4, 5}) c.colsb[t] = 64, c.rows[t] = uint8_t(t < 2 ? rows : 8);
  c.colsb[2] = 32, c.rows[2] = uint8_t(rows);
  tile_configure(c);
}

// Rows R of x (all of them: R <= QUANT_ROWS_MAX) against `count` bands (1 to 4) at once (os, bo, yo as
// qbands_r16_vnni's); the tiles configured for R rows (amx_begin). Per block, x's tile loaded once, then each band's
// block in turn: products into a C tile, stored, and converted while the next band's block is in the tile unit (two
// sets of tiles, so that a store's latency hides behind the next products). More bands, more streams of weights:
// one band at a time left the tiles' loads waiting on memory (9 rows at 1.73x one row out of cache; the vector form's
// one row reads in 4 streams for the same reason, each_band_streams).
template <int R, bool INT4>
MSLLM_AMX void qbands_amx(const QuantWeight& w, int64_t m0, int64_t valid, const int64_t* os, int count,
                          const float* const* bo, float* const* yo, int64_t ldy) {
  const PreparedX& x = *w.x;
  const int64_t groups = w.k / w.group, per = w.group / QBLOCK;
  const int8_t* xb = (INT4 ? x.xa.data() : x.xb.data()) + m0 * w.k;
  constexpr int64_t BLOCK_BYTES = INT4 ? 16 * QBLOCK / 2 : 16 * QBLOCK;
  const uint8_t* band[4];
  for (int i = 0; i < count; ++i) band[i] = static_cast<const uint8_t*>(w.q) + os[i] * (INT4 ? w.k / 2 : w.k);
  // int4: a band's block (4 runs of 64 bytes, lane r 8 nibbles of weight row r) widened to bytes q + 8 (0..15) as a
  // tile of B: rows 0-3 the runs' low nibbles (the block's even inputs 4j..4j+3), rows 4-7 their high ones (the odd
  // inputs), against x's A in that order (PreparedX xa): the products qbands_r16_vnni<R, B, true> sums in d0 + d1
  alignas(64) uint8_t wide[2][16 * QBLOCK];
  const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(0x08);
  const auto widen = [&](const uint8_t* wp, uint8_t* out) MSLLM_AMX {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(wp + j * 64);
      _mm512_store_si512(out + j * 64, _mm512_ternarylogic_epi32(raw, nibble, eight, 0x6A));
      _mm512_store_si512(out + 256 + j * 64, _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), nibble, eight, 0x6A));
    }
  };
  const float* bs[R];
  const float* sums[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) bs[r] = block_scales(x, m0 + r), sums[r] = group_sums(x, m0 + r);
  const float bias = weight_bias(w);
  alignas(64) int32_t c[2][R * 16];
  __m512 total[4][R], acc[4][R];
  for (int i = 0; i < count; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) total[i][r] = _mm512_setzero_ps();
  // each band's stream prefetched 4 blocks ahead (2 KB of int8): 9 rows out of cache 1.19x without (a band of 896
  // inputs)
  constexpr int64_t ahead = 4 * 16 * QBLOCK;
  const auto products = [&](int set, const uint8_t* wp) MSLLM_AMX {
#pragma GCC unroll 8
    for (int l = 0; l < int(BLOCK_BYTES / 64); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(wp + ahead + 64 * l), _MM_HINT_T0);
    if (INT4) wp = wide[set];  // widened a unit before (a tile's load of bytes just stored waits for them)
    if (set == 0) {
      _tile_zero(0);
      _tile_loadd(4, wp, 64);
      _tile_dpbsud(0, 2, 4);
      _tile_stored(0, c[0], 64);
    } else {
      _tile_zero(1);
      _tile_loadd(5, wp, 64);
      _tile_dpbsud(1, 2, 5);
      _tile_stored(1, c[1], 64);
    }
  };
  const auto convert = [&](int set, int i, int64_t blk) MSLLM_AMX {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[set] + 16 * r)), _mm512_set1_ps(bs[r][blk]),
                                  acc[i][r]);
  };
  for (int64_t gi = 0; gi < groups; ++gi) {
    for (int i = 0; i < count; ++i)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    int unit = 0, pending_i = -1;  // the unit (block, band) stored last, converted after the next one's products
    int64_t pending_blk = 0;
    if (INT4) widen(band[0] + gi * per * BLOCK_BYTES, wide[0]);
    for (int64_t blk = gi * per; blk < (gi + 1) * per; ++blk) {
      _tile_loadd(2, xb + blk * QBLOCK, w.k);
      for (int i = 0; i < count; ++i, ++unit) {
        products(unit & 1, band[i] + blk * BLOCK_BYTES);
        if (INT4 && (i + 1 < count || blk + 1 < (gi + 1) * per))  // the next unit's block, widened ahead
          widen(i + 1 < count ? band[i + 1] + blk * BLOCK_BYTES : band[0] + (blk + 1) * BLOCK_BYTES,
                wide[(unit + 1) & 1]);
        if (pending_i >= 0) convert((unit - 1) & 1, pending_i, pending_blk);
        pending_i = i, pending_blk = blk;
      }
    }
    convert((unit - 1) & 1, pending_i, pending_blk);
    for (int i = 0; i < count; ++i) {
      const int64_t o = os[i];
      const __m512 s = _mm512_loadu_ps(w.scale + gi * w.n + o);
      const __m512 off = w.offset != nullptr ? _mm512_loadu_ps(w.offset + gi * w.n + o) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512 a = _mm512_sub_ps(acc[i][r], _mm512_set1_ps(bias * sums[r][groups + gi]));
        if (w.offset != nullptr) a = _mm512_fmadd_ps(off, _mm512_set1_ps(sums[r][gi]), a);
        total[i][r] = _mm512_fmadd_ps(a, s, total[i][r]);
      }
    }
  }
  for (int i = 0; i < count; ++i) {
    const __m512 b = bo[i] != nullptr ? _mm512_loadu_ps(bo[i]) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      if (r < valid) _mm512_storeu_ps(yo[i] + (m0 + r) * ldy, _mm512_add_ps(total[i][r], b));
  }
}

template <bool INT4>
MSLLM_AMX void qbands_tile_amx(const QuantWeight& w, int64_t tile_rows, int64_t m0, int64_t valid, const int64_t* os,
                               int count, const float* const* bo, float* const* yo, int64_t ldy) {
  switch (tile_rows) {
#define MSLLM_AMX_ROWS(R) \
  case R: return qbands_amx<R, INT4>(w, m0, valid, os, count, bo, yo, ldy);
    MSLLM_AMX_ROWS(1) MSLLM_AMX_ROWS(2) MSLLM_AMX_ROWS(3) MSLLM_AMX_ROWS(4) MSLLM_AMX_ROWS(5) MSLLM_AMX_ROWS(6)
    MSLLM_AMX_ROWS(7) MSLLM_AMX_ROWS(8) MSLLM_AMX_ROWS(9) MSLLM_AMX_ROWS(10) MSLLM_AMX_ROWS(11) MSLLM_AMX_ROWS(12)
    MSLLM_AMX_ROWS(13) MSLLM_AMX_ROWS(14) MSLLM_AMX_ROWS(15) MSLLM_AMX_ROWS(16)
#undef MSLLM_AMX_ROWS
    default: break;
  }
}

// Every row of x against `count` bands, the tiles configured for tile_rows (amx_begin): all the rows where they are
// at most 16, else 16 at a time (x padded to whole tiles: prepare), the band's bytes read again from the cache
template <bool INT4>
MSLLM_AMX void qbands_rows_amx(const QuantWeight& w, int64_t rows, int64_t tile_rows, const int64_t* os, int count,
                               const float* const* bo, float* const* yo, int64_t ldy) {
  for (int64_t m0 = 0; m0 < rows; m0 += tile_rows)
    qbands_tile_amx<INT4>(w, tile_rows, m0, rows - m0, os, count, bo, yo, ldy);
}

// A banded weight's outputs [o0, o1) against x in int8 (run_bands), the rows past the bands row-major
template <bool INT4>
MSLLM_AVX512_VNNI void bands_vnni(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy, int64_t o0,
                                  int64_t o1) {
  if (amx_takes(w, rows)) {
    const int64_t tile_rows = std::min(rows, QUANT_ROWS_MAX);
    amx_begin(tile_rows);
    const auto tail = [&](int64_t t0, int64_t t1) {
      if (INT4)
        qrows8_vnni(w, rows, b, y, ldy, t0, t1);
      else
        qrows8w_vnni(w, rows, b, y, ldy, t0, t1);
    };
    const auto one = [&](int64_t n, int64_t o, const float* bo, float* yo, int64_t ld) {
      qbands_rows_amx<INT4>(w, n, tile_rows, &o, 1, &bo, &yo, ld);
    };
    const auto banded = [&](int64_t t0, int64_t t1) { each_band(w, rows, b, y, ldy, t0, t1, one, tail); };
    const auto streamed = [&](const int64_t* os, int count) {
      const float* bo[4];
      float* yo[4];
      for (int i = 0; i < count; ++i) bo[i] = b != nullptr ? b + os[i] : nullptr, yo[i] = y + os[i];
      qbands_rows_amx<INT4>(w, rows, tile_rows, os, count, bo, yo, ldy);
    };
    if (!each_band_streams(w, o0, o1, row_streams(), streamed, banded)) banded(o0, o1);
    tile_release();
    return;
  }
  run_bands(
      w, rows, b, y, ldy, o0, o1, row_streams(),
      [&](int64_t n, int64_t o, const float* bo, float* yo, int64_t ld) {
        qband_rows_r16_vnni<INT4>(w, n, o, bo, yo, ld);
      },
      [&](const int64_t* os, int count) {
        const float* bo[4];
        float* yo[4];
        for (int i = 0; i < count; ++i) bo[i] = b != nullptr ? b + os[i] : nullptr, yo[i] = y + os[i];
        switch (count) {
          case 4: qbands_r16_vnni<1, 4, INT4>(w, 0, os, bo, yo, ldy); break;
          case 3: qbands_r16_vnni<1, 3, INT4>(w, 0, os, bo, yo, ldy); break;
          case 2: qbands_r16_vnni<1, 2, INT4>(w, 0, os, bo, yo, ldy); break;
          default: qbands_r16_vnni<1, 1, INT4>(w, 0, os, bo, yo, ldy); break;
        }
      },
      [&](int64_t t0, int64_t t1) {
        if (INT4)
          qrows8_vnni(w, rows, b, y, ldy, t0, t1);
        else
          qrows8w_vnni(w, rows, b, y, ldy, t0, t1);
      });
}

// Banded int4 or int8 against x as given, in float32 (the modes whose x the banded forms' integers do not take:
// check's replays with x exact, or in int16): per run of a block, each lane's 4 bytes (a weight row's 4 int8 inputs, or
// 8 int4 ones) sign-extended in place by two shifts (int8 unbiased first), converted, and multiplied by x's value
// broadcast; summed per group in float32, then times the group's scale, plus its offset times x's exact sum over the
// group. float32's products of the stored integers, as the row-major exact form's (another order of sums); reading
// the bands as they are, where dequantizing them into rows made check's replays a third slower end to end.
template <int R, bool INT4>
MSLLM_AVX512_VNNI void qband_float_vnni(const QuantWeight& w, int64_t m0, int64_t o, const float* bo, float* yo,
                                        int64_t ldy) {
  const PreparedX& x = *w.x;
  const int64_t groups = w.k / w.group, per = w.group / QBLOCK;
  constexpr int RUNS = INT4 ? 4 : 8, PER_RUN = INT4 ? 8 : 4, BITS = INT4 ? 4 : 8;
  const uint8_t* band = static_cast<const uint8_t*>(w.q) + o * (INT4 ? w.k / 2 : w.k);
  const float* xr[R];
  const float* sums[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xr[r] = x.x + (m0 + r) * w.k, sums[r] = group_sums(x, m0 + r);
  __m512 total[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = gi * per; blk < (gi + 1) * per; ++blk) {
      const uint8_t* wp = band + blk * (RUNS * 64);
      for (int j = 0; j < RUNS; ++j) {
        __m512i v = _mm512_loadu_si512(wp + j * 64);
        if (!INT4) v = _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80)));
#pragma GCC unroll 8
        for (int p = 0; p < PER_RUN; ++p) {
          const __m512 f = _mm512_cvtepi32_ps(
              _mm512_srai_epi32(_mm512_slli_epi32(v, 32 - BITS * (p + 1)), 32 - BITS));
          const int64_t i = blk * QBLOCK + j * PER_RUN + p;  // int4: byte 4j + p / 2, its low nibble then its high
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(xr[r][i]), acc[r]);
        }
      }
    }
    const __m512 s = _mm512_loadu_ps(w.scale + gi * w.n + o);
    const __m512 off = w.offset != nullptr ? _mm512_loadu_ps(w.offset + gi * w.n + o) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      total[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(off, _mm512_set1_ps(sums[r][gi]), acc[r]), s, total[r]);
  }
  const __m512 bias = bo != nullptr ? _mm512_loadu_ps(bo) : _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(yo + (m0 + r) * ldy, _mm512_add_ps(total[r], bias));
}

template <bool INT4>
MSLLM_AVX512_VNNI void qband_float_rows_vnni(const QuantWeight& w, int64_t rows, int64_t o, const float* bo, float* yo,
                                             int64_t ldy) {
  for (int64_t m = 0; m < rows; m += 4) {
    switch (std::min<int64_t>(4, rows - m)) {
      case 1: qband_float_vnni<1, INT4>(w, m, o, bo, yo, ldy); break;
      case 2: qband_float_vnni<2, INT4>(w, m, o, bo, yo, ldy); break;
      case 3: qband_float_vnni<3, INT4>(w, m, o, bo, yo, ldy); break;
      default: qband_float_vnni<4, INT4>(w, m, o, bo, yo, ldy); break;
    }
  }
}

MSLLM_AVX512_VNNI void qrows_vnni(const float*, int64_t rows, const void* wv, const float* b, int64_t, float* y,
                                  int64_t ldy, int64_t o0, int64_t o1) {
  const QuantWeight& w = *static_cast<const QuantWeight*>(wv);
  if (!w.x->int16) return qrows_float(w, rows, b, y, ldy, o0, o1);
  if (w.r16 && !w.x->int8 && !w.x->int8w) {  // banded, x not in int8 (check's replays): float32 on the bands
    const auto tail = [&](int64_t t0, int64_t t1) { qrows_float(w, rows, b, y, ldy, t0, t1); };
    if (w.int4)
      each_band(w, rows, b, y, ldy, o0, o1, [&](int64_t n, int64_t o, const float* bo, float* yo, int64_t ld) {
        qband_float_rows_vnni<true>(w, n, o, bo, yo, ld);
      }, tail);
    else
      each_band(w, rows, b, y, ldy, o0, o1, [&](int64_t n, int64_t o, const float* bo, float* yo, int64_t ld) {
        qband_float_rows_vnni<false>(w, n, o, bo, yo, ld);
      }, tail);
    return;
  }
  if (w.r16) {  // the bands add their groups' constants themselves: the rows past them here
    if (w.int4)
      bands_vnni<true>(w, rows, b, y, ldy, o0, o1);
    else
      bands_vnni<false>(w, rows, b, y, ldy, o0, o1);
    const int64_t n16 = w.n - w.n % 16;
    if (o1 > n16) add_group_constants_avx2(w, rows, y, ldy, std::max(o0, n16), o1);
    return;
  } else if (w.x->int8) {
    qrows8_vnni(w, rows, b, y, ldy, o0, o1);
  } else if (w.x->exact) {
    if (w.int4)
      qrows_vnni_t<true, true>(w, rows, b, y, ldy, o0, o1);
    else
      qrows_vnni_t<false, true>(w, rows, b, y, ldy, o0, o1);
  } else if (w.int4) {
    qrows_vnni_t<true, false>(w, rows, b, y, ldy, o0, o1);
  } else {
    qrows_vnni_t<false, false>(w, rows, b, y, ldy, o0, o1);
  }
  add_group_constants_avx2(w, rows, y, ldy, o0, o1);
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return isa_extensions() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}
#endif

#ifdef MSLLM_NEON
// The same per block: the weights widened to int16 (vmovl), multiplied by x's int16 into int32 lanes (vmlal_s16),
// converted and times the block's scale; the sums per output in float32x4.
template <bool INT4>
inline float32x4_t block_neon(const QuantWeight& w, int64_t n, int64_t blk, const int16_t* xq) {
  int16x8_t v[4];  // int8: inputs 0-7, 8-15, 16-23, 24-31; int4: even 0-7, even 8-15, odd 0-7, odd 8-15
  const int16_t* xs[4];
  if (INT4) {
    const uint8x16_t bytes = veorq_u8(vld1q_u8(static_cast<const uint8_t*>(w.q) + n * (w.k / 2) + blk * (QBLOCK / 2)),
                                      vdupq_n_u8(0x88));
    const uint8x16_t lo = vandq_u8(bytes, vdupq_n_u8(15)), hi = vshrq_n_u8(bytes, 4);
    v[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(lo)));
    v[1] = vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(lo)));
    v[2] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(hi)));
    v[3] = vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(hi)));
    const int16_t* even = xq + blk * (QBLOCK / 2);
    xs[0] = even, xs[1] = even + 8, xs[2] = even + w.k / 2, xs[3] = even + w.k / 2 + 8;
  } else {
    const int8_t* q = static_cast<const int8_t*>(w.q) + n * w.k + blk * QBLOCK;
    const int8x16_t a = vld1q_s8(q), c = vld1q_s8(q + 16);
    v[0] = vmovl_s8(vget_low_s8(a)), v[1] = vmovl_s8(vget_high_s8(a));
    v[2] = vmovl_s8(vget_low_s8(c)), v[3] = vmovl_s8(vget_high_s8(c));
    const int16_t* x0 = xq + blk * QBLOCK;
    xs[0] = x0, xs[1] = x0 + 8, xs[2] = x0 + 16, xs[3] = x0 + 24;
  }
  int32x4_t t = vdupq_n_s32(0);
  for (int i = 0; i < 4; ++i) {
    const int16x8_t x = vld1q_s16(xs[i]);
    t = vmlal_s16(t, vget_low_s16(x), vget_low_s16(v[i]));
    t = vmlal_s16(t, vget_high_s16(x), vget_high_s16(v[i]));
  }
  return vcvtq_f32_s32(t);
}

template <bool INT4>
void qrows_neon_t(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy, int64_t o0, int64_t o1) {
  const PreparedX& x = *w.x;
  const int64_t groups = w.k / w.group, per = w.group / QBLOCK;
  for (int64_t m = 0; m < rows; ++m) {
    const int16_t* xq = prepared_row(x, m);
    const float* bs = block_scales(x, m);
    for (int64_t o = o0; o < o1; ++o) {
      float total = 0.f;
      for (int64_t gi = 0; gi < groups; ++gi) {
        float32x4_t acc = vdupq_n_f32(0.f);
        for (int64_t blk = gi * per; blk < (gi + 1) * per; ++blk)
          acc = vfmaq_n_f32(acc, x.exact ? vfmaq_n_f32(block_neon<INT4>(w, o, blk, xq),
                                                        block_neon<INT4>(w, o, blk, xq + w.k), LOW_STEP)
                                         : block_neon<INT4>(w, o, blk, xq),
                            bs[blk]);
        total += vaddvq_f32(acc) * w.scale[gi * w.n + o];
      }
      y[m * ldy + o] = total + (b ? b[o] : 0.f);
    }
  }
}

void qrows_neon(const float*, int64_t rows, const void* wv, const float* b, int64_t, float* y, int64_t ldy, int64_t o0,
                int64_t o1) {
  const QuantWeight& w = *static_cast<const QuantWeight*>(wv);
  if (!w.x->int16 || w.r16) return qrows_float(w, rows, b, y, ldy, o0, o1);
  if (w.int4)
    qrows_neon_t<true>(w, rows, b, y, ldy, o0, o1);
  else
    qrows_neon_t<false>(w, rows, b, y, ldy, o0, o1);
  add_group_constants(w, rows, y, ldy, o0, o1);
}
#endif

struct Kernels {
  DequantFn dequant;
  DotsFn dots;
  RowsFn rows;  // the decode form (below)
  const char* form;  // the decode form's name (kernel_form)
};

Kernels pick_kernels() {
  switch (isa()) {
#ifdef MSLLM_X86
    case ISA_AVX512:  // the decode form with VNNI where the CPU has it; the prompt's forms are AVX2's
      if (cpu_has_vnni()) return {dequant_avx2, dots_avx2, qrows_vnni, "avx512_vnni"};
      return {dequant_avx2, dots_avx2, qrows_avx2, "avx2"};
    case ISA_AVX2:
      return {dequant_avx2, dots_avx2, qrows_avx2, "avx2"};
#endif
#ifdef MSLLM_NEON
    case ISA_NEON:
      return {dequant_generic, dots_generic, qrows_neon, "neon"};
#endif
    default:
      return {dequant_generic, dots_generic, qrows_generic, "generic"};
  }
}

const Kernels g_kernels = pick_kernels();

}  // namespace

// the quantized decode form this machine runs: "avx512_vnni", "avx2", "neon" or "generic"
const char* quant_form() { return g_kernels.form; }

// whether banded int4 weights take AMX tiles for `rows` rows of x (qbands_amx<R, true>): from AMX_MIN_ROWS_INT4, x in
// int8 (the form's rule and mode), the tiles granted and on; prepare lays x out for them (PreparedX xa) where so
bool int4_tiles_take(const QuantWeight& w, int64_t rows) {
#ifdef MSLLM_X86
  return rows >= AMX_MIN_ROWS_INT4 && g_amx_here && tiles_on() && takes_int4w(w);
#else
  (void)w, (void)rows;
  return false;
#endif
}

bool quant_rows_take(const QuantWeight& w, int64_t rows) {
  if (rows <= QUANT_ROWS_MAX) return true;
#ifdef MSLLM_X86
  // banded weights in the default activations (x in int8, as a decode step rounds it): their rows form takes any
  // number of rows without the tiles too, passes of up to 4 rows over each band while it is in L1, vpdpbusd on
  // AVX-512 VNNI: a chunk call of 144 rows of SmolLM2 on an AMD EPYC Zen 5 int8 145 -> 52 ms, int4 137 -> 71 (AVX2
  // forced: int4 189 -> 141) against the float32 GEMM on dequantized weights (performance-log.md 56); where AMX
  // tiles run they take these same calls (qbands_amx)
  return takes_int8w(w) || takes_int4w(w);
#else
  (void)w;
  return false;
#endif
}

bool int8_tiles_here() {
#ifdef MSLLM_X86
  return g_amx_here;
#else
  return false;
#endif
}

namespace {
// Tiles of NT weight rows: each dequantized KC inputs at a time (dequantize_rows: the buffered forms' float32
// weights, from any layout) and dotted with every row of x as given by the ISA's dots, as the buffered GEMM does.
// (A row at a time with a plain dot made check's replays of a banded folder a third slower end to end.)
void qrows_float(const QuantWeight& w, int64_t rows, const float* b, float* y, int64_t ldy, int64_t o0, int64_t o1) {
  alignas(64) float wbuf[NT * KC], panel[NT * KC];
  for (int64_t n0 = o0; n0 < o1; n0 += NT) {
    const int64_t cols = std::min(NT, o1 - n0);
    std::fill(wbuf + cols * KC, wbuf + NT * KC, 0.f);
    for (int64_t kb = 0; kb < w.k; kb += KC) {
      const int64_t kc = std::min(KC, w.k - kb);
      dequantize_rows(w, n0, cols, kb, kc, wbuf, KC);
      g_kernels.dots(w.x->x + kb, w.k, rows, wbuf, kc, y + n0, ldy, cols, kb > 0, panel);
    }
    if (b != nullptr)
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = 0; c < cols; ++c) y[m * ldy + n0 + c] += b[n0 + c];
  }
}
}  // namespace

namespace {

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
        alignas(64) uint8_t packed[KC / 2];
        unpack_int4(int4_row_bytes(p.q, p.r16, p.n, p.k, n, kb / 2, kc / 2, packed), kc / 2, qbuf);
        src = qbuf;
      } else {
        src = int8_row(p.q, p.r16, p.n, p.k, n, kb, kc, qbuf);
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
struct GemmJob : Job {
  const Problem* problem;
  int64_t m_blocks;
  Shares shares;

  void work() override {
    alignas(64) float wbuf[NT * KC], panel[NT * KC];  // 16 KB each: on the stack, aligned for the vector stores
    alignas(64) int8_t qbuf[KC];
    const Problem& p = *problem;
    shares.claim([&](int64_t t) {  // n-tile major: a thread's share is a stretch of consecutive weight rows
      const int64_t n0 = (t / m_blocks) * NT, n1 = std::min(p.n, n0 + NT);
      const int64_t m0 = (t % m_blocks) * MB, m1 = std::min(p.m, m0 + MB);
      run_task(p, n0, n1, m0, m1, wbuf, panel, qbuf);
    });
  }
};

void quant_gemm(const Problem& p) {
  const int64_t n_tiles = (p.n + NT - 1) / NT, m_blocks = (p.m + MB - 1) / MB, tasks = n_tiles * m_blocks;
  const double work = double(p.m) * double(p.n) * double(p.k);
  const int threads = work < double(MIN_PARALLEL_WORK)
                          ? 1
                          : int(std::max<int64_t>(1, std::min<int64_t>(tasks, threads_to_use())));
  GemmJob job;
  job.problem = &p, job.m_blocks = m_blocks;
  job.shares.split(tasks, threads);
  run(&job, threads > 1);
}

// The decode form in the pool: tasks of task_rows(n) outputs, every row of x in each (one weight stream per thread)
struct RowsJob : Job {
  const QuantWeight* w;
  int64_t rows, step;
  const float* b;
  float* y;
  Shares shares;

  void work() override {
    shares.claim([&](int64_t t) {
      const int64_t o0 = t * step;
      g_kernels.rows(nullptr, rows, w, b, w->k, y, w->n, o0, std::min(w->n, o0 + step));
    });
  }
};

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
  quant_gemm(p);
}

}  // namespace

bool is_quant_dtype(const char* dtype) { return is_weight_dtype(dtype); }

int quant_activations() { return g_activations.load(std::memory_order_relaxed); }

namespace {
thread_local int g_r16_calls = 0;  // R16Call's on this thread
}  // namespace

R16Call::R16Call() { ++g_r16_calls; }
R16Call::~R16Call() { --g_r16_calls; }

bool r16_runs(int64_t k, int64_t group) {
  QuantWeight w;
  w.int4 = true, w.k = k, w.group = group;
  return k > 0 && group > 0 && k % group == 0 && (!std::strcmp(quant_form(), "avx512_vnni") || !std::strcmp(quant_form(), "avx2")) &&
         default_activations() == ACTIVATIONS_INT8 && int16_fits(w) && int4_x8_fits(w);
}

// rows [0, n - n % 16) of q (rows of kb bytes, blocks of `block` bytes, a multiple of 4) into bands of 16 rows, in
// place: per band and block, block / 4 runs of 64 bytes, run j bytes 4j..4j+3 of each of the 16 rows
void repack_bands(uint8_t* q, int64_t n, int64_t kb, int64_t block) {
  const int64_t blocks = kb / block;
  std::vector<uint8_t> band(size_t(16 * kb));
  for (int64_t o = 0; o + 16 <= n; o += 16) {
    uint8_t* dst = q + o * kb;
    std::memcpy(band.data(), dst, band.size());
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t j = 0; j < block / 4; ++j)
        for (int r = 0; r < 16; ++r)
          std::memcpy(dst + blk * 16 * block + j * 64 + r * 4, band.data() + r * kb + blk * block + j * 4, 4);
  }
}

bool repack_int4_r16(uint8_t* q, int64_t n, int64_t k) {
  if (n < 0 || k <= 0 || k % QBLOCK) return false;
  repack_bands(q, n, k / 2, QBLOCK / 2);
  return true;
}

bool int8_r16_runs(int64_t k, int64_t group) {
  QuantWeight w;
  w.k = k, w.group = group;
  return k > 0 && group > 0 && k % group == 0 && !std::strcmp(quant_form(), "avx512_vnni") &&
         default_activations() == ACTIVATIONS_INT8 && int8w_fits(w);
}

bool repack_int8_r16(int8_t* q, int64_t n, int64_t k) {
  if (n < 0 || k <= 0 || k % QBLOCK) return false;
  uint8_t* bytes = reinterpret_cast<uint8_t*>(q);
  for (int64_t i = 0; i < n * k; ++i) bytes[i] ^= 0x80;
  repack_bands(bytes, n, k, QBLOCK);
  return true;
}

int64_t quant_task_rows(const QuantWeight& w) {
  const int64_t step = task_rows(w.n);
  return w.r16 ? (step + 15) / 16 * 16 : step;
}

void set_quant_activations(int mode) {
  g_activations.store(mode < 0 ? default_activations()
                               : mode == ACTIVATIONS_EXACT || mode == ACTIVATIONS_INT16 ? mode : ACTIVATIONS_INT8);
}

int read_quant_weight(void** params, int* ndims, int64_t** shapes, const char** dtypes, int i, bool offset,
                      QuantWeight* w) {
  if (!is_weight_dtype(dtypes[i]) || std::strcmp(dtypes[i + 1], "float32") ||
      (offset && std::strcmp(dtypes[i + 2], "float32")))
    return 2;
  if (ndims[i] != 2 || ndims[i + 1] != 2 || (offset && ndims[i + 2] != 2)) return 3;
  w->int4 = !std::strcmp(dtypes[i], "uint8");
  w->n = shapes[i][0];
  w->k = w->int4 ? 2 * shapes[i][1] : shapes[i][1];
  const int64_t groups = shapes[i + 1][0];
  if (groups < 1 || shapes[i + 1][1] != w->n || w->k % groups) return 4;
  if (offset && (shapes[i + 2][0] != groups || shapes[i + 2][1] != w->n)) return 4;
  w->group = w->k / groups;
  w->r16 = g_r16_calls > 0;  // an R16 op's int4 and int8 weights are banded (the runtime made them so)
  if (w->r16 && w->k % QBLOCK) return 4;
  w->q = params[i];
  w->scale = static_cast<const float*>(params[i + 1]);
  w->offset = offset ? static_cast<const float*>(params[i + 2]) : nullptr;
  w->x = nullptr;
  return 0;
}

void prepare_each(const float* x, int64_t rows, QuantWeight* ws, int n, PreparedX* px) {
  for (int i = 0; i < n; ++i) {
    int same = 0;  // the first weight before this one with its layout (px[j] prepared only for such firsts)
    while (same < i && !(px[same].x != nullptr && px[same].k == ws[i].k && px[same].group == ws[i].group &&
                         px[same].int4 == ws[i].int4 && px[same].int8w == takes_int8w(ws[i]) &&
                         px[same].tiles == int4_tiles_take(ws[i], rows) &&
                         (px[same].sums || ws[i].offset == nullptr)))
      ++same;
    if (same == i) prepare(x, rows, ws[i], &px[i]);
    ws[i].x = &px[same];
  }
}

// One row of x rounded per block of 32 (prepare's loop, not exact): q (int16, at prepare's layout: int4 the even inputs
// then the odd ones), bs[blk] the block's scale, t[blk] the sum of its integers. Returns false where this build has no
// vector form (prepare's scalar loop then runs). The same operations per input as that loop (IEEE float32, one
// division per block), so the same integers and scales; 8 inputs a vector. prepare ran scalar and on the caller's
// thread alone: at 9 rows (a verify of 8) 35 % of an 896 x 896 matmul's call.
#ifdef MSLLM_X86
MSLLM_AVX2 void round_row_avx2(const float* xr, int64_t k, float top_q, bool int4, int16_t* q, float* bs, int64_t* t) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY), magic = _mm256_set1_ps(12582912.f);
  const int64_t half = k / 2;
  for (int64_t blk = 0; blk < k / QBLOCK; ++blk) {
    const float* xp = xr + blk * QBLOCK;
    __m256 v[4], top = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xp + 8 * j);
      top = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), top);  // a NaN input leaves top (std::max(top, NaN) = top)
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float tp = _mm_cvtss_f32(m4), inv = tp > 0.f ? top_q / tp : 0.f;
    bs[blk] = tp / top_q;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i sum = _mm256_setzero_si256();
    alignas(32) int32_t ints[QBLOCK];
    for (int j = 0; j < 4; ++j) {
      __m256 a = _mm256_mul_ps(v[j], iv);
      a = _mm256_and_ps(a, _mm256_cmp_ps(_mm256_andnot_ps(sign, a), inf, _CMP_LT_OQ));  // not finite: 0
      const __m256i n = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(a, magic), magic));
      sum = _mm256_add_epi32(sum, n);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * j), n);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    t[blk] = _mm_cvtsi128_si32(s4);
    if (int4) {
      for (int i = 0; i < QBLOCK; i += 2) {
        q[blk * (QBLOCK / 2) + i / 2] = int16_t(ints[i]);
        q[half + blk * (QBLOCK / 2) + i / 2] = int16_t(ints[i + 1]);
      }
    } else {
      for (int j = 0; j < 2; ++j) {
        const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(ints + 16 * j));
        const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(ints + 16 * j + 8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + blk * QBLOCK + 16 * j),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
      }
    }
  }
}
#endif

bool round_row(const float* xr, int64_t k, float top_q, bool int4, int16_t* q, float* bs, int64_t* t) {
#ifdef MSLLM_X86
  if (isa() == ISA_AVX2 || isa() == ISA_AVX512) {
    round_row_avx2(xr, k, top_q, int4, q, bs, t);
    return true;
  }
#endif
  (void)xr, (void)k, (void)top_q, (void)int4, (void)q, (void)bs, (void)t;
  return false;
}

void prepare(const float* x, int64_t rows, const QuantWeight& w, PreparedX* out) {
  out->x = x, out->rows = rows, out->k = w.k, out->group = w.group, out->int4 = w.int4;
  out->int16 = int16_fits(w);
  out->exact = quant_activations() == ACTIVATIONS_EXACT;
  out->int8 = out->int16 && quant_activations() == ACTIVATIONS_INT8 && int4_x8_fits(w);
  out->int8w = takes_int8w(w);
  out->sums = w.offset != nullptr;
  if (!out->int16) return;
  const int64_t k = w.k, blocks = k / QBLOCK, groups = k / w.group, half = k / 2;
  const bool exact = out->exact;
  const float top_q = out->int8 || out->int8w ? 127.f : 32767.f;  // the largest integer of x's blocks
  out->tiles = int4_tiles_take(w, rows);  // (which implies out->int8)
  // what the tiles read (int8 bands' xb, int4 bands' xa, and the scales) past QUANT_ROWS_MAX rows: whole tiles of 16
  // (qbands_rows_amx), the rows past x zeros
  const int64_t padded = rows > QUANT_ROWS_MAX && (out->int8w || out->tiles)
                             ? (rows + QUANT_ROWS_MAX - 1) / QUANT_ROWS_MAX * QUANT_ROWS_MAX
                             : rows;
  out->xq.resize(size_t(rows * (exact ? 2 : 1) * k));
  out->scales.resize(size_t(padded * (blocks + 2 * groups)));
  if (out->int8) out->xb.resize(size_t(rows * 2 * k)), out->xs.resize(size_t(rows * (k / 4)));
  if (out->tiles) out->xa.assign(size_t(padded * k), 0);
  if (out->int8w) out->xb.resize(size_t(padded * k)), out->xs.resize(size_t(rows * (k / 4)));
  std::vector<int64_t> sums(static_cast<size_t>(blocks));  // each block's sum of its integers (where round_row runs)
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * k;
    int16_t* q = out->xq.data() + m * (exact ? 2 : 1) * k;
    int16_t* low = q + k;  // exact only
    float* bs = out->scales.data() + m * (blocks + 2 * groups);
    const bool vector = !exact && round_row(xr, k, top_q, w.int4, q, bs, sums.data());
    for (int64_t blk = 0; blk < blocks && !vector; ++blk) {
      float top = 0.f;
      for (int64_t i = blk * QBLOCK; i < (blk + 1) * QBLOCK; ++i) top = std::max(top, std::fabs(xr[i]));
      const float inv = top > 0.f ? top_q / top : 0.f;
      bs[blk] = top / top_q;
      for (int64_t i = blk * QBLOCK; i < (blk + 1) * QBLOCK; ++i) {
        // to nearest, ties to even (|x * inv| <= 32767 < 2^22: adding 1.5 * 2^23 leaves the integer in the low bits;
        // no libm call, so the loop vectorizes). A NaN or an infinity in x gives 0 here, and NaN in the sums below.
        const float v = std::isfinite(xr[i] * inv) ? xr[i] * inv : 0.f;
        const float high = (v + 12582912.f) - 12582912.f;
        const int64_t at = w.int4 ? (i & 1) * half + i / 2 : i;
        q[at] = int16_t(int32_t(high));
        if (exact) {  // what the high part left, |v - high| <= 1/2 (exact in float32), in steps of LOW_STEP
          const float rest = (v - high) * (1.f / LOW_STEP);
          low[at] = int16_t(int32_t((rest + 12582912.f) - 12582912.f));
        }
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      double sum = 0.0, rounded = 0.0;
      if (out->sums) {  // x's own sum over the group: only the offsets' term reads it (a serial chain of k adds)
        double part[4] = {0.0, 0.0, 0.0, 0.0};
        int64_t i = g * w.group;
        for (; i + 4 <= (g + 1) * w.group; i += 4)
          for (int j = 0; j < 4; ++j) part[j] += xr[i + j];
        for (; i < (g + 1) * w.group; ++i) part[0] += xr[i];
        sum = (part[0] + part[1]) + (part[2] + part[3]);
      }
      for (int64_t blk = g * w.group / QBLOCK; blk < (g + 1) * w.group / QBLOCK; ++blk) {
        int64_t t = vector ? sums[blk] : 0, tl = 0;
        for (int64_t i = blk * QBLOCK; i < (blk + 1) * QBLOCK && !vector; ++i) {
          t += q[w.int4 ? (i & 1) * half + i / 2 : i];
          if (exact) tl += low[w.int4 ? (i & 1) * half + i / 2 : i];
        }
        rounded += double(bs[blk]) * (double(t) + double(tl) * double(LOW_STEP));
      }
      bs[blocks + g] = float(sum);
      bs[blocks + groups + g] = float(rounded);
    }
    if (out->tiles) {  // AMX's A: per block its 16 even inputs, then its 16 odd ones
      int8_t* xa = out->xa.data() + m * k;
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int64_t j = 0; j < QBLOCK / 2; ++j) {
          xa[blk * QBLOCK + j] = int8_t(q[blk * (QBLOCK / 2) + j]);
          xa[blk * QBLOCK + QBLOCK / 2 + j] = int8_t(q[half + blk * (QBLOCK / 2) + j]);
        }
    }
    if (out->int8) {  // the x86 forms' copy (PreparedX xb, xs)
      int8_t* xb = out->xb.data() + m * 2 * k;
      float* xs = out->xs.data() + m * (k / 4);
      for (int64_t s = 0; s < k / QSTEP; ++s) {
        for (int64_t j = 0; j < QSTEP / 2; ++j) {
          const int8_t even = int8_t(q[s * (QSTEP / 2) + j]), odd = int8_t(q[half + s * (QSTEP / 2) + j]);
          xb[s * 128 + j] = xb[s * 128 + 32 + j] = even;
          xb[s * 128 + 64 + j] = xb[s * 128 + 96 + j] = odd;
        }
        for (int l = 0; l < 16; ++l) xs[s * 16 + l] = bs[2 * s + ((l / 4) & 1)];
      }
    }
    if (out->int8w) {  // qtile8w_vnni's: the integers in input order, each step's two block scales over 8 lanes each
      int8_t* xb = out->xb.data() + m * k;
      float* xs = out->xs.data() + m * (k / 4);
      for (int64_t i = 0; i < k; ++i) xb[i] = int8_t(q[i]);
      for (int64_t s = 0; s < k / QSTEP; ++s)
        for (int l = 0; l < 16; ++l) xs[s * 16 + l] = bs[2 * s + l / 8];
    }
  }
}

RowsFn quant_rows_kernel() { return g_kernels.rows; }

void dequantize_rows(const QuantWeight& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, float* dst, int64_t ld) {
  alignas(64) int8_t qbuf[KC];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    for (int64_t i = 0; i < kc; i += KC) {  // int4: unpacked KC inputs at a time
      const int64_t len = std::min(KC, kc - i);
      const int8_t* src = w.int4 ? nullptr : int8_row(w.q, w.r16, w.n, w.k, n, k0 + i, len, qbuf);
      if (w.int4) {
        alignas(64) uint8_t packed[KC / 2];
        unpack_int4(int4_row_bytes(w.q, w.r16, w.n, w.k, n, (k0 + i) / 2, len / 2, packed), len / 2, qbuf);
        src = qbuf;
      }
      g_kernels.dequant(src, k0 + i, len, w.group, w.scale + n, w.offset ? w.offset + n : nullptr, w.n,
                        dst + r * ld + i);
    }
  }
}

void quant_matmul(const float* x, int64_t rows, const QuantWeight& w, const float* b, float* y) {
  if (rows <= 0 || w.n <= 0) return;
  if (w.k <= 0) {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t o = 0; o < w.n; ++o) y[m * w.n + o] = b ? b[o] : 0.f;
    return;
  }
  if (quant_rows_take(w, rows)) {
    PreparedX px;
    QuantWeight wx = w;
    prepare_each(x, rows, &wx, 1, &px);
    RowsJob job;
    job.w = &wx, job.rows = rows, job.b = b, job.y = y, job.step = quant_task_rows(w);
    const bool parallel = w.n >= MIN_PARALLEL_ROWS;
    job.shares.split((w.n + job.step - 1) / job.step, parallel ? threads_to_use() : 1);
    run(&job, parallel);
    return;
  }
  Problem p;
  p.x = x, p.m = rows, p.k = w.k, p.n = w.n, p.q = w.q, p.int4 = w.int4, p.r16 = w.r16, p.scale = w.scale;
  p.offset = w.offset, p.group = w.group, p.round = F32, p.y = y;
  quant_gemm(p);
  if (b != nullptr)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t o = 0; o < w.n; ++o) y[m * w.n + o] += b[o];
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
