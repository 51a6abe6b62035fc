// mslite-llm CPU kernels: the decode step's fused ops (the op bodies rms_norm, qkv_rope, gemv_add, swiglu,
// decode_qkv, norm_swiglu and decode_tail; registry.cc exports them). Their matmuls are matmul16.cc's (matmul(), and
// its rows kernels in one dispatch for q, k and v); the norms, RoPE and the cache writes are plain C++.
//
// Why: MindSpore ran ~1150 kernels per decoded token of the 0.5B shape; the ~1000 small ones and the gaps between them
// were a quarter of the float32 step and nearly half of the bfloat16 one (docs/performance-log.md, "The decode step:
// where the time goes, and fused ops", 2026-11-23). These fold the decode step's chains of small ops into one call
// each. Float32 activations only.
//
// Weights: each matrix is one tensor (float32, float16 or bfloat16 [O, I]) or a quantized one's two or three,
// q (int8 [O, I] / uint8 [O, I/2]), scale [G, O][, offset [G, O]] (matmul_quant.h; export/network/layers.py Linear.weights),
// all of one call alike. How many tensors a weight takes is told by the first weight's dtype and the call's count
// of tensors (weight_arity).
#include <cstring>
#include <vector>

#include "matmul16.h"
#include "matmul_quant.h"
#include "ops.h"
#include "paged.h"
#include "pool.h"

