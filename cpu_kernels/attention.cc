// mslite-llm CPU kernels: the attention over the paged KV cache (the op body decode_attention; registry.cc exports it
// as MsliteLlmDecodeAttention), its softmax and weighted sum of values in plain C++, AVX2 and AVX-512 side by side.
// The scores are the float32 rows kernel of matmul16.cc, a block of the cache at a time (paged.h: a kv head's
// positions of a block are one [BS, D] matrix), read in place: no copy of a sequence's context. A bfloat16 cache's
// block is widened (exactly) into a float32 buffer of its own, in L1, before the same kernels read it: the attention
// over a bfloat16 cache computes what it computes over a float32 cache that holds the same (rounded) values, bit for
// bit, and reads half the bytes from memory.
#include <algorithm>

#include "matmul16.h"
#include "ops.h"
#include "paged.h"
#include "pool.h"

namespace msllm {
namespace {

constexpr int64_t ATTENTION_BLOCK = 8;  // attention: consecutive queries of one cache row per task
                                        // (docs/architecture.md, "cpu_kernels/")
constexpr int64_t ATTENTION_CHUNK = 512;  // positions a task of one query reads at most (rounded down to the cache's
                                          // block size, at least one block): AttentionJob::split
constexpr int64_t SPLIT_QUERIES = 64;  // a call of at most this many queries splits its blocks of several queries too
                                       // (a step of 16 and a verify of 9; not a prompt): AttentionJob::split

// ---- attention over the KV cache ----------------------------------------------------------------------------
// Each task is a block of consecutive queries that read the same cache row (a prompt's tokens in the prefill and
// chunk graphs; one query per row in the decode step) and one kv head: the G query heads of that kv head for every
// query of the block are one matrix of rows, so each key and value row is read once per task, not once per query
// head and token. Scores are the rows form of the GEMV kernels (K rows as the weight rows), then per query its
// softmax over its own valid positions (the exp in intrinsics on x86) and the weighted sum of the value rows, in
// plain loops the compiler vectorizes for each path (attend_rows_body is compiled once per target).

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial (common.h EXP_POLY) after 2^n range
// reduction; relative error ~2e-7. At or below EXP_LOW it gives 0. The scalar form, and the 8- and 16-lane ones below
// with the same constants (GCC does not vectorize the scalar form's float selects).
constexpr float EXP_LOW = -87.0f;

__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  x = x < EXP_LOW ? EXP_LOW : x;
  const float fx = x * EXP_LOG2E + 0.5f;
  int32_t n = int32_t(fx);
  n -= (float(n) > fx);  // floor
  const float fn = float(n);
  float r = x - fn * EXP_LN2_HI;
  r -= fn * EXP_LN2_LO;
  float p = EXP_POLY[0];
  for (int i = 1; i < 6; ++i) p = p * r + EXP_POLY[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= EXP_LOW ? 0.f : p * scale;
}

// A row's softmax in two calls, one form per path (all of a path's rows alike: a query's weights are the same
// whichever rows share its task): max_* the largest of s[0, n) (exact in any order), exp_sum_* s[p] = exp(s[p] *
// scale - best) in place and their sum, kept in 8 lanes (lane j adds s[j], s[j + 8], ... up to the last whole 8),
// then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then the last n % 8 in order.
__attribute__((always_inline)) inline float lanes_total(const float* lanes, const float* s, int64_t p, int64_t n) {
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; p < n; ++p) total += s[p];
  return total;
}

// the plain loops (generic, NEON)
__attribute__((always_inline)) inline float max_generic(const float* s, int64_t n) {
  float lanes[8];
  for (int j = 0; j < 8; ++j) lanes[j] = -INFINITY;
  int64_t p = 0;
  for (; p + 8 <= n; p += 8)
    for (int j = 0; j < 8; ++j) lanes[j] = lanes[j] > s[p + j] ? lanes[j] : s[p + j];
  float best = -INFINITY;
  for (int j = 0; j < 8; ++j) best = std::max(best, lanes[j]);
  for (; p < n; ++p) best = std::max(best, s[p]);
  return best;
}

__attribute__((always_inline)) inline float exp_sum_generic(float* s, int64_t n, float scale, float best) {
  for (int64_t p = 0; p < n; ++p) s[p] = exp_nonpositive(s[p] * scale - best);
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t p = 0;
  for (; p + 8 <= n; p += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += s[p + j];
  return lanes_total(lanes, s, p, n);
}

#ifdef MSLLM_X86
MSLLM_AVX2 inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 low = _mm256_set1_ps(EXP_LOW);
  x = _mm256_max_ps(x, low);
  const __m256 fn = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(EXP_LN2_HI), x);
  r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(EXP_LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fn), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, low, _CMP_LE_OQ), y);
}

