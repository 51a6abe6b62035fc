// mslite-llm CPU kernels: the attention over the paged KV cache (the op body decode_attention; registry.cc exports it
// as MsliteLlmDecodeAttention), its softmax and weighted sum of values in plain C++, AVX2 and AVX-512 side by side.
// The scores are the float32 rows kernel of matmul16.cc, a block of the cache at a time (paged.h: a kv head's
// positions of a block are one [BS, D] matrix), read in place: no copy of a sequence's context.
#include "matmul16.h"
#include "ops.h"
#include "paged.h"
#include "pool.h"

namespace msllm {
namespace {

constexpr int64_t ATTENTION_BLOCK = 8;  // attention: consecutive queries of one cache row per task
                                        // (docs/architecture.md, "cpu_kernels/")

// ---- attention over the KV cache ----------------------------------------------------------------------------
// Each task is a block of consecutive queries that read the same cache row (a prompt's tokens in the prefill and
// chunk graphs; one query per row in the decode step) and one kv head: the G query heads of that kv head for every
// query of the block are one matrix of rows, so each key and value row is read once per task, not once per query
// head and token. Scores are the rows form of the GEMV kernels (K rows as the weight rows), then per query its
// softmax over its own valid positions (the exp in intrinsics on x86) and the weighted sum of the value rows, in
// plain loops the compiler vectorizes for each path (attend_rows_body is compiled once per target).

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial after 2^n range reduction (x = n ln2 + r,
// ln2 in a high and a low part); relative error ~2e-7. At or below EXP_LOW it gives 0. The scalar form, and the
// 8- and 16-lane ones below with the same constants (GCC does not vectorize the scalar form's float selects).
constexpr float EXP_LOW = -87.0f, EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f,
                EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

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

// s[p] = exp(s[p] * scale - best) for scores whose largest times scale is `best`: the plain loop (generic, NEON)
__attribute__((always_inline)) inline void exp_rows_generic(float* s, int64_t n, float scale, float best) {
  for (int64_t p = 0; p < n; ++p) s[p] = exp_nonpositive(s[p] * scale - best);
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

MSLLM_AVX2 inline void exp_rows_avx2(float* s, int64_t n, float scale, float best) {
  const __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(best);
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) _mm256_storeu_ps(s + p, exp_nonpositive8(_mm256_fmsub_ps(_mm256_loadu_ps(s + p), vs, vb)));
  for (; p < n; ++p) s[p] = exp_nonpositive(s[p] * scale - best);
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

MSLLM_AVX512 inline void exp_rows_avx512(float* s, int64_t n, float scale, float best) {
  const __m512 vs = _mm512_set1_ps(scale), vb = _mm512_set1_ps(best);
  int64_t p = 0;
  for (; p + 16 <= n; p += 16)
    _mm512_storeu_ps(s + p, exp_nonpositive16(_mm512_fmsub_ps(_mm512_loadu_ps(s + p), vs, vb)));
  for (; p < n; ++p) s[p] = exp_nonpositive(s[p] * scale - best);
}
#endif

// The softmax and the weighted sum of values of a task's query rows: scores [rows, ld] (row r's first lengths[r]
// valid) -> out[r] [d] = softmax(scores_r * scale) . V, the value rows in blocks of bs positions (vblocks[j]: block
// j's [bs, d] rows). Each row's maximum and sum are kept in 8 lanes (the compiler does not reorder float reductions),
// its weights normalised in place; then the value rows are read a block at a time (in L1) for every query row, each
// row's output in blocks of PV_BLOCK values over two positions at a time, in vector registers.
constexpr int64_t PV_BLOCK = 32;
typedef void (*AttendRowsFn)(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
                             const float* const* vblocks, int64_t bs, int64_t d, float* const* out);

template <void (*ExpRows)(float*, int64_t, float, float)>
__attribute__((always_inline)) inline void attend_rows_body(float* scores, int64_t rows, int64_t ld,
                                                            const int64_t* lengths, float scale,
                                                            const float* const* vblocks, int64_t bs, int64_t d,
                                                            float* const* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    const int64_t n = lengths[r];
    float lanes[8];
    for (int j = 0; j < 8; ++j) lanes[j] = -INFINITY;
    int64_t p = 0;
    for (; p + 8 <= n; p += 8)
      for (int j = 0; j < 8; ++j) lanes[j] = lanes[j] > s[p + j] ? lanes[j] : s[p + j];
    float best = -INFINITY;
    for (int j = 0; j < 8; ++j) best = std::max(best, lanes[j]);
    for (; p < n; ++p) best = std::max(best, s[p]);
    ExpRows(s, n, scale, best * scale);
    for (int j = 0; j < 8; ++j) lanes[j] = 0.f;
    for (p = 0; p + 8 <= n; p += 8)
      for (int j = 0; j < 8; ++j) lanes[j] += s[p + j];
    float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; p < n; ++p) total += s[p];
    const float norm = total > 0.f ? 1.f / total : 0.f;
    for (p = 0; p < n; ++p) s[p] *= norm;
    for (int64_t i = 0; i < d; ++i) out[r][i] = 0.f;
  }
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, lengths[r]);
  for (int64_t p0 = 0; p0 < longest; p0 += bs) {
    const float* v = vblocks[p0 / bs] - p0 * d;  // so that v + p * d is position p's row, p in this block
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p1 = std::min(lengths[r], p0 + bs);
      if (p1 <= p0) continue;
      const float* w = scores + r * ld;
      int64_t i0 = 0;
      for (; i0 + PV_BLOCK <= d; i0 += PV_BLOCK) {
        float acc0[PV_BLOCK], acc1[PV_BLOCK];
        for (int i = 0; i < PV_BLOCK; ++i) acc0[i] = out[r][i0 + i], acc1[i] = 0.f;
        const float* vp = v + p0 * d + i0;
        int64_t p = p0;
        for (; p + 2 <= p1; p += 2, vp += 2 * d) {
          const float w0 = w[p], w1 = w[p + 1];
          for (int i = 0; i < PV_BLOCK; ++i) acc0[i] += w0 * vp[i];
          for (int i = 0; i < PV_BLOCK; ++i) acc1[i] += w1 * vp[d + i];
        }
        if (p < p1)
          for (int i = 0; i < PV_BLOCK; ++i) acc0[i] += w[p] * vp[i];
        for (int i = 0; i < PV_BLOCK; ++i) out[r][i0 + i] = acc0[i] + acc1[i];
      }
      for (int64_t i = i0; i < d; ++i) {  // a head size not a multiple of the block
        float acc = out[r][i];
        for (int64_t p = p0; p < p1; ++p) acc += w[p] * v[p * d + i];
        out[r][i] = acc;
      }
    }
  }
}