namespace msllm {
namespace {

// A weight as a fused op is given it: `raw` of a float type, or `quant` (the rows kernels get data())
struct WeightArg {
  WType type = W_NONE;
  const void* raw = nullptr;
  QuantWeight quant;
  int64_t out = 0, in = 0;
  const void* data() const { return type == W_QUANT ? static_cast<const void*>(&quant) : raw; }
};

// Tensors per weight in a call of nparam tensors whose first weight is at `first`: 1 (a float dtype there), else 2
// or 3 (q, scale[, offset]) as the count says for an op of `base` tensors with float weights (or `base_alt`, an op's
// form with optional tensors) and `weights` weights; 0 when neither fits. Where the count fits both (qkv_rope's 18:
// 12 + 2 x 3, or 15 + 3), the tensor after the scale decides: an offset is 2-D, the bias that would follow is 1-D.
int weight_arity(int nparam, int* ndims, const char** dtypes, int first, int weights, int base, int base_alt = -1) {
  if (!is_quant_dtype(dtypes[first])) return 1;
  int found = 0;
  for (int b : {base, base_alt})
    for (int a : {2, 3})
      if (b >= 0 && nparam == b + (a - 1) * weights) found |= 1 << a;
  if (found == (1 << 2 | 1 << 3)) return ndims[first + 2] == 2 ? 3 : 2;
  return found == 1 << 2 ? 2 : found == 1 << 3 ? 3 : 0;
}

// Reads the weight at params[*i] (advancing *i past its tensors): 0, or 2 (dtype), 3 (rank), 4 (shapes)
int read_weight(void** params, int* ndims, int64_t** shapes, const char** dtypes, int arity, int* i, WeightArg* w) {
  if (arity == 1) {
    w->type = weight_type(dtypes[*i]);
    if (w->type == W_NONE) return 2;
    if (ndims[*i] != 2) return 3;
    w->raw = params[*i], w->out = shapes[*i][0], w->in = shapes[*i][1];
  } else {
    if (const int bad = read_quant_weight(params, ndims, shapes, dtypes, *i, arity == 3, &w->quant)) return bad;
    w->type = W_QUANT, w->out = w->quant.n, w->in = w->quant.k;
  }
  *i += arity;
  return 0;
}

// Reads `count` weights of one type from params[*i] on, with the float tensor (bias) after each when `biases`
int read_weights(void** params, int* ndims, int64_t** shapes, const char** dtypes, int arity, int* i, int count,
                 WeightArg* ws, const float** biases = nullptr) {
  for (int m = 0; m < count; ++m) {
    if (const int bad = read_weight(params, ndims, shapes, dtypes, arity, i, ws + m)) return bad;
    if (ws[m].type != ws[0].type) return 2;
    if (biases != nullptr) {
      if (!is_f32(dtypes[*i])) return 2;
      if (ndims[*i] != 1) return 3;
      if (shapes[*i][0] != ws[m].out) return 4;
      biases[m] = static_cast<const float*>(params[(*i)++]);
    }
  }
  return 0;
}

// In place on [rows, heads * d]: x * cos + rotate_half(x) * sin, cos/sin [rows, d] (HF apply_rotary_pos_emb).
void rope(float* x, int64_t rows, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

// In place on [rows, heads * d]: each head's d values RMS-normalised and scaled by w [d] (Qwen3's q_norm/k_norm).
void head_rms_norm(float* x, int64_t rows, int64_t heads, int64_t d, const float* w, float eps) {
  for (int64_t r = 0; r < rows * heads; ++r) {
    float* v = x + r * d;
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += double(v[i]) * v[i];
    const float inv = 1.0f / std::sqrt(float(ss / double(d)) + eps);
    for (int64_t i = 0; i < d; ++i) v[i] = w[i] * (v[i] * inv);
  }
}

// q, k, v [rows, out of each] = x . W^T + b for the three weights ws (of one type) and biases, then Qwen3's per-head
// norms (qn, kn; null: none) and RoPE on q and k (head size d): the q/k/v ops' shared body. The GEMV tasks of the
// three in one dispatch up to GEMV_MAX_ROWS rows (quantized weights: x prepared once per layout), the GEMM beyond.
void project_qkv_rope(const float* x, int64_t rows, int64_t in, const WeightArg* ws, const float* const* bs,
                      float* const ys[3], int64_t d, const float* cos, const float* sin, const float* qn,
                      const float* kn, float eps) {
  const WType wt = ws[0].type;
  if (rows <= GEMV_MAX_ROWS || !has_gemm(wt)) {
    QuantWeight prepared[3];
    PreparedX px[3];
    if (wt == W_QUANT) {
      for (int m = 0; m < 3; ++m) prepared[m] = ws[m].quant;
      prepare_each(x, rows, prepared, 3, px);
    }
    PartsJob job;
    job.fn = rows_kernel(wt), job.in = in;
    const void* w[3];
    for (int m = 0; m < 3; ++m) w[m] = wt == W_QUANT ? &prepared[m] : ws[m].data();
    thread_local std::vector<uint16_t> xb;  // bfloat16 weights in the AVX512-BF16 form: x rounded once for the three
    Bf16Operand ops[3];
    if (const RowsFn fn = wt == W_BF16 ? bf16_prepare(x, rows, in, xb) : nullptr) {
      job.fn = fn;
      for (int m = 0; m < 3; ++m) ops[m] = {ws[m].data(), xb.data()}, w[m] = &ops[m];
    }
    for (int m = 0; m < 3; ++m)
      job.add(x, rows, w[m], bs[m], ys[m], ws[m].out,
              wt == W_QUANT ? quant_task_rows(prepared[m]) : bf16_task_rows(job.fn, ws[m].out));
    job.run_all();
  } else {
    for (int m = 0; m < 3; ++m) matmul(x, rows, ws[m].data(), wt, bs[m], in, ws[m].out, ys[m]);
  }
  if (qn != nullptr) {
    head_rms_norm(ys[0], rows, ws[0].out / d, d, qn, eps);
    head_rms_norm(ys[1], rows, ws[1].out / d, d, kn, eps);
  }
  rope(ys[0], rows, ws[0].out / d, d, cos, sin);
  rope(ys[1], rows, ws[1].out / d, d, cos, sin);
}

thread_local int64_t g_valid_rows = -1;  // ValidRows' count on this thread; -1: none alive

// outputs [rows, width] past row `live`: zeros (a padding row's, never read)
void zero_rows(float* y, int64_t live, int64_t rows, int64_t width) {
  if (live < rows) std::memset(y + live * width, 0, size_t((rows - live) * width) * sizeof(float));
}

}  // namespace

ValidRows::ValidRows(int64_t rows) { g_valid_rows = std::max<int64_t>(rows, 0); }
ValidRows::~ValidRows() { g_valid_rows = -1; }
int64_t valid_rows(int64_t rows) { return g_valid_rows < 0 ? rows : std::min(rows, g_valid_rows); }

int rms_norm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 4) return 1;
  for (int k = 0; k < 4; ++k)
    if (!is_f32(dtypes[k])) return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[3] != 2) return 3;
  const int64_t rows = shapes[0][0], e = shapes[0][1];
  if (shapes[1][0] != e || shapes[3][0] != rows || shapes[3][1] != e || ndims[2] > 1 ||
      (ndims[2] == 1 && shapes[2][0] != 1))
    return 4;
  norm_rows(static_cast<const float*>(params[0]), rows, e, static_cast<const float*>(params[1]),
            *static_cast<const float*>(params[2]), static_cast<float*>(params[3]));
  return 0;
}