MSLLM_AVX2 inline float max_avx2(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + p));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = -INFINITY;
  for (int j = 0; j < 8; ++j) best = std::max(best, lanes[j]);
  for (; p < n; ++p) best = std::max(best, s[p]);
  return best;
}

// the exps 8 at a time (the last n % 8 in the scalar form), each 8 added to the lanes as it is made
MSLLM_AVX2 inline float exp_sum_avx2(float* s, int64_t n, float scale, float best) {
  const __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(best);
  __m256 acc = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) {
    const __m256 e = exp_nonpositive8(_mm256_fmsub_ps(_mm256_loadu_ps(s + p), vs, vb));
    _mm256_storeu_ps(s + p, e);
    acc = _mm256_add_ps(acc, e);
  }
  for (int64_t t = p; t < n; ++t) s[t] = exp_nonpositive(s[t] * scale - best);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  return lanes_total(lanes, s, p, n);
}

MSLLM_AVX512 inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 low = _mm512_set1_ps(EXP_LOW);
  x = _mm512_max_ps(x, low);
  const __m512 fn = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(EXP_LN2_HI), x);
  r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(EXP_LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fn), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GT_OQ), y);
}

MSLLM_AVX512 inline float max_avx512(const float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 16 <= n; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + p));
  float best = _mm512_reduce_max_ps(m);
  for (; p < n; ++p) best = std::max(best, s[p]);
  return best;
}

// the exps 16 at a time (the last n % 16 in the scalar form), each 16 added to the 8 lanes as two 8s in order
MSLLM_AVX512 inline float exp_sum_avx512(float* s, int64_t n, float scale, float best) {
  const __m512 vs = _mm512_set1_ps(scale), vb = _mm512_set1_ps(best);
  __m256 acc = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 16 <= n; p += 16) {
    const __m512 e = exp_nonpositive16(_mm512_fmsub_ps(_mm512_loadu_ps(s + p), vs, vb));
    _mm512_storeu_ps(s + p, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  for (int64_t t = p; t < n; ++t) s[t] = exp_nonpositive(s[t] * scale - best);
  if (p + 8 <= n) acc = _mm256_add_ps(acc, _mm256_loadu_ps(s + p)), p += 8;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  return lanes_total(lanes, s, p, n);
}
#endif

// The softmax and the weighted sum of values of a task's query rows: scores [rows, ld] (row r's first lengths[r]
// valid) -> out[r] [d] = softmax(scores_r * scale) . V, the value rows in blocks of bs positions (vblocks[j]: block
// j's [bs, d] rows). Each row's maximum (max_*) and its exps and their sum in 8 lanes (exp_sum_*, one pass) in the
// path's form; then the value rows are read a block at a time (in L1) for every query row, each row's sum of exps x
// values in blocks of PV_BLOCK values over two positions at a time, in vector registers; last, each row times
// 1 / its sum. The very arithmetic of a chunked row's merge when it has one chunk (AttentionJob::merge: weight
// exp(0) = 1), so a query's output is the same bit for bit whether its block was split or not.
constexpr int64_t PV_BLOCK = 32;

// The start of the next block's rows into the cache while this one is read: a block (BS positions of one kv head,
// 16 KB at BS 64 and d 64 in float32) is a short run in memory, and the hardware prefetchers stop at each 4 KB page,
// so a long context's blocks were read at the pace of memory's latency. Two lines at the start of each of the block's
// pages set the prefetchers going again (prefetching every line measured slower where GQA groups are wide,
// Qwen2-0.5B's 7 query heads a kv head): docs/performance-log.md 48.
inline void prefetch_pages(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 4096) {
    __builtin_prefetch(c + off, 0, 3);
    __builtin_prefetch(c + off + 64, 0, 3);
  }
}

