// mslite-llm CPU kernels: a mixture of experts' sparse MLP in one op (the op body moe; registry.cc exports it as
// MsliteLlmMoe): the router, the routing (a float32 softmax, the top k, renormalised with norm_topk_prob, as HF's
// Qwen3-MoE / Qwen2-MoE route), and each chosen expert's SwiGLU on the rows that chose it, from that expert's slice
// of the stacked weights, summed weighted. An expert no row chose is not read: a decode step reads the active
// experts' bytes, not all of them (docs/architecture.md, "Mixture of experts").
//
// Tensors: layout int32 [3] (k, norm_topk_prob, residual); with residual h [N, H], ln_w [H], eps [1] (the op computes
// h + MoE(RMSNorm(h)): the layer after its attention), else x [N, H] (MoE(x)); the router [E, H] (float32, float16
// or bfloat16); gate_up, down; optionally valid_length [B] int32 (the full graph: x holds B prompts of N / B rows and
// only each one's first valid_length are computed, the padding rows' y h or 0); y [N, H] float32. gate_up is
// [E, 2I, H] (each expert's gate rows, then its up rows) and down [E, H, I], each one float tensor (float32, float16
// or bfloat16) or a quantized one's q (int8 [E, n, k] / uint8 [E, n, k / 2], int4 as matmul_quant.h has it),
// scale [E, G, n][, offset [E, G, n]] float32. Errors as registry.cc's.
//
// The router's logits are float32 products of x as given (the rows kernel of its dtype, never the AVX512-BF16 form,
// which would round x and move the routing). The experts' matmuls: where every chosen expert has a few rows (the
// decode step), the rows kernels of every expert's matrix in one pool dispatch (expert_products); beyond, matmul16.cc's
// matmul() per expert (its GEMM for the prompt's rows). The SwiGLU between them and the weighted sum are plain C++, in
// float32.
#include <vector>

#include "matmul16.h"
#include "matmul_quant.h"
#include "ops.h"
#include "pool.h"

namespace msllm {
namespace {

// One stacked weight [E, n, k] as the op is given it: float (`raw`, of type `type`) or quantized (`quant` expert 0's,
// advanced per expert by `stride` bytes of q and `scale_stride` floats of scale and offset).
struct Stacked {
  WType type = W_NONE;
  const uint8_t* raw = nullptr;
  QuantWeight quant;
  int64_t experts = 0, n = 0, k = 0, stride = 0, scale_stride = 0;