// x [M, E]; Wq [H*D, E], bq; Wk [KH*D, E], bk; Wv, bv; cos, sin [M, D] [; q_norm, k_norm [D], eps [1]]
// -> q [M, H*D], k, v [M, KH*D]: the three projections (one dispatch when M is small), the optional per-head
// RMSNorm of q and k (Qwen3), and RoPE on q and k. 12 tensors with float weights and without the norms, 15 with them
// (each quantized weight adds one or two).
int qkv_rope(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 4) return 1;
  const int arity = weight_arity(nparam, ndims, dtypes, 1, 3, 12, 15);
  if (arity == 0) return 1;
  const bool norms = nparam == 15 + 3 * (arity - 1);
  if (nparam != (norms ? 15 : 12) + 3 * (arity - 1)) return 1;
  WeightArg ws[3];
  const float* bs[3];
  int i = 1;
  if (const int bad = read_weights(params, ndims, shapes, dtypes, arity, &i, 3, ws, bs)) return bad;
  const int ci = i, si = i + 1, outputs = nparam - 3;  // cos, sin; the outputs are the last three tensors
  for (int k = 0; k < nparam; ++k)
    if ((k == 0 || k >= ci) && !is_f32(dtypes[k])) return 2;
  if (ndims[0] != 2 || ndims[ci] != 2 || ndims[si] != 2) return 3;
  for (int k = outputs; k < nparam; ++k)
    if (ndims[k] != 2) return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], d = shapes[ci][1];
  if (norms && (ndims[si + 1] != 1 || ndims[si + 2] != 1 || ndims[si + 3] > 1 || shapes[si + 1][0] != d ||
                shapes[si + 2][0] != d || (ndims[si + 3] == 1 && shapes[si + 3][0] != 1)))
    return 4;
  for (int m = 0; m < 3; ++m)
    if (ws[m].in != in || shapes[outputs + m][0] != rows || shapes[outputs + m][1] != ws[m].out) return 4;
  if (d <= 0 || d % 2 || ws[0].out % d || ws[1].out % d || ws[2].out != ws[1].out || shapes[ci][0] != rows ||
      shapes[si][0] != rows || shapes[si][1] != d)
    return 4;
  float* ys[3] = {static_cast<float*>(params[outputs]), static_cast<float*>(params[outputs + 1]),
                  static_cast<float*>(params[outputs + 2])};
  if (rows <= 0 || in <= 0) return rows <= 0 ? 0 : 4;
  const int64_t live = valid_rows(rows);  // rows past it: padding (ValidRows)
  for (int m = 0; m < 3; ++m) zero_rows(ys[m], live, rows, ws[m].out);
  if (live == 0) return 0;
  project_qkv_rope(static_cast<const float*>(params[0]), live, in, ws, bs, ys, d,
                   static_cast<const float*>(params[ci]), static_cast<const float*>(params[si]),
                   norms ? static_cast<const float*>(params[si + 1]) : nullptr,
                   norms ? static_cast<const float*>(params[si + 2]) : nullptr,
                   norms ? *static_cast<const float*>(params[si + 3]) : 0.f);
  return 0;
}

// x [M, I], W [O, I], r [M, O] -> y = x . W^T + r: o_proj and down_proj with the residual add folded in.
int gemv_add(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 4) return 1;
  const int arity = weight_arity(nparam, ndims, dtypes, 1, 1, 4);
  if (arity == 0 || nparam != 3 + arity) return 1;
  WeightArg w;
  int i = 1;
  if (const int bad = read_weight(params, ndims, shapes, dtypes, arity, &i, &w)) return bad;
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[i]) || !is_f32(dtypes[i + 1])) return 2;
  if (ndims[0] != 2 || ndims[i] != 2 || ndims[i + 1] != 2) return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], out = w.out;
  if (w.in != in || shapes[i][0] != rows || shapes[i][1] != out || shapes[i + 1][0] != rows ||
      shapes[i + 1][1] != out)
    return 4;
  if (rows <= 0 || out <= 0) return 0;
  if (in <= 0) return 4;
  matmul(static_cast<const float*>(params[0]), rows, w.data(), w.type, nullptr, in, out,
         static_cast<float*>(params[i + 1]), nullptr, static_cast<const float*>(params[i]));
  return 0;
}

