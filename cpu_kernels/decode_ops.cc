// mslite-llm CPU kernels: the decode step's fused ops (the op bodies rms_norm, qkv_rope, gemv_add, swiglu,
// decode_qkv, norm_swiglu and decode_tail; registry.cc exports them). Their matmuls are matmul16.cc's (matmul(), and
// its rows kernels in one dispatch for q, k and v); the norms, RoPE and the cache writes are plain C++.
//
// Why: MindSpore ran ~1150 kernels per decoded token of the 0.5B shape; the ~1000 small ones and the gaps between them
// were a quarter of the float32 step and nearly half of the bfloat16 one (docs/performance-log.md, "The decode step:
// where the time goes, and fused ops", 2026-11-23). These fold the decode step's chains of small ops into one call
// each. Float32 activations only.
#include "matmul16.h"
#include "ops.h"
#include "pool.h"

namespace msllm {
namespace {

// Several matrices against the same x in one pool dispatch: the GEMV tasks of all of them.
struct MultiGemvJob : Job {
  static constexpr int MAX = 3;
  RowsFn fn;
  const float* x;
  int64_t rows, in, n = 0;
  const void* w[MAX];
  const float* b[MAX];
  int64_t out[MAX], step[MAX];
  float* y[MAX];
  int64_t first_task[MAX + 1] = {0};

  void add(const void* wm, const float* bm, int64_t o, float* ym) {
    w[n] = wm, b[n] = bm, out[n] = o, y[n] = ym, step[n] = task_rows(o);
    first_task[n + 1] = first_task[n] + (o + step[n] - 1) / step[n];
    ++n;
  }

  Shares shares;

  void work() override {
    shares.claim([&](int64_t t) {
      int m = 0;
      while (t >= first_task[m + 1]) ++m;
      const int64_t o0 = (t - first_task[m]) * step[m];
      fn(x, rows, w[m], b[m], in, y[m], out[m], o0, std::min(out[m], o0 + step[m]));
    });
  }