#ifdef MSLLM_X86
// 8 keys' accumulators of a pair of rows (acc[c]: row a's 8 lanes, then row b's, for key c) -> row a's 8 scores,
// then row b's: hsum's tree over each one's lanes, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), 16 scores at a
// time (7 adds and 8 shuffles between the accumulators, then one permute, where hsum took 3 of each a score), + 0
MSLLM_AVX512 inline __m512 reduce_keys8(const __m512* acc) {
  __m512 h[4];  // h[j]: l_k + l_(k+4) of keys 2j, 2j+1: [2j's a, 2j's b, 2j+1's a, 2j+1's b], 4 lanes each
  for (int j = 0; j < 4; ++j)
    h[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * j], acc[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(acc[2 * j], acc[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 g[2];  // (l0 + l4) + (l2 + l6) and (l1 + l5) + (l3 + l7), side by side, of h[2i]'s and h[2i + 1]'s scores
  for (int i = 0; i < 2; ++i)
    g[i] = _mm512_add_ps(_mm512_shuffle_ps(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // 128-bit lane 0: keys 0, 2, 4, 6 of row a; 1: of row b; 2: keys 1, 3, 5, 7 of row a; 3: of row b
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_add_ps(_mm512_permutexvar_ps(order, f), _mm512_setzero_ps());
}

// Scores of several query rows against key rows [o0, o1) of a block (d a multiple of 8): each score the float32
// rows kernel's for two rows and more on the AVX-512 path (rows_avx2's tiles: 8-lane sums over d, 8 inputs a step,
// then hsum; + 0, its absent bias), so a query's scores are the same whichever kernel computed them; two query rows
// share a register (one in each half) against each key's 8 inputs broadcast to both halves: 16-lane multiply-adds,
// 2 pairs of rows by 8 keys a tile, whose 16 scores a pair hsum's tree gives all at once (reduce_keys8: 15 shuffles
// and 8 adds where 16 hsums took 56 and 48; a 64-token piece's attention after 1024 positions 1.25x, performance-log
// 51). The AVX2 tiles were a third of that piece's time (SmolLM2).
template <int RP, int C>
MSLLM_AVX512 inline void score_tile512(const float* const* xr, const float* k, int64_t d, float* const* yr,
                                       int64_t o) {
  __m512 acc[RP][C];
  for (int p = 0; p < RP; ++p)
    for (int c = 0; c < C; ++c) acc[p][c] = _mm512_setzero_ps();
  const float* ko = k + o * d;
  for (int64_t i = 0; i < d; i += 8) {
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
        _mm256_loadu_ps(ko + c * d + i))));
    for (int p = 0; p < RP; ++p) {
      const __m512 xv = _mm512_castpd_ps(_mm512_insertf64x4(
          _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(xr[2 * p] + i))),
          _mm256_castps_pd(_mm256_loadu_ps(xr[2 * p + 1] + i)), 1));
      for (int c = 0; c < C; ++c) acc[p][c] = _mm512_fmadd_ps(kv[c], xv, acc[p][c]);
    }
  }
  if (C == 8) {  // each pair's 8 keys reduced together (the same tree as hsum's, below)
    for (int p = 0; p < RP; ++p) {
      const __m512 s = reduce_keys8(acc[p]);
      _mm256_storeu_ps(yr[2 * p] + o, _mm512_castps512_ps256(s));
      _mm256_storeu_ps(yr[2 * p + 1] + o, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    }
    return;
  }
  for (int p = 0; p < RP; ++p)
    for (int c = 0; c < C; ++c) {
      const __m256 lo = _mm512_castps512_ps256(acc[p][c]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][c]), 1));
      yr[2 * p][o + c] = hsum(lo) + 0.f;
      yr[2 * p + 1][o + c] = hsum(hi) + 0.f;
    }
}

template <int RP>
MSLLM_AVX512 inline void score_rows512(const float* const* xr, const float* k, int64_t d, float* const* yr,
                                       int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + 8 <= o1; o += 8) score_tile512<RP, 8>(xr, k, d, yr, o);
  for (; o + 4 <= o1; o += 4) score_tile512<RP, 4>(xr, k, d, yr, o);
  for (; o < o1; ++o) score_tile512<RP, 1>(xr, k, d, yr, o);
}