void attend_rows_generic(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
                         const float* const* vblocks, int64_t bs, int64_t d, float* const* out) {
  attend_rows_body<exp_rows_generic>(scores, rows, ld, lengths, scale, vblocks, bs, d, out);
}
#ifdef MSLLM_X86
MSLLM_AVX2 void attend_rows_avx2(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
    const float* const* vblocks, int64_t bs, int64_t d, float* const* out) {
  attend_rows_body<exp_rows_avx2>(scores, rows, ld, lengths, scale, vblocks, bs, d, out);
}
MSLLM_AVX512 void attend_rows_avx512(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
    const float* const* vblocks, int64_t bs, int64_t d, float* const* out) {
  attend_rows_body<exp_rows_avx512>(scores, rows, ld, lengths, scale, vblocks, bs, d, out);
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

// Queries against the paged KV cache: q [N, H*D]; K, V caches [NB, KH, BS, D]; lengths [N] int32 (query i reads
// positions 0 .. lengths[i]-1, itself included, as the graph's writes left them); rows [N] int32, tables [R, M] int32:
// query i's sequence has the block table tables[rows[i]] (position p in block tables[rows[i]][p / BS]) -> out
// [N, H*D]. Query head h reads key/value head h / (H / KH) (HF repeat_kv). Reads only the blocks under each query's
// length, in place, where the MindSpore form gathers every row's blocks and masks.
struct AttentionJob : Job {
  const float *q, *k, *v;
  const int32_t *lengths, *rows, *tables;
  int64_t batch, heads, max_blocks;
  PagedCache cache;
  float* out;
  std::vector<int64_t> blocks;  // first query of each block of queries, then `batch`

  int64_t length_of(int64_t b) const { return std::max<int64_t>(0, lengths[b]); }

  // blocks of at most `most` consecutive queries of one sequence
  void split(int64_t most) {
    blocks.clear();
    for (int64_t b = 0; b < batch; ++b)
      if (blocks.empty() || b - blocks.back() >= most || rows[b] != rows[blocks.back()]) blocks.push_back(b);
    blocks.push_back(batch);
  }

  void work() override {
    const int64_t d = cache.d, kv_heads = cache.kv_heads, bs = cache.block_size;
    const float scale = 1.0f / std::sqrt(float(d));
    const int64_t group = heads / kv_heads, nblocks = int64_t(blocks.size()) - 1;
    std::vector<float> qs, scores;
    std::vector<int64_t> lens;
    std::vector<float*> outs;
    std::vector<const float*> vblocks;
    for (;;) {
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= nblocks * kv_heads) return;
      const int64_t blk = t / kv_heads, kvh = t % kv_heads, b0 = blocks[blk], b1 = blocks[blk + 1];
      const int32_t* table = tables + int64_t(rows[b0]) * max_blocks;
      const int64_t nrows = (b1 - b0) * group;
      qs.resize(size_t(nrows * d));
      lens.resize(size_t(nrows));
      outs.resize(size_t(nrows));
      int64_t longest = 0;
      for (int64_t b = b0; b < b1; ++b) {  // the block's query heads of kv head kvh, a row each
        std::memcpy(qs.data() + (b - b0) * group * d, q + (b * heads + kvh * group) * d,
                    size_t(group * d) * sizeof(float));
        for (int64_t g = 0; g < group; ++g) {
          lens[(b - b0) * group + g] = length_of(b);
          outs[(b - b0) * group + g] = out + (b * heads + kvh * group + g) * d;
        }
        longest = std::max(longest, length_of(b));
      }
      scores.resize(size_t(std::max<int64_t>(nrows * longest, 1)));
      const int64_t used = (longest + bs - 1) / bs;
      vblocks.resize(size_t(std::max<int64_t>(used, 1)));
      const RowsFn scores_of = rows_kernel(W_F32);
      for (int64_t j = 0; j < used; ++j) {  // each block's scores: its K rows as the weight rows, in place
        const int64_t n = std::min(bs, longest - j * bs);
        scores_of(qs.data(), nrows, k + cache.at(table[j], kvh, 0), nullptr, d, scores.data() + j * bs, longest, 0, n);
        vblocks[j] = v + cache.at(table[j], kvh, 0);
      }
      g_attend_rows(scores.data(), nrows, longest, lens.data(), scale, vblocks.data(), bs, d, outs.data());
    }
  }
};

}  // namespace