  // expert e's weight as matmul() reads it (a quantized one's QuantWeight is written into `holder`)
  const void* expert(int64_t e, QuantWeight* holder) const {
    if (type != W_QUANT) return raw + e * stride;
    *holder = quant;
    holder->q = static_cast<const uint8_t*>(quant.q) + e * stride;
    holder->scale = quant.scale + e * scale_stride;
    if (quant.offset != nullptr) holder->offset = quant.offset + e * scale_stride;
    return holder;
  }
};

int64_t type_bytes(WType t) { return t == W_F32 ? 4 : 2; }

// Reads the stacked weight at params[*i] (advancing *i past its `arity` tensors): 0, or 2 (dtype), 3 (rank), 4 (shapes)
int read_stacked(void** params, int* ndims, int64_t** shapes, const char** dtypes, int arity, int* i, Stacked* s) {
  const int at = *i;
  for (int j = 0; j < arity; ++j)
    if (ndims[at + j] != 3) return 3;
  s->experts = shapes[at][0];
  if (arity == 1) {
    s->type = weight_type(dtypes[at]);
    if (s->type == W_NONE) return 2;
    s->raw = static_cast<const uint8_t*>(params[at]);
    s->n = shapes[at][1], s->k = shapes[at][2];
    s->stride = s->n * s->k * type_bytes(s->type);
  } else {
    // each tensor without its expert dimension: one expert's q, scale[, offset], as read_quant_weight reads a matrix
    void* p[3];
    int nd[3] = {2, 2, 2};
    int64_t dims[3][2];
    int64_t* shp[3];
    const char* dt[3];
    for (int j = 0; j < arity; ++j) {
      if (shapes[at + j][0] != s->experts) return 4;
      p[j] = params[at + j], dt[j] = dtypes[at + j];
      dims[j][0] = shapes[at + j][1], dims[j][1] = shapes[at + j][2];
      shp[j] = dims[j];
    }
    if (const int bad = read_quant_weight(p, nd, shp, dt, 0, arity == 3, &s->quant)) return bad;
    s->type = W_QUANT;
    s->n = s->quant.n, s->k = s->quant.k;
    s->stride = dims[0][0] * dims[0][1];  // int8 or uint8: one byte each
    s->scale_stride = dims[1][0] * dims[1][1];
  }
  *i += arity;
  return 0;
}

// The rows of x each expert reads in the rows kernels' range (the decode step, a few rows a piece): one pool
// dispatch runs every chosen expert's matrix (pool.h PartsJob), where matmul() per expert would dispatch twice per
// expert (16 a layer at 8 experts a token). The same rows kernels as matmul()'s for these rows, so the same sums.
bool rows_form(WType wt, int64_t most_rows) {
  const int64_t limit = wt == W_QUANT ? QUANT_ROWS_MAX : wt == W_BF16 ? BF16_MIN_ROWS - 1 : GEMV_MAX_ROWS;
  return most_rows <= limit;
}

// dst [P, s.n] = src [P, s.k] . W_e^T for each expert e on its rows [first[e], first[e + 1]) of src
void expert_products(const Stacked& s, const std::vector<int64_t>& first, const float* src, float* dst) {
  const int64_t experts = int64_t(first.size()) - 1;
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) most = std::max(most, first[e + 1] - first[e]);
  QuantWeight holder;
  if (!rows_form(s.type, most)) {  // the prompt's rows: matmul() per expert (its GEMM)
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t m = first[e + 1] - first[e];
      if (m > 0) matmul(src + first[e] * s.k, m, s.expert(e, &holder), s.type, nullptr, s.k, s.n, dst + first[e] * s.n);
    }
    return;
  }
  PartsJob job;
  job.fn = rows_kernel(s.type), job.in = s.k;
  std::vector<QuantWeight> quant;  // a quantized expert's weight, its x prepared (px)
  std::vector<PreparedX> px;
  if (s.type == W_QUANT) quant.reserve(size_t(experts)), px.reserve(size_t(experts));
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m = first[e + 1] - first[e];
    if (m == 0) continue;  // not chosen: its weights are not read
    const float* x = src + first[e] * s.k;
    const void* w = s.expert(e, &holder);
    int64_t step = task_rows(s.n);
    if (s.type == W_QUANT) {
      quant.push_back(holder);
      px.emplace_back();
      prepare(x, m, quant.back(), &px.back());
      quant.back().x = &px.back();
      w = &quant.back();
      step = quant_task_rows(quant.back());
    }
    job.add(x, m, w, nullptr, dst + first[e] * s.n, s.n, step);
  }
  job.run_all();
}

// logits [rows, experts] = x . router^T in float32 (the rows kernel of the router's dtype: its weights widened, x as
// given, never rounded to bfloat16), tasks of a few rows over the pool
struct RouterJob : Job {
  RowsFn fn;
  const float* x;
  const void* w;
  int64_t rows, in, experts;
  float* logits;
  Shares shares;
  static constexpr int64_t ROWS = 4;

  void work() override {
    shares.claim([&](int64_t t) {
      const int64_t r0 = t * ROWS, r1 = std::min(rows, r0 + ROWS);
      fn(x + r0 * in, r1 - r0, w, nullptr, in, logits + r0 * experts, experts, 0, experts);
    });
  }
};

// Each row's top `top` experts by a float32 softmax of its logits, largest first, equal ones to the lower index
// (HF: softmax(logits, dtype=float32), torch.topk), and their probabilities, divided by their sum with `norm`.
void route(const float* logits, int64_t rows, int64_t experts, int64_t top, bool norm, int32_t* index,
           float* weights) {
  std::vector<float> probs(experts);
  std::vector<int32_t> order(experts);
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * experts;
    float most = l[0];
    for (int64_t e = 1; e < experts; ++e) most = std::max(most, l[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) sum += probs[e] = std::exp(l[e] - most);
    for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
    for (int64_t e = 0; e < experts; ++e) order[e] = int32_t(e);
    std::partial_sort(order.begin(), order.begin() + top, order.end(), [&](int32_t a, int32_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    });
    float chosen = 0.f;
    for (int64_t j = 0; j < top; ++j) chosen += probs[order[j]];
    for (int64_t j = 0; j < top; ++j) {
      index[r * top + j] = order[j];
      weights[r * top + j] = norm ? probs[order[j]] / chosen : probs[order[j]];
    }
  }
}

}  // namespace