// the rows kernel's signature (RowsFn): x [rows, d], the block's key rows as the weights, y [rows, ldy]
MSLLM_AVX512 void scores_avx512(const float* x, int64_t rows, const void* kv, const float*, int64_t d, float* y,
                                int64_t ldy, int64_t o0, int64_t o1) {
  const float* k = static_cast<const float*>(kv);
  const float* xr[8];
  float* yr[8];
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    for (int j = 0; j < 4; ++j) xr[j] = x + (r + j) * d, yr[j] = y + (r + j) * ldy;
    score_rows512<2>(xr, k, d, yr, o0, o1);
  }
  for (; r < rows; r += 2) {  // pairs; an odd last row paired with itself (both halves its own, written once)
    const int64_t r1 = std::min(r + 1, rows - 1);
    xr[0] = x + r * d, xr[1] = x + r1 * d, yr[0] = y + r * ldy, yr[1] = y + r1 * ldy;
    score_rows512<1>(xr, k, d, yr, o0, o1);
  }
}
#endif

// the scores' kernel for `rows` query rows: the float32 rows kernel, or its paired AVX-512 form where it computes
// the same (two rows and more on the AVX-512 path, d a multiple of 8)
RowsFn scores_kernel(int64_t rows, int64_t d) {
#ifdef MSLLM_X86
  if (rows >= 2 && d % 8 == 0 && isa() == ISA_AVX512) return scores_avx512;
#endif
  (void)rows, (void)d;
  return rows_kernel(W_F32);
}

// vblocks[j]: block j's value rows, float32, or bfloat16 where `widen` is given (each block's rows widened into vbuf,
// [bs, d] float32, before they are read)
typedef void (*AttendRowsFn)(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
                             const void* const* vblocks, WidenFn widen, float* vbuf, int64_t bs, int64_t d,
                             float* const* out, float* stats);

// Rows [0, RG) of the weighted sum over the value rows of one block (positions [p0, p0 + bs) clipped to each row's
// length), out[g] += sum_p w[g][p] v[p]: per row and block of PV_BLOCK values, its even positions of each pair into
// acc0, the odd into acc1, a last single one into acc0, out = acc0 + acc1; the values past the last whole block (a
// head size not a multiple of it) one at a time over the positions in order. A row's arithmetic is the same whatever
// RG (RG = 1: one row at a time), so its output does not depend on the rows sharing its task (a step's, a verify's, a
// prompt's); RG > 1 rows share each value row's loads over the pairs of positions all of them read (one at a time,
// each multiply-add waited on its own load).
template <int RG>
__attribute__((always_inline)) inline void pv_rows(const float* scores, int64_t ld, const int64_t* lengths,
                                                   const float* v, int64_t p0, int64_t bs, int64_t d,
                                                   float* const* out) {
  int64_t p1[RG], common = p0 + bs;
  for (int g = 0; g < RG; ++g) p1[g] = std::min(lengths[g], p0 + bs), common = std::min(common, p1[g]);
  const int64_t pc = common > p0 ? p0 + ((common - p0) & ~int64_t(1)) : p0;  // whole pairs every row reads
  int64_t i0 = 0;
  for (; i0 + PV_BLOCK <= d; i0 += PV_BLOCK) {
    float acc0[RG][PV_BLOCK], acc1[RG][PV_BLOCK];
    for (int g = 0; g < RG; ++g)
      for (int i = 0; i < PV_BLOCK; ++i) acc0[g][i] = out[g][i0 + i], acc1[g][i] = 0.f;
    const float* vp = v + p0 * d + i0;
    for (int64_t p = p0; p < pc; p += 2, vp += 2 * d)
      for (int g = 0; g < RG; ++g) {
        const float w0 = scores[g * ld + p], w1 = scores[g * ld + p + 1];
        for (int i = 0; i < PV_BLOCK; ++i) acc0[g][i] += w0 * vp[i];
        for (int i = 0; i < PV_BLOCK; ++i) acc1[g][i] += w1 * vp[d + i];
      }
    for (int g = 0; g < RG; ++g) {
      if (p1[g] <= p0) continue;  // no position of this block: out as it was
      const float* w = scores + g * ld;
      const float* vq = v + pc * d + i0;
      int64_t p = pc;
      for (; p + 2 <= p1[g]; p += 2, vq += 2 * d) {
        const float w0 = w[p], w1 = w[p + 1];
        for (int i = 0; i < PV_BLOCK; ++i) acc0[g][i] += w0 * vq[i];
        for (int i = 0; i < PV_BLOCK; ++i) acc1[g][i] += w1 * vq[d + i];
      }
      if (p < p1[g])
        for (int i = 0; i < PV_BLOCK; ++i) acc0[g][i] += w[p] * vq[i];
      for (int i = 0; i < PV_BLOCK; ++i) out[g][i0 + i] = acc0[g][i] + acc1[g][i];
    }
  }
  for (int g = 0; g < RG; ++g)
    for (int64_t i = i0; i < d; ++i) {  // a head size not a multiple of the block
      float acc = out[g][i];
      for (int64_t p = p0; p < p1[g]; ++p) acc += scores[g * ld + p] * v[p * d + i];
      out[g][i] = acc;
    }
}