// The decode step's first half of a layer in one op (MsliteLlmDecodeQkv): the input RMSNorm, q/k/v with their
// biases, Qwen3's per-head norms, RoPE, and k and v written into the paged KV cache, in place.
// params: x [N, E], ln_w [E], eps [1], Wq, bq, Wk, bk, Wv, bv, cos [N, D], sin [N, D], key_cache, value_cache
// [NB, KH, BS, D] float32 or bfloat16 (paged.h; blocks of BS positions, each kv head's positions contiguous: what the
// attention reads), slot_mapping [N] int32 (token r's keys and values go to block slot / BS, position slot % BS; a
// negative slot is not written: a row without a sequence), [q_norm [D], k_norm [D]], q [N, H*D] (the output): 15
// tensors with float weights, 17 with the norms. Every token is a row of its own (the decode step's rows, a prompt's
// tokens). Writing the caches here saves the graph two scatters per layer (MindSpore's CPU ScatterNdUpdate: ~60 us
// each, docs/performance-log.md, "The decode step: where the time goes, and fused ops", 2026-11-23) and the separate
// norm's call.
int decode_qkv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 4) return 1;
  const int arity = weight_arity(nparam, ndims, dtypes, 3, 3, 15, 17);
  if (arity == 0) return 1;
  const bool norms = nparam == 17 + 3 * (arity - 1);
  if (nparam != (norms ? 17 : 15) + 3 * (arity - 1)) return 1;
  WeightArg ws[3];
  const float* bs[3];
  int i = 3;
  if (const int bad = read_weights(params, ndims, shapes, dtypes, arity, &i, 3, ws, bs)) return bad;
  const int ci = i, si = i + 1, kci = i + 2, vci = i + 3, li = i + 4, out = nparam - 1;
  for (int k = 0; k < nparam; ++k)
    if ((k < 3 || (k >= ci && k != li && k != kci && k != vci)) && !is_f32(dtypes[k])) return 2;
  if (std::strcmp(dtypes[li], "int32") != 0) return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] > 1 || ndims[kci] != 4 || ndims[vci] != 4 || ndims[li] != 1 ||
      ndims[out] != 2)
    return 3;
  int64_t rows = shapes[0][0];
  const int64_t e = shapes[0][1];
  PagedCache cache = paged_cache(shapes[kci]);
  if (!paged_dtypes(dtypes[kci], dtypes[vci], &cache)) return 2;
  for (int k = 0; k < 4; ++k)
    if (shapes[vci][k] != shapes[kci][k]) return 4;
  if (shapes[1][0] != e || !cache.ok() || shapes[li][0] != rows || cache.d % 2) return 4;
  const int64_t kv_heads = cache.kv_heads, d = cache.d;
  if (norms && (ndims[li + 1] != 1 || ndims[li + 2] != 1 || shapes[li + 1][0] != d || shapes[li + 2][0] != d))
    return 4;
  for (int m = 0; m < 3; ++m)
    if (ws[m].in != e) return 4;
  if (ws[1].out != kv_heads * d || ws[2].out != ws[1].out || ws[0].out % d || shapes[out][0] != rows ||
      shapes[out][1] != ws[0].out || ndims[ci] != 2 || ndims[si] != 2 || shapes[ci][0] != rows ||
      shapes[ci][1] != d || shapes[si][0] != rows || shapes[si][1] != d)
    return 4;
  const int32_t* slots = static_cast<const int32_t*>(params[li]);
  for (int64_t r = 0; r < rows; ++r)
    if (slots[r] >= cache.slots()) return 4;  // nothing is written for a bad call
  const float eps = *static_cast<const float*>(params[2]);
  const int64_t kv = ws[1].out;
  const int64_t live = valid_rows(rows);  // rows past it: padding (ValidRows), neither computed nor written
  float* const q = static_cast<float*>(params[out]);
  const int64_t qw = ws[0].out;
  zero_rows(q, live, rows, qw);
  rows = live;
  if (rows == 0) return 0;
  // A row whose slot is negative (a prompt graph's padding past its prompt, an idle row of a step or a chunk call:
  // lite_runtime/inputs.py) is never read after this op: it is not projected (its q comes out zero) nor written. So
  // a prompt graph of B rows costs its prompts' tokens here, not B x its bucket (performance-log.md 55), as the
  // GEMMs after the attention (GEMM_VALID) and the attention (length 0) already skip them.
  thread_local std::vector<int64_t> keep_buf;
  Scratch<int64_t> keep_s(keep_buf);
  int64_t* const keep = keep_s.get(rows);
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r)
    if (slots[r] >= 0) keep[n++] = r;
  const float* x = static_cast<const float*>(params[0]);
  const float* cos = static_cast<const float*>(params[ci]);
  const float* sin = static_cast<const float*>(params[si]);
  thread_local std::vector<float> xn_buf, kv_buf, gather_buf;  // (common.h Scratch)
  thread_local std::vector<int32_t> slot_buf;
  Scratch<float> xn_s(xn_buf), kv_s(kv_buf), gather_s(gather_buf);
  Scratch<int32_t> slot_s(slot_buf);
  float* const xn = xn_s.get(n * e);
  float* const kvs = kv_s.get(2 * n * kv);
  float* qs = q;  // every row kept: q in place, cos, sin and the slots as given
  if (n < rows) {  // the kept rows gathered: their q, cos and sin, and slots, then q scattered back
    float* const g = gather_s.get(n * (qw + 2 * d));
    int32_t* const sl = slot_s.get(n);
    qs = g;
    float* const gc = g + n * qw;
    float* const gs = gc + n * d;
    for (int64_t j = 0; j < n; ++j) {
      norm_rows(x + keep[j] * e, 1, e, static_cast<const float*>(params[1]), eps, xn + j * e);
      std::memcpy(gc + j * d, cos + keep[j] * d, size_t(d) * sizeof(float));
      std::memcpy(gs + j * d, sin + keep[j] * d, size_t(d) * sizeof(float));
      sl[j] = slots[keep[j]];
    }
    cos = gc, sin = gs, slots = sl;
  } else {
    norm_rows(x, rows, e, static_cast<const float*>(params[1]), eps, xn);
  }
  float* const ys[3] = {qs, kvs, kvs + n * kv};
  if (n > 0)
    project_qkv_rope(xn, n, e, ws, bs, ys, d, cos, sin, norms ? static_cast<const float*>(params[li + 1]) : nullptr,
                     norms ? static_cast<const float*>(params[li + 2]) : nullptr, eps);
  write_paged(cache, ys[1], ys[2], n, slots, params[kci], params[vci]);
  if (n < rows)  // the kept rows' q back in place, the others zero (keep is ascending)
    for (int64_t r = 0, j = 0; r < rows; ++r) {
      if (j < n && keep[j] == r)
        std::memcpy(q + r * qw, qs + j++ * qw, size_t(qw) * sizeof(float));
      else
        std::memset(q + r * qw, 0, size_t(qw) * sizeof(float));
    }
  return 0;
}