// q [N, H*D], the caches K, V [NB, KH, BS, D], lengths [N], rows [N], tables [R, M] (int32) -> out [N, H*D]: query i
// attends to the first lengths[i] positions of the sequence whose block table is tables[rows[i]] (the decode step's
// rows, a prompt's tokens and a chunk's piece alike). A length past the table, a row outside it or a block outside
// the cache: error 4, nothing computed.
int decode_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 7) return 1;
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[1]) || !is_f32(dtypes[2]) || !is_f32(dtypes[6])) return 2;
  for (int k = 3; k < 6; ++k)
    if (std::strcmp(dtypes[k], "int32") != 0) return 2;
  if (ndims[0] != 2 || ndims[1] != 4 || ndims[2] != 4 || ndims[3] != 1 || ndims[4] != 1 || ndims[5] != 2 ||
      ndims[6] != 2)
    return 3;
  const PagedCache cache = paged_cache(shapes[1]);
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
  job.k = static_cast<const float*>(params[1]);
  job.v = static_cast<const float*>(params[2]);
  job.lengths = lengths, job.rows = rows, job.tables = tables;
  job.batch = queries, job.heads = shapes[0][1] / cache.d, job.max_blocks = max_blocks, job.cache = cache;
  job.out = static_cast<float*>(params[6]);
  job.split(ATTENTION_BLOCK);
  run(&job, queries * job.heads * longest * cache.d >= (int64_t(1) << 16));
  return 0;
}

}  // namespace msllm