template <float (*MaxOf)(const float*, int64_t), float (*ExpSum)(float*, int64_t, float, float), int RG = 1>
__attribute__((always_inline)) inline void attend_rows_body(float* scores, int64_t rows, int64_t ld,
                                                            const int64_t* lengths, float scale,
                                                            const void* const* vblocks, WidenFn widen, float* vbuf,
                                                            int64_t bs, int64_t d, float* const* out, float* stats) {
  thread_local std::vector<float> totals_buf;  // each row's sum of exps (common.h Scratch)
  Scratch<float> keep_totals(totals_buf);
  float* const totals = keep_totals.get(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    const int64_t n = lengths[r];
    const float best = MaxOf(s, n);
    const float total = ExpSum(s, n, scale, best * scale);
    if (stats != nullptr) stats[2 * r] = best * scale;
    totals[r] = total;
    for (int64_t i = 0; i < d; ++i) out[r][i] = 0.f;
  }
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, lengths[r]);
  const int64_t elem = widen != nullptr ? 2 : 4;
  for (int64_t p0 = 0; p0 < longest; p0 += bs) {
    const float* v = static_cast<const float*>(vblocks[p0 / bs]);
    if (widen != nullptr) {  // the block's rows this task reads, widened
      widen(vblocks[p0 / bs], std::min(bs, longest - p0) * d, vbuf);
      v = vbuf;
    }
    v -= p0 * d;  // so that v + p * d is position p's row, p in this block
    if (p0 + bs < longest) prefetch_pages(vblocks[p0 / bs + 1], std::min(bs, longest - p0 - bs) * d * elem);
    int64_t r = 0;
    for (; r + RG <= rows; r += RG) pv_rows<RG>(scores + r * ld, ld, lengths + r, v, p0, bs, d, out + r);
    for (; r < rows; ++r) pv_rows<1>(scores + r * ld, ld, lengths + r, v, p0, bs, d, out + r);
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (stats != nullptr) {  // a chunk of a split block: its sums and their total, for the merge
      stats[2 * r + 1] = totals[r];
      continue;
    }
    const float norm = totals[r] > 0.f ? 1.f / totals[r] : 0.f;
    for (int64_t i = 0; i < d; ++i) out[r][i] *= norm;
  }
}

void attend_rows_generic(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
                         const void* const* vblocks, WidenFn widen, float* vbuf, int64_t bs, int64_t d,
                         float* const* out, float* stats) {
  attend_rows_body<max_generic, exp_sum_generic>(scores, rows, ld, lengths, scale, vblocks, widen, vbuf, bs, d, out,
                                                 stats);
}
#ifdef MSLLM_X86
MSLLM_AVX2 void attend_rows_avx2(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
    const void* const* vblocks, WidenFn widen, float* vbuf, int64_t bs, int64_t d, float* const* out, float* stats) {
  attend_rows_body<max_avx2, exp_sum_avx2>(scores, rows, ld, lengths, scale, vblocks, widen, vbuf, bs, d, out, stats);
}
MSLLM_AVX512 void attend_rows_avx512(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
    const void* const* vblocks, WidenFn widen, float* vbuf, int64_t bs, int64_t d, float* const* out, float* stats) {
  attend_rows_body<max_avx512, exp_sum_avx512, 4>(scores, rows, ld, lengths, scale, vblocks, widen, vbuf, bs, d, out,
                                                  stats);
}
#endif

// the attend rows of this machine's code path (NEON too runs the plain loops, compiled for it)
AttendRowsFn pick_attend_rows() {
  switch (isa()) {
#ifdef MSLLM_X86
    case ISA_AVX512:
      return attend_rows_avx512;
    case ISA_AVX2:
      return attend_rows_avx2;
#endif
    default:
      return attend_rows_generic;
  }
}