// k and v of N tokens into the paged caches (MsliteLlmWriteCache), in place: the chunk graph's writes, where q/k/v
// come from the rows op (qkv_rope). params: k [N, KH*D], v [N, KH*D], key_cache, value_cache [NB, KH, BS, D] float32
// or bfloat16, slot_mapping [N] int32 (negative: not written), done [1] float32 (the output, 0: for the graph's
// ordering).
int write_cache(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 6) return 1;
  for (int k : {0, 1, 5})
    if (!is_f32(dtypes[k])) return 2;
  if (std::strcmp(dtypes[4], "int32") != 0) return 2;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 4 || ndims[3] != 4 || ndims[4] != 1) return 3;
  PagedCache cache = paged_cache(shapes[2]);
  if (!paged_dtypes(dtypes[2], dtypes[3], &cache)) return 2;
  for (int k = 0; k < 4; ++k)
    if (shapes[3][k] != shapes[2][k]) return 4;
  const int64_t rows = shapes[0][0];
  if (!cache.ok() || shapes[0][1] != cache.kv_heads * cache.d || shapes[1][0] != rows || shapes[1][1] != shapes[0][1] ||
      shapes[4][0] != rows)
    return 4;
  const int32_t* slots = static_cast<const int32_t*>(params[4]);
  for (int64_t r = 0; r < rows; ++r)
    if (slots[r] >= cache.slots()) return 4;
  write_paged(cache, static_cast<const float*>(params[0]), static_cast<const float*>(params[1]), rows, slots, params[2],
              params[3]);
  *static_cast<float*>(params[5]) = 0.f;
  return 0;
}