  void run_all() {
    int64_t outs = 0;
    for (int m = 0; m < n; ++m) outs += out[m];
    const bool parallel = outs >= MIN_PARALLEL_ROWS;
    shares.split(first_task[n], parallel ? threads_to_use() : 1);
    run(this, parallel);
  }
};

// y = x * rsqrt(mean(x^2) + eps) * w, per row (HF Qwen2RMSNorm in float32; the sum in double).
void norm_rows(const float* x, int64_t rows, int64_t e, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * e;
    double ss = 0.0;
    for (int64_t i = 0; i < e; ++i) ss += double(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(float(ss / double(e > 0 ? e : 1)) + eps);
    for (int64_t i = 0; i < e; ++i) y[r * e + i] = w[i] * (xr[i] * inv);
  }
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

// q, k, v [rows, outs[m]] = x . W^T + b for the three (weights, bias) pairs in wb (W of type wt), then Qwen3's
// per-head norms (qn, kn; null: none) and RoPE on q and k (head size d): the q/k/v ops' shared body. The GEMV
// tasks of the three in one dispatch up to GEMV_MAX_ROWS rows, the GEMM form beyond.
void project_qkv_rope(const float* x, int64_t rows, int64_t in, WType wt, void* const* wb, const int64_t outs[3],
                      float* const ys[3], int64_t d, const float* cos, const float* sin, const float* qn,
                      const float* kn, float eps) {
  if (rows <= GEMV_MAX_ROWS || !has_gemm(wt)) {
    MultiGemvJob job;
    job.fn = rows_kernel(wt);
    job.x = x, job.rows = rows, job.in = in;
    for (int m = 0; m < 3; ++m) job.add(wb[2 * m], static_cast<const float*>(wb[2 * m + 1]), outs[m], ys[m]);
    job.run_all();
  } else {
    for (int m = 0; m < 3; ++m) matmul(x, rows, wb[2 * m], wt, static_cast<const float*>(wb[2 * m + 1]), in, outs[m], ys[m]);
  }
  if (qn != nullptr) {
    head_rms_norm(ys[0], rows, outs[0] / d, d, qn, eps);
    head_rms_norm(ys[1], rows, outs[1] / d, d, kn, eps);
  }
  rope(ys[0], rows, outs[0] / d, d, cos, sin);
  rope(ys[1], rows, outs[1] / d, d, cos, sin);
}

}  // namespace

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
// RMSNorm of q and k (Qwen3), and RoPE on q and k. 12 params without the norms, 15 with them.
int qkv_rope(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 12 && nparam != 15) return 1;
  const int inputs = nparam - 3;  // the outputs are the last three params
  const bool norms = nparam == 15;
  const WType wt = weight_type(dtypes[1]);
  if (wt == W_NONE || weight_type(dtypes[3]) != wt || weight_type(dtypes[5]) != wt) return 2;
  for (int k = 0; k < nparam; ++k)
    if (k != 1 && k != 3 && k != 5 && !is_f32(dtypes[k])) return 2;
  for (int k : {0, 1, 3, 5, 7, 8})
    if (ndims[k] != 2) return 3;
  for (int k : {2, 4, 6})
    if (ndims[k] != 1) return 3;
  for (int k = inputs; k < nparam; ++k)
    if (ndims[k] != 2) return 3;
  if (norms && (ndims[9] != 1 || ndims[10] != 1 || ndims[11] > 1 || shapes[9][0] != shapes[7][1] ||
                shapes[10][0] != shapes[7][1] || (ndims[11] == 1 && shapes[11][0] != 1)))
    return 4;
  const int64_t rows = shapes[0][0], in = shapes[0][1], d = shapes[7][1];
  int64_t outs[3];
  for (int m = 0; m < 3; ++m) {
    outs[m] = shapes[1 + 2 * m][0];
    if (shapes[1 + 2 * m][1] != in || shapes[2 + 2 * m][0] != outs[m] || shapes[inputs + m][0] != rows ||
        shapes[inputs + m][1] != outs[m])
      return 4;
  }
  if (d <= 0 || d % 2 || outs[0] % d || outs[1] % d || outs[2] != outs[1] || shapes[7][0] != rows ||
      shapes[8][0] != rows || shapes[8][1] != d)
    return 4;
  const float* x = static_cast<const float*>(params[0]);
  float* ys[3] = {static_cast<float*>(params[inputs]), static_cast<float*>(params[inputs + 1]),
                  static_cast<float*>(params[inputs + 2])};
  if (rows <= 0 || in <= 0) return rows <= 0 ? 0 : 4;
  project_qkv_rope(x, rows, in, wt, params + 1, outs, ys, d, static_cast<const float*>(params[7]),
                   static_cast<const float*>(params[8]), norms ? static_cast<const float*>(params[9]) : nullptr,
                   norms ? static_cast<const float*>(params[10]) : nullptr,
                   norms ? *static_cast<const float*>(params[11]) : 0.f);
  return 0;
}

// x [M, I], W [O, I], r [M, O] -> y = x . W^T + r: o_proj and down_proj with the residual add folded in.
int gemv_add(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 4) return 1;
  const WType wt = weight_type(dtypes[1]);
  if (wt == W_NONE || !is_f32(dtypes[0]) || !is_f32(dtypes[2]) || !is_f32(dtypes[3])) return 2;
  for (int k = 0; k < 4; ++k)
    if (ndims[k] != 2) return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], out = shapes[1][0];
  if (shapes[1][1] != in || shapes[2][0] != rows || shapes[2][1] != out || shapes[3][0] != rows || shapes[3][1] != out)
    return 4;
  if (rows <= 0 || out <= 0) return 0;
  if (in <= 0) return 4;
  matmul(static_cast<const float*>(params[0]), rows, params[1], wt, nullptr, in, out, static_cast<float*>(params[3]),
         nullptr, static_cast<const float*>(params[2]));
  return 0;
}