const AttendRowsFn g_attend_rows = pick_attend_rows();

// Queries against the paged KV cache: q [N, H*D]; K, V caches [NB, KH, BS, D] (float32 or bfloat16); lengths [N]
// int32 (query i reads positions 0 .. lengths[i]-1, itself included, as the graph's writes left them); rows [N] int32,
// tables [R, M] int32: query i's sequence has the block table tables[rows[i]] (position p in block
// tables[rows[i]][p / BS]) -> out [N, H*D]. Query head h reads key/value head h / (H / KH) (HF repeat_kv). Reads only
// the blocks under each query's length, in place, where the MindSpore form gathers every row's blocks and masks.
struct AttentionJob : Job {
  const float* q;
  const void *k, *v;  // the caches (cache.bf16: bfloat16, else float32)
  const int32_t *lengths, *rows, *tables;
  int64_t batch, heads, max_blocks;
  PagedCache cache;
  float* out;
  std::vector<int64_t> blocks;  // first query of each block of queries, then `batch`
  // A block of one query (a decode step's row) that reads more than `chunk` positions is split along them: a task
  // per kv head and chunk, whose unnormalised sums and softmax statistics (part, stats) the merge combines. Why: one
  // query's kv heads are few (3 in SmolLM2, 2 in Qwen2-0.5B), so a decode step's long context was 2 or 3 tasks for
  // the threads, and one task's pass over a long context one stream at memory's latency (docs/performance-log.md
  // 48). So are the blocks of a call of at most SPLIT_QUERIES queries (a verify's, a chunk call's small piece): a
  // query's chunks are then the same whether it is a step's row or among a verify's, and so its output, bit for bit
  // (attend_rows_body ends as the merge does), which speculative decoding's greedy tokens rest on. Not a long
  // prompt's thousands of blocks: they would keep partial sums of every query. A step's query runs the same arithmetic
  // whatever the thread count or the other sequences of its step.
  int64_t chunk = 0;
  std::vector<int64_t> chunks, first_task, first_part;  // per block: its chunks (1: not split), tasks, partial rows
  std::vector<float> part, stats;  // per split task: its rows' sums [rows, d]; their max * scale and sum of weights
  Shares shares;  // each thread a contiguous share of the tasks (a kv head's chunks in order: one stream), pool.h

  int64_t length_of(int64_t b) const { return std::max<int64_t>(0, lengths[b]); }
  int64_t tasks() const { return first_task.back(); }