namespace {

// y [rows, out] = silu(x . Wg^T) * (x . Wu^T), x [rows, in] float32: shapes checked by the callers
void swiglu_rows(const float* x, int64_t rows, const WeightArg& wg, const WeightArg& wu, float* y) {
  matmul(x, rows, wg.data(), wg.type, nullptr, wg.in, wg.out, y, wu.data());
}

}  // namespace

// The MLP's first half with its RMSNorm (MsliteLlmNormSwiGlu): h [B, E], ln_w [E], eps [1], Wg, Wu [O, E] ->
// silu(n . Wg^T) * (n . Wu^T) [B, O] with n = RMSNorm(h): one call instead of two.
int norm_swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 4) return 1;
  const int arity = weight_arity(nparam, ndims, dtypes, 3, 2, 6);
  if (arity == 0 || nparam != 4 + 2 * arity) return 1;
  WeightArg ws[2];
  int i = 3;
  if (const int bad = read_weights(params, ndims, shapes, dtypes, arity, &i, 2, ws)) return bad;
  for (int k : {0, 1, 2, i})
    if (!is_f32(dtypes[k])) return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] > 1 || ndims[i] != 2) return 3;
  const int64_t rows = shapes[0][0], e = shapes[0][1];
  if (shapes[1][0] != e || ws[0].in != e || ws[1].in != e || ws[1].out != ws[0].out || shapes[i][0] != rows ||
      shapes[i][1] != ws[0].out)
    return 4;
  if (rows <= 0 || ws[0].out <= 0) return 0;
  if (e <= 0) return 4;
  thread_local std::vector<float> xn_buf;  // (common.h Scratch)
  Scratch<float> xn_s(xn_buf);
  float* const xn = xn_s.get(rows * e);
  norm_rows(static_cast<const float*>(params[0]), rows, e, static_cast<const float*>(params[1]),
            *static_cast<const float*>(params[2]), xn);
  swiglu_rows(xn, rows, ws[0], ws[1], static_cast<float*>(params[i]));
  return 0;
}

// x [M, I]; Wg, Wu [O, I] -> y [M, O] = silu(x . Wg^T) * (x . Wu^T) (the MLP before down_proj).
int swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 4) return 1;
  const int arity = weight_arity(nparam, ndims, dtypes, 1, 2, 4);
  if (arity == 0 || nparam != 2 + 2 * arity) return 1;
  WeightArg ws[2];
  int i = 1;
  if (const int bad = read_weights(params, ndims, shapes, dtypes, arity, &i, 2, ws)) return bad;
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[i])) return 2;
  if (ndims[0] != 2 || ndims[i] != 2) return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], out = ws[0].out;
  if (ws[0].in != in || ws[1].out != out || ws[1].in != in || shapes[i][0] != rows || shapes[i][1] != out) return 4;
  if (rows <= 0 || out <= 0) return 0;
  if (in <= 0) return 4;
  swiglu_rows(static_cast<const float*>(params[0]), rows, ws[0], ws[1], static_cast<float*>(params[i]));
  return 0;
}