int moe(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 2) return 1;
  if (std::strcmp(dtypes[0], "int32") != 0) return 2;
  if (ndims[0] != 1 || shapes[0][0] != 3) return 3;
  const int32_t* layout = static_cast<const int32_t*>(params[0]);
  const int64_t top = layout[0];
  const bool norm_topk = layout[1] != 0, residual = layout[2] != 0;
  const int ri = residual ? 4 : 2, gi = ri + 1;  // the router's and gate_up's places
  if (nparam < gi + 3) return 1;
  // the full graph's form: valid_length [B] int32 before y, x holding B prompts of N / B rows, only each one's first
  // valid_length rows computed (the padding rows' y: h with the residual, else 0)
  const int vi = std::strcmp(dtypes[nparam - 2], "int32") == 0 && ndims[nparam - 2] == 1 ? nparam - 2 : -1;
  const int weights_end = vi > 0 ? vi : nparam - 1;
  const int arity = is_quant_dtype(dtypes[gi]) ? (weights_end - gi) / 2 : 1;
  if ((arity != 1 && arity != 2 && arity != 3) || weights_end != gi + 2 * arity) return 1;
  const int yi = nparam - 1;
  const WType rt = weight_type(dtypes[ri]);
  if (!is_f32(dtypes[1]) || !is_f32(dtypes[yi]) || rt == W_NONE || (residual && (!is_f32(dtypes[2]) ||
                                                                                  !is_f32(dtypes[3]))))
    return 2;
  if (ndims[1] != 2 || ndims[yi] != 2 || ndims[ri] != 2 || (residual && (ndims[2] != 1 || ndims[3] > 1))) return 3;
  Stacked gate_up, down;
  int i = gi;
  if (const int bad = read_stacked(params, ndims, shapes, dtypes, arity, &i, &gate_up)) return bad;
  if (const int bad = read_stacked(params, ndims, shapes, dtypes, arity, &i, &down)) return bad;
  if (gate_up.type != down.type) return 2;
  const int64_t rows = shapes[1][0], hidden = shapes[1][1], experts = gate_up.experts, inter = down.k;
  if (shapes[yi][0] != rows || shapes[yi][1] != hidden || shapes[ri][0] != experts || shapes[ri][1] != hidden ||
      down.experts != experts || gate_up.n != 2 * inter || gate_up.k != hidden || down.n != hidden ||
      (residual && shapes[2][0] != hidden) || top < 1 || top > experts)
    return 4;
  const int64_t batch = vi > 0 ? shapes[vi][0] : 1;
  if (batch <= 0 || rows % batch) return 4;
  const float* h = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[yi]);
  if (rows <= 0 || hidden <= 0) return 0;
  // the rows computed: every one, or each prompt's first valid_length
  std::vector<int64_t> live;
  if (vi > 0) {
    const int32_t* valid = static_cast<const int32_t*>(params[vi]);
    const int64_t n = rows / batch;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t r = 0; r < std::min<int64_t>(n, std::max<int32_t>(0, valid[b])); ++r) live.push_back(b * n + r);
  }
  const bool all = vi < 0;
  const int64_t used = all ? rows : int64_t(live.size());

  // the input: RMSNorm(h) with the residual form, else x as given
  thread_local std::vector<float> normed, xlive, logits, xs, gu, act, out;
  const float* x = h;
  if (residual) {
    normed.resize(size_t(rows * hidden));
    norm_rows(h, rows, hidden, static_cast<const float*>(params[2]), *static_cast<const float*>(params[3]),
              normed.data());
    x = normed.data();
  }
  // the router and the routing, in float32, on the rows computed (gathered when some are padding)
  const float* xr = x;
  if (!all) {
    xlive.resize(size_t(used * hidden));
    for (int64_t r = 0; r < used; ++r) std::memcpy(&xlive[r * hidden], x + live[r] * hidden, sizeof(float) * hidden);
    xr = xlive.data();
  }
  if (residual) std::memcpy(y, h, sizeof(float) * rows * hidden);
  else std::fill(y, y + rows * hidden, 0.f);
  if (used == 0) return 0;
  logits.resize(size_t(used * experts));
  RouterJob router;
  router.fn = rows_kernel(rt), router.x = xr, router.w = params[ri], router.rows = used, router.in = hidden;
  router.experts = experts, router.logits = logits.data();
  const int64_t tasks = (used + RouterJob::ROWS - 1) / RouterJob::ROWS;
  const bool parallel = tasks > 1 && used * experts >= MIN_PARALLEL_ROWS;
  router.shares.split(tasks, parallel ? threads_to_use() : 1);
  run(&router, parallel);
  const int64_t pairs = used * top;
  std::vector<int32_t> index(pairs);
  std::vector<float> weight(pairs);
  route(logits.data(), used, experts, top, norm_topk, index.data(), weight.data());
  if (inter <= 0) return 0;

  // the (row, weight) pairs grouped by expert, each expert's in row order (a counting sort): pair p is x's row
  // row_of[p], expert e's pairs [first[e], first[e + 1])
  std::vector<int64_t> first(experts + 1, 0);
  for (int64_t t = 0; t < pairs; ++t) ++first[index[t] + 1];
  for (int64_t e = 0; e < experts; ++e) first[e + 1] += first[e];
  std::vector<int64_t> fill(first.begin(), first.end() - 1), row_of(pairs);
  std::vector<float> weight_of(pairs);
  for (int64_t t = 0; t < pairs; ++t) {
    const int64_t at = fill[index[t]]++;
    row_of[at] = all ? t / top : live[t / top], weight_of[at] = weight[t];
  }

  xs.resize(size_t(pairs * hidden)), gu.resize(size_t(pairs * 2 * inter)), act.resize(size_t(pairs * inter));
  out.resize(size_t(pairs * hidden));
  for (int64_t p = 0; p < pairs; ++p) std::memcpy(&xs[p * hidden], x + row_of[p] * hidden, sizeof(float) * hidden);
  expert_products(gate_up, first, xs.data(), gu.data());
  for (int64_t p = 0; p < pairs; ++p) {  // silu(gate) * up, HF's SwiGLU in float32
    const float* g = &gu[p * 2 * inter];
    const float* u = g + inter;
    float* a = &act[p * inter];
    for (int64_t j = 0; j < inter; ++j) a[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
  }
  expert_products(down, first, act.data(), out.data());
  for (int64_t p = 0; p < pairs; ++p) {  // weighted, summed per row in expert order
    float* yr = y + row_of[p] * hidden;
    const float* o = &out[p * hidden];
    const float w = weight_of[p];
    for (int64_t j = 0; j < hidden; ++j) yr[j] += w * o[j];
  }
  return 0;
}