  // blocks of at most `most` consecutive queries of one sequence; a block of one query (any block, in a call of at most
  // SPLIT_QUERIES queries) in chunks of `chunk` positions (a multiple of the cache's block size) where it reads more
  void split(int64_t most) {
    blocks.clear();
    for (int64_t b = 0; b < batch; ++b)
      if (blocks.empty() || b - blocks.back() >= most || rows[b] != rows[blocks.back()]) blocks.push_back(b);
    blocks.push_back(batch);
    const int64_t nblocks = int64_t(blocks.size()) - 1, group = heads / cache.kv_heads;
    chunks.assign(size_t(nblocks), 1);
    first_task.assign(size_t(nblocks + 1), 0);
    first_part.assign(size_t(nblocks + 1), 0);
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      int64_t longest = 0;
      for (int64_t b = blocks[blk]; b < blocks[blk + 1]; ++b) longest = std::max(longest, length_of(b));
      if (chunk > 0 && longest > chunk && (blocks[blk + 1] - blocks[blk] == 1 || batch <= SPLIT_QUERIES))
        chunks[blk] = (longest + chunk - 1) / chunk;
      first_task[blk + 1] = first_task[blk] + cache.kv_heads * chunks[blk];
      const int64_t split_rows = chunks[blk] > 1 ? cache.kv_heads * chunks[blk] * (blocks[blk + 1] - blocks[blk]) *
                                                       group : 0;
      first_part[blk + 1] = first_part[blk] + split_rows;
    }
    part.resize(size_t(first_part.back() * cache.d));
    stats.resize(size_t(2 * first_part.back()));
  }

  void work() override {
    const int64_t d = cache.d, kv_heads = cache.kv_heads, bs = cache.block_size;
    const float scale = 1.0f / std::sqrt(float(d));
    const int64_t group = heads / kv_heads;
    // per thread, kept between calls (common.h Scratch): a prompt's task's scores reach hundreds of KB (the 0.5B
    // shape's 56 rows by 1088 positions: 244 KB), which malloc maps and unmaps, a page fault per 4 KB each time
    thread_local std::vector<float> qs, scores, kv16;
    thread_local std::vector<int64_t> lens;
    thread_local std::vector<float*> outs;
    thread_local std::vector<const void*> vblocks;
    Scratch<float> keep_qs(qs), keep_scores(scores), keep_kv16(kv16);
    // a bfloat16 cache's block widened (matmul16.h widen_kernel): the keys' [bs, d], then the values' [bs, d]
    const WidenFn widen = cache.bf16 ? widen_kernel(W_BF16) : nullptr;
    float* const widened = cache.bf16 ? keep_kv16.get(2 * bs * d) : nullptr;
    const int64_t elem = cache.elem_bytes();
    shares.claim([&](int64_t t) {
      const int64_t blk = std::upper_bound(first_task.begin(), first_task.end(), t) - first_task.begin() - 1;
      const int64_t local = t - first_task[blk], kvh = local / chunks[blk], c = local % chunks[blk];
      const int64_t b0 = blocks[blk], b1 = blocks[blk + 1], c0 = chunks[blk] > 1 ? c * chunk : 0;
      const int32_t* table = tables + int64_t(rows[b0]) * max_blocks + c0 / bs;
      const int64_t nrows = (b1 - b0) * group;
      float* const split_out = chunks[blk] > 1 ? part.data() + (first_part[blk] + local * nrows) * d : nullptr;
      qs.resize(size_t(nrows * d));
      lens.resize(size_t(nrows));
      outs.resize(size_t(nrows));
      int64_t longest = 0;
      for (int64_t b = b0; b < b1; ++b) {  // the block's query heads of kv head kvh, a row each
        std::memcpy(qs.data() + (b - b0) * group * d, q + (b * heads + kvh * group) * d,
                    size_t(group * d) * sizeof(float));
        int64_t len = length_of(b) - c0;  // this chunk's positions of query b
        len = std::max<int64_t>(0, chunks[blk] > 1 ? std::min(len, chunk) : len);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = (b - b0) * group + g;
          lens[i] = len;
          outs[i] = split_out != nullptr ? split_out + i * d : out + (b * heads + kvh * group + g) * d;
        }
        longest = std::max(longest, len);
      }
      scores.resize(size_t(std::max<int64_t>(nrows * longest, 1)));
      const int64_t used = (longest + bs - 1) / bs;
      vblocks.resize(size_t(std::max<int64_t>(used, 1)));
      const RowsFn scores_of = scores_kernel(nrows, d);
      for (int64_t j = 0; j < used; ++j) {  // each block's scores: its K rows as the weight rows, in place
        const int64_t n = std::min(bs, longest - j * bs);
        if (j + 1 < used)
          prefetch_pages(cache.block(k, table[j + 1], kvh), std::min(bs, longest - (j + 1) * bs) * d * elem);
        const void* keys = cache.block(k, table[j], kvh);
        if (widen != nullptr) widen(keys, n * d, widened), keys = widened;
        scores_of(qs.data(), nrows, keys, nullptr, d, scores.data() + j * bs, longest, 0, n);
        vblocks[j] = cache.block(v, table[j], kvh);
      }
      for (int64_t i = 0; i < nrows && longest == 0; ++i)
        for (int64_t e = 0; e < d; ++e) outs[i][e] = 0.f;
      float* const st = split_out != nullptr ? stats.data() + 2 * (first_part[blk] + local * nrows) : nullptr;
      if (longest == 0 && st != nullptr)
        for (int64_t i = 0; i < nrows; ++i) st[2 * i] = -INFINITY, st[2 * i + 1] = 0.f;
      if (longest > 0)
        g_attend_rows(scores.data(), nrows, longest, lens.data(), scale, vblocks.data(), widen,
                      widened != nullptr ? widened + bs * d : nullptr, bs, d, outs.data(), st);
    });
  }

  // the split blocks' chunks combined: out = sum_c e^(m_c - M) part_c / sum_c e^(m_c - M) l_c, M the largest m_c
  void merge() {
    const int64_t d = cache.d, kv_heads = cache.kv_heads, group = heads / kv_heads;
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t blk = 0; blk + 1 < int64_t(blocks.size()); ++blk) {
      const int64_t nch = chunks[blk];
      if (nch == 1) continue;
      const int64_t b0 = blocks[blk], nrows = (blocks[blk + 1] - b0) * group;
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
        for (int64_t i = 0; i < nrows; ++i) {
          const int64_t base = first_part[blk] + kvh * nch * nrows + i;  // chunk c's row i: base + c * nrows
          float top = -INFINITY;
          for (int64_t c = 0; c < nch; ++c) top = std::max(top, stats[2 * (base + c * nrows)]);
          float* o = out + ((b0 + i / group) * heads + kvh * group + i % group) * d;
          std::fill(acc.begin(), acc.end(), 0.f);
          float total = 0.f;
          if (top > -INFINITY)
            for (int64_t c = 0; c < nch; ++c) {
              const int64_t r = base + c * nrows;
              const float w = stats[2 * r] > -INFINITY ? std::exp(stats[2 * r] - top) : 0.f;
              total += w * stats[2 * r + 1];
              const float* pc = part.data() + r * d;
              for (int64_t e = 0; e < d; ++e) acc[size_t(e)] += w * pc[e];
            }
          const float norm = total > 0.f ? 1.f / total : 0.f;
          for (int64_t e = 0; e < d; ++e) o[e] = acc[size_t(e)] * norm;
        }
    }
  }
};

}  // namespace