// The rest of a layer after the attention in one op (MsliteLlmDecodeTail): h = x + attn . Wo^T, then
// h + down(SwiGLU(RMSNorm(h))). params: attn [N, A], Wo [E, A], x [N, E] (the residual), ln_w [E], eps [1],
// Wg, Wu [I, E], Wd [E, I], y [N, E] (9 tensors with float weights). For families without o_proj or MLP biases; one
// MindSpore launch where the graph made three (~10-15 us each on 2 cores, 48 per step of the 0.5B shape:
// docs/performance-log.md, "Each thread one stream, and the layer after the attention in one call", 2026-11-25).
int decode_tail(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 4) return 1;
  const int arity = weight_arity(nparam, ndims, dtypes, 1, 4, 9);
  if (arity == 0 || nparam != 5 + 4 * arity) return 1;
  WeightArg wo, ws[3];  // Wo; Wg, Wu, Wd
  int i = 1;
  if (const int bad = read_weight(params, ndims, shapes, dtypes, arity, &i, &wo)) return bad;
  const int xi = i, li = i + 1, ei = i + 2;
  i += 3;
  if (const int bad = read_weight(params, ndims, shapes, dtypes, arity, &i, &ws[0])) return bad;
  if (const int bad = read_weight(params, ndims, shapes, dtypes, arity, &i, &ws[1])) return bad;
  if (const int bad = read_weight(params, ndims, shapes, dtypes, arity, &i, &ws[2])) return bad;
  const int yi = i;
  if (ws[1].type != ws[0].type) return 2;
  for (int k : {0, xi, li, ei, yi})
    if (!is_f32(dtypes[k])) return 2;
  for (int k : {0, xi, yi})
    if (ndims[k] != 2) return 3;
  if (ndims[li] != 1 || ndims[ei] > 1) return 3;
  int64_t rows = shapes[0][0];
  const int64_t a = shapes[0][1], e = wo.out, inter = ws[0].out;
  if (wo.in != a || shapes[xi][0] != rows || shapes[xi][1] != e || shapes[li][0] != e || ws[0].in != e ||
      ws[1].out != inter || ws[1].in != e || ws[2].out != e || ws[2].in != inter || shapes[yi][0] != rows ||
      shapes[yi][1] != e)
    return 4;
  if (rows <= 0 || e <= 0) return 0;
  if (a <= 0 || inter <= 0) return 4;
  const int64_t live = valid_rows(rows);  // rows past it: padding (ValidRows)
  zero_rows(static_cast<float*>(params[yi]), live, rows, e);
  rows = live;
  if (rows == 0) return 0;
  thread_local std::vector<float> h_buf, hn_buf, m_buf;  // (common.h Scratch)
  Scratch<float> h_s(h_buf), hn_s(hn_buf), m_s(m_buf);
  float* const h = h_s.get(rows * e);
  float* const hn = hn_s.get(rows * e);
  float* const m = m_s.get(rows * inter);
  matmul(static_cast<const float*>(params[0]), rows, wo.data(), wo.type, nullptr, a, e, h, nullptr,
         static_cast<const float*>(params[xi]));
  norm_rows(h, rows, e, static_cast<const float*>(params[li]), *static_cast<const float*>(params[ei]), hn);
  swiglu_rows(hn, rows, ws[0], ws[1], m);
  matmul(m, rows, ws[2].data(), ws[2].type, nullptr, inter, e, static_cast<float*>(params[yi]), nullptr, h);
  return 0;
}

}  // namespace msllm