// The decode step's layer of a mixture of experts in one call (MsliteLlmPagedDecodeMoeLayer), as decode_ops.cc's
// decode_layer composes the dense one's: decode_qkv (the input norm, q/k/v, RoPE, the cache writes), the attention,
// o_proj + the residual (gemv_add), then moe's residual form (the norm, the router, the experts, the residual).
// params: layout int32 [4] (nq, no, kc, nm): decode_qkv's nq tensors (x first, without its output; kc: key_cache's
// index among them), lengths [N], rows [N], tables [R, M], Wo's no tensors, moe's nm tensors without its h (its
// layout, ln_w, eps, the router, gate_up.., down..), y [N, E]. x is the layer's residual too. One MindSpore launch
// where the graph made four (~25 us between two of them: docs/performance-log.md 35).
int decode_moe_layer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 12 || ndims[0] != 1 || shapes[0][0] != 4 || std::strcmp(dtypes[0], "int32") != 0) return 1;
  const int32_t* layout = static_cast<const int32_t*>(params[0]);
  const int nq = layout[0], no = layout[1], kc = layout[2], nm = layout[3];
  if (nq < 4 || no < 1 || no > 3 || kc < 1 || kc + 1 >= nq || nm < 5 || 1 + nq + 3 + no + nm + 1 != nparam) return 1;
  const int q0 = 1, o0 = 1 + nq + 3, m0 = o0 + no;
  float* attn = nullptr;
  int64_t ashape[2];
  if (const int rc = decode_attend(params, ndims, shapes, dtypes, nq, kc, &attn, ashape)) return rc;
  const int64_t n = shapes[q0][0], hidden = shapes[q0][1];  // x [N, E]
  thread_local std::vector<float> hbuf;
  if (int64_t(hbuf.size()) < n * hidden) hbuf.resize(n * hidden);
  int64_t hshape[2] = {n, hidden};
  SubCall call(params, ndims, shapes, dtypes);  // h = x + attn . Wo^T, then y = h + MoE(RMSNorm(h))
  if (const int rc = call.scratch(attn, ashape).take(o0, o0 + no).take(q0).scratch(hbuf.data(), hshape).run(gemv_add))
    return rc;
  return call.take(m0).scratch(hbuf.data(), hshape).take(m0 + 1, m0 + nm).take(nparam - 1).run(moe);
}

}  // namespace msllm