// The decode step's first half of a layer in one op (MsliteLlmDecodeQkv): the input RMSNorm, q/k/v with their
// biases, Qwen3's per-head norms, RoPE, and k and v written into the KV cache at each row's position, in place.
// params: x [N, E], ln_w [E], eps [1], Wq, bq, Wk, bk, Wv, bv, cos [N, D], sin [N, D], key_cache, value_cache
// [B, KH, S, D] float32, valid_length [N] int32 (the position written is valid_length - 1), [q_norm [D],
// k_norm [D]], q [N, H*D] (the output). N <= B: row r of x is cache row r's token (the decode step); N = B x n: n
// tokens of each cache row in turn (the CPU prefill graph: a prompt's tokens, valid_length their positions + 1).
// Writing the caches here saves the graph two ScatterNdUpdate per layer (MindSpore's CPU kernel: ~60 us each,
// docs/performance-log.md, "The decode step: where the time goes, and fused ops", 2026-11-23) and the separate
// norm's call.
int decode_qkv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 15 && nparam != 17) return 1;
  const bool norms = nparam == 17;
  const int out = nparam - 1;
  const WType wt = weight_type(dtypes[3]);
  if (wt == W_NONE || weight_type(dtypes[5]) != wt || weight_type(dtypes[7]) != wt) return 2;
  for (int k = 0; k < nparam; ++k)
    if (k != 3 && k != 5 && k != 7 && k != 13 && !is_f32(dtypes[k])) return 2;
  if (std::strcmp(dtypes[13], "int32") != 0) return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] > 1 || ndims[11] != 4 || ndims[12] != 4 || ndims[13] != 1 ||
      ndims[out] != 2)
    return 3;
  const int64_t rows = shapes[0][0], e = shapes[0][1];
  const int64_t kv_heads = shapes[11][1], seq = shapes[11][2], d = shapes[11][3];
  for (int k = 0; k < 4; ++k)
    if (shapes[12][k] != shapes[11][k]) return 4;
  const int64_t cache_rows = shapes[11][0];
  if (shapes[1][0] != e || cache_rows <= 0 || (rows > cache_rows && rows % cache_rows) || shapes[13][0] != rows ||
      d <= 0 || d % 2)
    return 4;
  const int64_t per_row = rows > cache_rows ? rows / cache_rows : 1;  // tokens of each cache row
  if (norms && (ndims[14] != 1 || ndims[15] != 1 || shapes[14][0] != d || shapes[15][0] != d)) return 4;
  const int64_t outs[3] = {shapes[3][0], shapes[5][0], shapes[7][0]};
  for (int m = 0; m < 3; ++m)
    if (ndims[3 + 2 * m] != 2 || shapes[3 + 2 * m][1] != e || ndims[4 + 2 * m] != 1 || shapes[4 + 2 * m][0] != outs[m])
      return 4;
  if (outs[1] != kv_heads * d || outs[2] != outs[1] || outs[0] % d || shapes[out][0] != rows ||
      shapes[out][1] != outs[0] || ndims[9] != 2 || ndims[10] != 2 || shapes[9][0] != rows || shapes[9][1] != d ||
      shapes[10][0] != rows || shapes[10][1] != d)
    return 4;
  const int32_t* valid = static_cast<const int32_t*>(params[13]);
  for (int64_t r = 0; r < rows; ++r)
    if (valid[r] < 1 || valid[r] > seq) return 4;  // nothing is written for a bad call
  const float eps = *static_cast<const float*>(params[2]);
  std::vector<float> xn(rows * e), kv(2 * rows * outs[1]);
  norm_rows(static_cast<const float*>(params[0]), rows, e, static_cast<const float*>(params[1]), eps, xn.data());
  float* const ys[3] = {static_cast<float*>(params[out]), kv.data(), kv.data() + rows * outs[1]};
  project_qkv_rope(xn.data(), rows, e, wt, params + 3, outs, ys, d, static_cast<const float*>(params[9]),
                   static_cast<const float*>(params[10]), norms ? static_cast<const float*>(params[14]) : nullptr,
                   norms ? static_cast<const float*>(params[15]) : nullptr, eps);
  for (int m = 1; m < 3; ++m) {
    float* cache = static_cast<float*>(params[10 + m]);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(cache + ((r / per_row * kv_heads + h) * seq + valid[r] - 1) * d, ys[m] + (r * kv_heads + h) * d,
                    size_t(d) * sizeof(float));
  }
  return 0;
}