namespace msllm {

// A decode step's whole layer in one call: decode_qkv (the input norm, q/k/v, RoPE, the cache writes), the attention
// over the paged blocks, and decode_tail (o_proj + residual, the norm, the MLP, down_proj + residual). Why: MindSpore's
// runtime spends ~25 us of the calling thread between two of our kernels in a decode graph (its actors, not ours:
// docs/performance-log.md 35), and three ops per layer paid that 90 times a SmolLM2 step; one pays it 30 times.
// params: layout int32 [3] (nq: decode_qkv's inputs; nt: decode_tail's inputs after attn; kc: key_cache's index among
// decode_qkv's, value_cache the next), decode_qkv's nq inputs, lengths [N], rows [N], tables [R, M] (the attention's),
// decode_tail's nt inputs (Wo.., x, ln_w, eps, Wg.., Wu.., Wd..), then y [N, E]. The same tensors as the three ops
// take, in their order; q and the attention's output live in per-thread buffers between them.
int decode_attend(void** params, int* ndims, int64_t** shapes, const char** dtypes, int nq, int kc, float** attn,
                  int64_t* attn_shape) {
  const int q0 = 1, a0 = 1 + nq;
  if (ndims[q0] != 2 || ndims[q0 + 3] < 1) return 3;
  const int64_t n = shapes[q0][0], width = shapes[q0 + 3][0];  // x [N, E]; q [N, H*D] (Wq's outputs)
  thread_local std::vector<float> qbuf, abuf;
  if (int64_t(qbuf.size()) < n * width) qbuf.resize(n * width), abuf.resize(n * width);
  attn_shape[0] = n, attn_shape[1] = width;
  SubCall call(params, ndims, shapes, dtypes);
  if (const int rc = call.take(q0, q0 + nq).scratch(qbuf.data(), attn_shape).run(decode_qkv)) return rc;
  call.scratch(qbuf.data(), attn_shape).take(q0 + kc, q0 + kc + 2).take(a0, a0 + 3).scratch(abuf.data(), attn_shape);
  if (const int rc = call.run(decode_attention)) return rc;
  *attn = abuf.data();
  return 0;
}

namespace {

int decode_layer_rows(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, int nq, int nt,
                      int kc) {
  const int t0 = 1 + nq + 3;
  float* attn = nullptr;
  int64_t ashape[2];
  if (const int rc = decode_attend(params, ndims, shapes, dtypes, nq, kc, &attn, ashape)) return rc;
  return SubCall(params, ndims, shapes, dtypes).scratch(attn, ashape).take(t0, t0 + nt).take(nparam - 1)
      .run(decode_tail);
}

}  // namespace

// Idle rows (slot < 0: lite_runtime/inputs.py) at either end of the rows computed (the ValidRows count) are left
// out: the runner packs a step's live rows first in an inc graph of more rows (the 8-row graph for 5 sequences) and
// last in a chunk or score graph's step rows, against the piece (a verify's idle step row, a chunk call of fewer
// sequences than the graph's rows). Their outputs come out zero. The row tensors (x, cos, sin, slots, lengths, rows,
// the tail's x, y) are viewed from the first live row; the tail's x is found as the tensor x itself (the graph passes
// it twice), and where it is not found nothing is trimmed.
int decode_layer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 8 || ndims[0] != 1 || shapes[0][0] != 3 || std::strcmp(dtypes[0], "int32") != 0) return 1;
  const int32_t* layout = static_cast<const int32_t*>(params[0]);
  const int nq = layout[0], nt = layout[1], kc = layout[2];
  if (nq < 4 || nt < 1 || kc < 1 || kc + 1 >= nq || 1 + nq + 3 + nt + 1 != nparam) return 1;
  const int xi = 1, ci = 1 + kc - 2, si = 1 + kc - 1, li = 1 + kc + 2, a0 = 1 + nq, t0 = 1 + nq + 3, yi = nparam - 1;
  const auto run = [&] { return decode_layer_rows(nparam, params, ndims, shapes, dtypes, nq, nt, kc); };
  if (kc < 5 || li >= a0 || ndims[xi] != 2 || ndims[yi] != 2) return run();
  const int64_t rows = shapes[xi][0];
  int tx = -1;  // the tail's x
  for (int i = t0; i < t0 + nt; ++i)
    if (params[i] == params[xi] && ndims[i] == 2 && shapes[i][0] == rows && shapes[i][1] == shapes[xi][1])
      tx = tx < 0 ? i : nparam;
  const int per_row[] = {xi, ci, si, li, a0, a0 + 1, tx, yi};
  for (int i : per_row) {
    if (i < 0 || i >= nparam || ndims[i] < 1 || ndims[i] > 2 || shapes[i][0] != rows) return run();
    const bool ints = i == li || i == a0 || i == a0 + 1;
    if (ints ? (ndims[i] != 1 || std::strcmp(dtypes[i], "int32") != 0) : (ndims[i] != 2 || !is_f32(dtypes[i])))
      return run();
  }
  const int32_t* slots = static_cast<const int32_t*>(params[li]);
  const int64_t end = valid_rows(rows);
  int64_t first = 0, last = end;
  while (first < end && slots[first] < 0) ++first;
  while (last > first && slots[last - 1] < 0) --last;
  if (first == 0 && last == end) return run();
  float* y = static_cast<float*>(params[yi]);
  const int64_t e = shapes[yi][1];
  std::vector<void*> p(params, params + nparam);
  std::vector<int64_t*> sh(shapes, shapes + nparam);
  int64_t view[8][2];
  for (int k = 0; k < 8; ++k) {
    const int i = per_row[k];
    const int64_t width = ndims[i] == 2 ? shapes[i][1] : 1;
    p[i] = static_cast<char*>(params[i]) + first * width * 4;  // float32 or int32
    view[k][0] = last - first, view[k][1] = width;
    sh[i] = view[k];
  }
  std::memset(y, 0, size_t(first * e) * sizeof(float));
  std::memset(y + last * e, 0, size_t((rows - last) * e) * sizeof(float));
  if (first == last) return 0;  // every row idle: nothing to compute, nothing written
  return decode_layer_rows(nparam, p.data(), ndims, sh.data(), dtypes, nq, nt, kc);
}

}  // namespace msllm