// q [N, H*D], the caches K, V [NB, KH, BS, D] (both float32 or both bfloat16), lengths [N], rows [N], tables [R, M]
// (int32) -> out [N, H*D]: query i
// attends to the first lengths[i] positions of the sequence whose block table is tables[rows[i]] (the decode step's
// rows, a prompt's tokens and a chunk's piece alike). A length past the table, a row outside it or a block outside
// the cache: error 4, nothing computed.
int decode_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 7) return 1;
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[6])) return 2;
  for (int k = 3; k < 6; ++k)
    if (std::strcmp(dtypes[k], "int32") != 0) return 2;
  if (ndims[0] != 2 || ndims[1] != 4 || ndims[2] != 4 || ndims[3] != 1 || ndims[4] != 1 || ndims[5] != 2 ||
      ndims[6] != 2)
    return 3;
  PagedCache cache = paged_cache(shapes[1]);
  if (!paged_dtypes(dtypes[1], dtypes[2], &cache)) return 2;
  for (int k = 0; k < 4; ++k)
    if (shapes[2][k] != shapes[1][k]) return 4;
  const int64_t queries = shapes[0][0], table_rows = shapes[5][0], max_blocks = shapes[5][1];
  if (!cache.ok() || shapes[0][1] % (cache.kv_heads * cache.d) || shapes[3][0] != queries ||
      shapes[4][0] != queries || shapes[6][0] != queries || shapes[6][1] != shapes[0][1] || max_blocks <= 0)
    return 4;
  const int32_t* lengths = static_cast<const int32_t*>(params[3]);
  const int32_t* rows = static_cast<const int32_t*>(params[4]);
  const int32_t* tables = static_cast<const int32_t*>(params[5]);
  int64_t longest = 0;
  for (int64_t b = 0; b < queries; ++b) {  // every block a query reads, checked before anything is read
    if (rows[b] < 0 || rows[b] >= table_rows || lengths[b] > max_blocks * cache.block_size) return 4;
    const int32_t* table = tables + int64_t(rows[b]) * max_blocks;
    for (int64_t j = 0; j * cache.block_size < lengths[b]; ++j)
      if (table[j] < 0 || table[j] >= cache.blocks) return 4;
    longest = std::max<int64_t>(longest, lengths[b]);
  }
  AttentionJob job;
  job.q = static_cast<const float*>(params[0]);
  job.k = params[1];
  job.v = params[2];
  job.lengths = lengths, job.rows = rows, job.tables = tables;
  job.batch = queries, job.heads = shapes[0][1] / cache.d, job.max_blocks = max_blocks, job.cache = cache;
  job.out = static_cast<float*>(params[6]);
  job.chunk = std::max<int64_t>(1, ATTENTION_CHUNK / cache.block_size) * cache.block_size;
  job.split(ATTENTION_BLOCK);
  const bool parallel = queries * job.heads * longest * cache.d >= (int64_t(1) << 16);
  job.shares.split(job.tasks(), parallel ? threads_to_use() : 1);
  run(&job, parallel);
  job.merge();
  return 0;
}

}  // namespace msllm