// The MLP's first half with its RMSNorm (MsliteLlmNormSwiGlu): h [B, E], ln_w [E], eps [1], Wg, Wu [O, E] ->
// silu(n . Wg^T) * (n . Wu^T) [B, O] with n = RMSNorm(h): one call instead of two.
int norm_swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 6) return 1;
  for (int k : {0, 1, 2, 5})
    if (!is_f32(dtypes[k])) return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] > 1) return 3;
  const int64_t rows = shapes[0][0], e = shapes[0][1];
  if (shapes[1][0] != e) return 4;
  std::vector<float> xn(rows * e);
  norm_rows(static_cast<const float*>(params[0]), rows, e, static_cast<const float*>(params[1]),
            *static_cast<const float*>(params[2]), xn.data());
  int64_t shape[2] = {rows, e};
  void* inner[4] = {xn.data(), params[3], params[4], params[5]};
  int inner_ndims[4] = {2, ndims[3], ndims[4], ndims[5]};
  int64_t* inner_shapes[4] = {shape, shapes[3], shapes[4], shapes[5]};
  const char* inner_dtypes[4] = {"float32", dtypes[3], dtypes[4], dtypes[5]};
  return swiglu(4, inner, inner_ndims, inner_shapes, inner_dtypes);
}

// x [M, I]; Wg, Wu [O, I] -> y [M, O] = silu(x . Wg^T) * (x . Wu^T) (the MLP before down_proj).
int swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 4) return 1;
  const WType wt = weight_type(dtypes[1]);
  if (wt == W_NONE || weight_type(dtypes[2]) != wt || !is_f32(dtypes[0]) || !is_f32(dtypes[3])) return 2;
  for (int k = 0; k < 4; ++k)
    if (ndims[k] != 2) return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], out = shapes[1][0];
  if (shapes[1][1] != in || shapes[2][0] != out || shapes[2][1] != in || shapes[3][0] != rows || shapes[3][1] != out)
    return 4;
  if (rows <= 0 || out <= 0) return 0;
  if (in <= 0) return 4;
  matmul(static_cast<const float*>(params[0]), rows, params[1], wt, nullptr, in, out, static_cast<float*>(params[3]),
         params[2]);
  return 0;
}

// The rest of a layer after the attention in one op (MsliteLlmDecodeTail): h = x + attn . Wo^T, then
// h + down(SwiGLU(RMSNorm(h))). params: attn [N, A], Wo [E, A], x [N, E] (the residual), ln_w [E], eps [1],
// Wg, Wu [I, E], Wd [E, I], y [N, E]. For families without o_proj or MLP biases; one MindSpore launch where the
// graph made three (~10-15 us each on 2 cores, 48 per step of the 0.5B shape: docs/performance-log.md, "Each thread
// one stream, and the layer after the attention in one call", 2026-11-25).
int decode_tail(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 9) return 1;
  const WType wo = weight_type(dtypes[1]), wg = weight_type(dtypes[5]), wd = weight_type(dtypes[7]);
  if (wo == W_NONE || wg == W_NONE || weight_type(dtypes[6]) != wg || wd == W_NONE) return 2;
  for (int k : {0, 2, 3, 4, 8})
    if (!is_f32(dtypes[k])) return 2;
  for (int k : {0, 1, 2, 5, 6, 7, 8})
    if (ndims[k] != 2) return 3;
  if (ndims[3] != 1 || ndims[4] > 1) return 3;
  const int64_t rows = shapes[0][0], a = shapes[0][1], e = shapes[1][0], inter = shapes[5][0];
  if (shapes[1][1] != a || shapes[2][0] != rows || shapes[2][1] != e || shapes[3][0] != e || shapes[5][1] != e ||
      shapes[6][0] != inter || shapes[6][1] != e || shapes[7][0] != e || shapes[7][1] != inter ||
      shapes[8][0] != rows || shapes[8][1] != e)
    return 4;
  if (rows <= 0 || e <= 0) return 0;
  if (a <= 0 || inter <= 0) return 4;
  std::vector<float> h(size_t(rows * e)), hn(size_t(rows * e)), m(size_t(rows * inter));
  matmul(static_cast<const float*>(params[0]), rows, params[1], wo, nullptr, a, e, h.data(), nullptr,
         static_cast<const float*>(params[2]));
  norm_rows(h.data(), rows, e, static_cast<const float*>(params[3]), *static_cast<const float*>(params[4]), hn.data());
  matmul(hn.data(), rows, params[5], wg, nullptr, e, inter, m.data(), params[6]);
  matmul(m.data(), rows, params[7], wd, nullptr, inter, e, static_cast<float*>(params[8]), nullptr, h.data());
  return 0;
}

}  // namespace msllm
