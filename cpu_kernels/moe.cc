// mslite-llm CPU kernels: a mixture of experts' experts in one op (the op body moe_experts; registry.cc exports it as
// MsliteLlmMoeExperts). The graph routes (export/network/moe.py: the router, a float32 softmax, top-k, the weights
// renormalised with norm_topk_prob) and gives this op each token's chosen experts and their weights; the op runs
// each chosen expert's SwiGLU on the rows that chose it, from that expert's slice of the stacked weights, and sums
// them weighted. An expert no row chose is not read: a decode step reads the active experts' bytes, not all of them
// (docs/architecture.md, "Mixture of experts").
//
// Tensors: x [N, H] float32, index [N, K] int32 (each row's chosen experts), weights [N, K] float32, gate_up, down,
// y [N, H] float32. gate_up is [E, 2I, H] (each expert's gate rows, then its up rows) and down [E, H, I], each one
// float tensor (float32, float16 or bfloat16) or a quantized one's q (int8 [E, n, k] / uint8 [E, n, k / 2], int4 as
// matmul_quant.h has it), scale [E, G, n][, offset [E, G, n]] float32: 6, 8 or 10 tensors. Errors as registry.cc's
// (5: an expert index outside [0, E)).
//
// The matmuls are matmul16.cc's matmul(), per expert (GEMV up to 16 rows, the GEMM beyond; the quantized rows kernel
// or its prompt GEMM), each in the pool. The SwiGLU between them and the weighted sum are plain C++, in float32.
#include <vector>

#include "matmul16.h"
#include "matmul_quant.h"
#include "ops.h"

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

}  // namespace

int moe_experts(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam < 6) return 1;
  const int arity = is_quant_dtype(dtypes[3]) ? (nparam - 4) / 2 : 1;
  if ((arity != 1 && arity != 2 && arity != 3) || nparam != 4 + 2 * arity) return 1;
  const int yi = nparam - 1;
  if (!is_f32(dtypes[0]) || std::strcmp(dtypes[1], "int32") != 0 || !is_f32(dtypes[2]) || !is_f32(dtypes[yi]))
    return 2;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[yi] != 2) return 3;
  Stacked gate_up, down;
  int i = 3;
  if (const int bad = read_stacked(params, ndims, shapes, dtypes, arity, &i, &gate_up)) return bad;
  if (const int bad = read_stacked(params, ndims, shapes, dtypes, arity, &i, &down)) return bad;
  if (gate_up.type != down.type) return 2;
  const int64_t rows = shapes[0][0], hidden = shapes[0][1], top = shapes[1][1], experts = gate_up.experts;
  const int64_t inter = down.k;
  if (shapes[1][0] != rows || shapes[2][0] != rows || shapes[2][1] != top || shapes[yi][0] != rows ||
      shapes[yi][1] != hidden || down.experts != experts || gate_up.n != 2 * inter || gate_up.k != hidden ||
      down.n != hidden)
    return 4;
  const float* x = static_cast<const float*>(params[0]);
  const int32_t* index = static_cast<const int32_t*>(params[1]);
  const float* weight = static_cast<const float*>(params[2]);
  float* y = static_cast<float*>(params[yi]);
  for (int64_t t = 0; t < rows * top; ++t)  // every index first: nothing is computed for a bad call
    if (index[t] < 0 || index[t] >= experts) return 5;
  std::fill(y, y + rows * hidden, 0.f);
  if (rows <= 0 || hidden <= 0 || inter <= 0 || top <= 0) return 0;

  // the (row, weight) pairs grouped by expert, each expert's in row order (a counting sort)
  std::vector<int64_t> first(experts + 1, 0);
  for (int64_t t = 0; t < rows * top; ++t) ++first[index[t] + 1];
  for (int64_t e = 0; e < experts; ++e) first[e + 1] += first[e];
  std::vector<int64_t> fill(first.begin(), first.end() - 1), row_of(rows * top);
  std::vector<float> weight_of(rows * top);
  for (int64_t t = 0; t < rows * top; ++t) {
    const int64_t at = fill[index[t]]++;
    row_of[at] = t / top, weight_of[at] = weight[t];
  }

  thread_local std::vector<float> xs, gu, act, out;
  QuantWeight holder;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m = first[e + 1] - first[e];
    if (m == 0) continue;  // not chosen: its weights are not read
    const int64_t* rs = row_of.data() + first[e];
    const float* ws = weight_of.data() + first[e];
    xs.resize(size_t(m * hidden)), gu.resize(size_t(m * 2 * inter)), act.resize(size_t(m * inter));
    out.resize(size_t(m * hidden));
    for (int64_t r = 0; r < m; ++r) std::memcpy(&xs[r * hidden], x + rs[r] * hidden, sizeof(float) * hidden);
    matmul(xs.data(), m, gate_up.expert(e, &holder), gate_up.type, nullptr, hidden, 2 * inter, gu.data());
    for (int64_t r = 0; r < m; ++r) {  // silu(gate) * up, HF's SwiGLU in float32
      const float* g = &gu[r * 2 * inter];
      const float* u = g + inter;
      float* a = &act[r * inter];
      for (int64_t j = 0; j < inter; ++j) a[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
    matmul(act.data(), m, down.expert(e, &holder), down.type, nullptr, inter, hidden, out.data());
    for (int64_t r = 0; r < m; ++r) {
      float* yr = y + rs[r] * hidden;
      const float* o = &out[r * hidden];
      const float w = ws[r];
      for (int64_t j = 0; j < hidden; ++j) yr[j] += w * o[j];
    }
  }
  return 0;
}

}  // namespace msllm
