// CPU stand-ins for the Ascend fused operators of `--graph fused` folders, as MindSpore aot Custom ops.
//
// Why: a fused Atlas folder calls PromptFlashAttention, ReshapeAndCache, PagedAttention, RmsNorm, AddRmsNorm and
// RotaryPositionEmbedding (a mixture of experts also MoeGatingTopKSoftmax, MoeInitRoutingV2, GroupedMatmulV4 and
// MoeTokenUnpermute, whose stand-ins' comments below say their tensors), which MindSpore's CPU build can shape-infer
// and export but has no kernels for.
// The `ms` backend replaces each such node, when it loads the graph, by a Custom op calling the function
// here (lite_runtime/backends/standins.py), so `check` and `compare` run the folder's own graph wiring
// (layouts, lengths, masks, GQA, scale, epsilon, cache) on any CPU. They prove the wiring, not Ascend's
// kernels: written from the operators' documented semantics (MindSpore 2.10 op docs, CANN aclnn docs),
// plainly, for clarity over speed. All arithmetic is float32; outputs are rounded to the input's dtype.
//
// Interface (MindSpore aot CPU): int F(int nparam, void** params, int* ndims, int64_t** shapes,
// const char** dtypes, void* stream, void* extra); 0 on success, else 1 wrong number of tensors,
// 2 unsupported dtype, 3 wrong ranks, 4 shapes that do not fit, 6 an attribute the stand-in does not
// implement, 7 a compressed causal mask that is not the documented one. Tensors (dtype T: float16,
// bfloat16 or float32; lengths int32 or int64; attrs float32):
//   MsliteLlmAtlasPromptFlashAttention: q [B, N, Sq, D], k, v [B, KVN, Skv, D], mask [2048, 2048] bool/uint8
//     (sparse_mode 2/3) or [B|1, 1, Sq, Skv] (sparse_mode 0), actual_seq_lengths [B], actual_seq_lengths_kv [B],
//     attrs [scale_value, sparse_mode, pre_tokens, next_tokens] -> out [B, N, Sq, D] T   (input_layout BNSD)
//   MsliteLlmAtlasRmsNorm: x [..., E] T, gamma [E] T, attrs [epsilon] -> y [..., E] T, rstd [..., 1] float32
//   MsliteLlmAtlasAddRmsNorm: x1, x2 [..., E] T, gamma [E] T, attrs [epsilon] -> y T, rstd float32, x = x1 + x2 T
//   MsliteLlmAtlasRotaryPositionEmbedding: x [B, N, S, D] T, cos, sin [B|1, 1, S, D] T, attrs [mode]
//     -> out [B, N, S, D] T   (mode 0: rotate-half, as HF's rotate_half; mode 1: interleaved pairs)
//   MsliteLlmAtlasReshapeAndCache: key, value [T, KVN*D] (or [T, KVN, D]) T, key_cache, value_cache [NB, BS, KVN, D]
//     T, slot_mapping [T] int32/int64 -> out: key's shape T (a copy of key). Token t's key and value are written at
//     block slot / BS, position slot % BS of the caches, in place; a negative slot is skipped (padding), as the op
//     documents (MindSpore's ReshapeAndCache: "key/value (num_tokens, num_head, head_dim)", caches (num_blocks,
//     block_size, num_head, head_dim))
//   MsliteLlmAtlasPagedAttention: query [T, N, D] T, key_cache, value_cache [NB, BS, KVN, D] T, block_tables [T, M],
//     context_lens [T] int32, attrs [head_num, scale_value, kv_head_num] -> out [T, N, D] T: query t attends to
//     positions 0 .. context_lens[t] - 1 of its sequence, position p in block block_tables[t][p / BS] (MindSpore's
//     PagedAttention without antiquant, mask, q_seq_lens or alibi: one query per token, its context its own)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "dtypes.h"

namespace {

using namespace msllm;  // Dtype, load, store, round_to (dtypes.h)

int64_t length_at(const void* p, const char* dtype, int64_t i) {
  return !std::strcmp(dtype, "int64") ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

bool is_length_dtype(const char* dtype) { return !std::strcmp(dtype, "int64") || !std::strcmp(dtype, "int32"); }

int64_t count(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

// Runs f(task) for task in [0, tasks) on up to hardware_concurrency threads.
template <class F>
void parallel(int64_t tasks, F f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(tasks, std::thread::hardware_concurrency()));
  if (threads == 1) {
    for (int64_t t = 0; t < tasks; ++t) f(t);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      for (int64_t t = w; t < tasks; t += threads) f(t);
    });
  for (auto& th : pool) th.join();
}

// One query row against keys [0, kv_end) where allowed(j): softmax(scale * q.k) . v, float32, into out (D floats).
// A row with no allowed key is zeros.
template <class Allowed>
void attend_row(const float* q, const void* k, const void* v, Dtype t, int64_t base, int64_t kv_end, int64_t d,
                float scale, Allowed allowed, std::vector<float>& scores, float* out) {
  scores.assign(kv_end, -std::numeric_limits<float>::infinity());
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < kv_end; ++j) {
    if (!allowed(j)) continue;
    float s = 0.f;
    for (int64_t c = 0; c < d; ++c) s += q[c] * load(k, t, base + j * d + c);
    scores[j] = s * scale;
    top = std::max(top, scores[j]);
  }
  for (int64_t c = 0; c < d; ++c) out[c] = 0.f;
  if (top == -std::numeric_limits<float>::infinity()) return;
  float total = 0.f;
  for (int64_t j = 0; j < kv_end; ++j) {
    if (scores[j] == -std::numeric_limits<float>::infinity()) continue;
    const float e = std::exp(scores[j] - top);
    total += e;
    for (int64_t c = 0; c < d; ++c) out[c] += e * load(v, t, base + j * d + c);
  }
  for (int64_t c = 0; c < d; ++c) out[c] /= total;
}

// q [B, N, Sq, D], k and v [B, KVN, Skv, D] and the output (params[out]) of one dtype, N a multiple of KVN: 0, or the
// error code
int check_qkv(int* ndims, int64_t** shapes, const char** dtypes, int out, Dtype* t) {
  for (int i = 0; i < 3; ++i)
    if (ndims[i] != 4) return 3;
  *t = dtype_of(dtypes[0]);
  if (*t == BAD || dtype_of(dtypes[1]) != *t || dtype_of(dtypes[2]) != *t || dtype_of(dtypes[out]) != *t) return 2;
  for (int i = 0; i < 4; ++i)
    if (shapes[2][i] != shapes[1][i]) return 4;
  const int64_t kv_heads = shapes[1][1];
  if (shapes[1][0] != shapes[0][0] || shapes[1][3] != shapes[0][3] || kv_heads <= 0 || shapes[0][1] % kv_heads)
    return 4;
  return 0;
}

constexpr int64_t COMPRESSED_MASK = 2048;  // the side of sparse_mode 2/3's mask, as the op documents it

int prompt_flash_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 8) return 1;
  Dtype t;
  if (const int bad = check_qkv(ndims, shapes, dtypes, 7, &t)) return bad;
  if (!is_length_dtype(dtypes[4]) || !is_length_dtype(dtypes[5]) || std::strcmp(dtypes[6], "float32")) return 2;
  const int64_t batch = shapes[0][0], heads = shapes[0][1], sq = shapes[0][2], d = shapes[0][3];
  const int64_t kv_heads = shapes[1][1], skv = shapes[1][2];
  if (count(ndims[4], shapes[4]) != batch || count(ndims[5], shapes[5]) != batch || count(ndims[6], shapes[6]) != 4)
    return 4;
  const float* attrs = static_cast<const float*>(params[6]);
  const float scale = attrs[0];
  const int sparse_mode = int(attrs[1]);
  const int64_t pre_tokens = int64_t(attrs[2]), next_tokens = int64_t(attrs[3]);
  const uint8_t* mask = static_cast<const uint8_t*>(params[3]);  // bool and uint8 are both one byte
  if (std::strcmp(dtypes[3], "bool") && std::strcmp(dtypes[3], "uint8") && std::strcmp(dtypes[3], "int8")) return 2;
  int64_t mask_batch = 0;
  if (sparse_mode == 2 || sparse_mode == 3) {
    if (count(ndims[3], shapes[3]) != COMPRESSED_MASK * COMPRESSED_MASK) return 4;
    // the documented compressed causal mask: 1 (discard) strictly above the diagonal, 0 elsewhere
    for (int64_t i = 0; i < COMPRESSED_MASK; ++i)
      for (int64_t j = 0; j < COMPRESSED_MASK; ++j)
        if ((mask[i * COMPRESSED_MASK + j] != 0) != (j > i)) return 7;
  } else if (sparse_mode == 0) {
    if (ndims[3] != 4 || shapes[3][1] != 1 || shapes[3][2] != sq || shapes[3][3] != skv) return 4;
    if (shapes[3][0] != batch && shapes[3][0] != 1) return 4;
    mask_batch = shapes[3][0];
  } else {
    return 6;
  }
  const int64_t group = heads / kv_heads;
  parallel(batch * heads, [&](int64_t task) {
    const int64_t b = task / heads, h = task % heads;
    const int64_t q_len = std::min<int64_t>(length_at(params[4], dtypes[4], b), sq);
    const int64_t kv_len = std::min<int64_t>(length_at(params[5], dtypes[5], b), skv);
    const int64_t base = ((b * kv_heads) + h / group) * skv * d;
    std::vector<float> q(d), out(d), scores;
    for (int64_t i = 0; i < sq; ++i) {
      const int64_t row = ((b * heads + h) * sq + i) * d;
      if (i >= q_len) {  // past the row's actual length: zeros
        for (int64_t c = 0; c < d; ++c) store(params[7], t, row + c, 0.f);
        continue;
      }
      for (int64_t c = 0; c < d; ++c) q[c] = load(params[0], t, row + c);
      const int64_t shift = sparse_mode == 3 ? kv_len - q_len : 0;  // rightDownCausal: the last query sees all keys
      auto allowed = [&](int64_t j) {
        if (sparse_mode == 2 || sparse_mode == 3) return j <= i + shift;
        if (mask[((mask_batch == 1 ? 0 : b) * sq + i) * skv + j]) return false;
        return j >= i - pre_tokens && j <= i + next_tokens;
      };
      attend_row(q.data(), params[1], params[2], t, base, kv_len, d, scale, allowed, scores, out.data());
      for (int64_t c = 0; c < d; ++c) store(params[7], t, row + c, out[c]);
    }
  });
  return 0;
}

// y = x * rstd * gamma with rstd = 1 / sqrt(mean(x^2) + eps), in float32 from x as the tensor holds it
void norm_rows(const void* x, Dtype t, const void* gamma, int64_t rows, int64_t e, float eps, void* y, float* rstd,
               const std::vector<float>* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    double square = 0.;
    for (int64_t c = 0; c < e; ++c) {
      const float v = sums ? (*sums)[r * e + c] : load(x, t, r * e + c);
      square += double(v) * v;
    }
    const float inv = 1.f / std::sqrt(float(square / double(e)) + eps);
    rstd[r] = inv;
    for (int64_t c = 0; c < e; ++c) {
      const float v = sums ? (*sums)[r * e + c] : load(x, t, r * e + c);
      store(y, t, r * e + c, v * inv * load(gamma, t, c));
    }
  }
}

int rms_norm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 5) return 1;
  const Dtype t = dtype_of(dtypes[0]);
  if (t == BAD || dtype_of(dtypes[1]) != t || std::strcmp(dtypes[2], "float32") || dtype_of(dtypes[3]) != t ||
      std::strcmp(dtypes[4], "float32"))
    return 2;
  if (ndims[0] < 1 || ndims[1] != 1) return 3;
  const int64_t e = shapes[0][ndims[0] - 1];
  if (shapes[1][0] != e || count(ndims[2], shapes[2]) != 1) return 4;
  const int64_t rows = count(ndims[0], shapes[0]) / e;
  if (count(ndims[4], shapes[4]) != rows) return 4;
  norm_rows(params[0], t, params[1], rows, e, static_cast<const float*>(params[2])[0], params[3],
            static_cast<float*>(params[4]), nullptr);
  return 0;
}

int add_rms_norm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 7) return 1;
  const Dtype t = dtype_of(dtypes[0]);
  if (t == BAD || dtype_of(dtypes[1]) != t || dtype_of(dtypes[2]) != t || std::strcmp(dtypes[3], "float32") ||
      dtype_of(dtypes[4]) != t || std::strcmp(dtypes[5], "float32") || dtype_of(dtypes[6]) != t)
    return 2;
  if (ndims[0] < 1 || ndims[1] != ndims[0] || ndims[2] != 1) return 3;
  for (int i = 0; i < ndims[0]; ++i)
    if (shapes[1][i] != shapes[0][i]) return 4;
  const int64_t e = shapes[0][ndims[0] - 1], n = count(ndims[0], shapes[0]);
  if (shapes[2][0] != e || count(ndims[3], shapes[3]) != 1 || count(ndims[5], shapes[5]) != n / e) return 4;
  // x = x1 + x2 rounded to T (the op's third output); the norm reads that sum as the tensor holds it
  std::vector<float> sums(n);
  for (int64_t i = 0; i < n; ++i) {
    sums[i] = round_to(t, load(params[0], t, i) + load(params[1], t, i));
    store(params[6], t, i, sums[i]);
  }
  norm_rows(nullptr, t, params[2], n / e, e, static_cast<const float*>(params[3])[0], params[4],
            static_cast<float*>(params[5]), &sums);
  return 0;
}

int rotary_position_embedding(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 5) return 1;
  const Dtype t = dtype_of(dtypes[0]);
  if (t == BAD || dtype_of(dtypes[1]) != t || dtype_of(dtypes[2]) != t || std::strcmp(dtypes[3], "float32") ||
      dtype_of(dtypes[4]) != t)
    return 2;
  if (ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4) return 3;
  const int64_t batch = shapes[0][0], heads = shapes[0][1], seq = shapes[0][2], d = shapes[0][3];
  for (int i = 0; i < 4; ++i)
    if (shapes[2][i] != shapes[1][i]) return 4;
  if ((shapes[1][0] != batch && shapes[1][0] != 1) || shapes[1][1] != 1 || shapes[1][2] != seq || shapes[1][3] != d ||
      d % 2 || count(ndims[3], shapes[3]) != 1)
    return 4;
  const int mode = int(static_cast<const float*>(params[3])[0]);
  if (mode != 0 && mode != 1) return 6;
  const int64_t half = d / 2;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t s = 0; s < seq; ++s) {
        const int64_t row = ((b * heads + h) * seq + s) * d, table = ((shapes[1][0] == 1 ? 0 : b) * seq + s) * d;
        for (int64_t c = 0; c < d; ++c) {
          float rotated;
          if (mode == 0)  // rotate_half: (-x2, x1)
            rotated = c < half ? -load(params[0], t, row + c + half) : load(params[0], t, row + c - half);
          else  // interleaved: (-x1, x0, -x3, x2, ...)
            rotated = c % 2 == 0 ? -load(params[0], t, row + c + 1) : load(params[0], t, row + c - 1);
          const float v = load(params[0], t, row + c) * load(params[1], t, table + c) +
                          rotated * load(params[2], t, table + c);
          store(params[4], t, row + c, v);
        }
      }
  return 0;
}

int reshape_and_cache(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 6) return 1;
  const Dtype t = dtype_of(dtypes[0]);
  if (t == BAD || dtype_of(dtypes[1]) != t || dtype_of(dtypes[5]) != t) return 2;
  const Dtype ct = dtype_of(dtypes[2]);
  if (ct == BAD || dtype_of(dtypes[3]) != ct || !is_length_dtype(dtypes[4])) return 2;
  if ((ndims[0] != 2 && ndims[0] != 3) || ndims[1] != ndims[0] || ndims[2] != 4 || ndims[3] != 4) return 3;
  for (int i = 0; i < 4; ++i)
    if (shapes[3][i] != shapes[2][i]) return 4;
  const int64_t tokens = shapes[0][0], blocks = shapes[2][0], bs = shapes[2][1], row = shapes[2][2] * shapes[2][3];
  if (count(ndims[0], shapes[0]) != tokens * row || count(ndims[1], shapes[1]) != tokens * row ||
      count(ndims[4], shapes[4]) != tokens || count(ndims[5], shapes[5]) != tokens * row)
    return 4;
  for (int64_t i = 0; i < tokens; ++i)  // every slot checked before anything is written
    if (length_at(params[4], dtypes[4], i) >= blocks * bs) return 4;
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t slot = length_at(params[4], dtypes[4], i);
    for (int64_t c = 0; c < row; ++c) store(params[5], t, i * row + c, load(params[0], t, i * row + c));
    if (slot < 0) continue;
    for (int64_t c = 0; c < row; ++c) {
      store(params[2], ct, slot * row + c, load(params[0], t, i * row + c));
      store(params[3], ct, slot * row + c, load(params[1], t, i * row + c));
    }
  }
  return 0;
}

int paged_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 7) return 1;
  const Dtype t = dtype_of(dtypes[0]);
  if (t == BAD || dtype_of(dtypes[1]) != t || dtype_of(dtypes[2]) != t || dtype_of(dtypes[6]) != t) return 2;
  if (std::strcmp(dtypes[3], "int32") || std::strcmp(dtypes[4], "int32") || std::strcmp(dtypes[5], "float32"))
    return 2;
  if (ndims[0] != 3 || ndims[1] != 4 || ndims[2] != 4 || ndims[3] != 2 || ndims[4] != 1 || ndims[6] != 3) return 3;
  for (int i = 0; i < 4; ++i)
    if (shapes[2][i] != shapes[1][i]) return 4;
  const int64_t tokens = shapes[0][0], heads = shapes[0][1], d = shapes[0][2];
  const int64_t blocks = shapes[1][0], bs = shapes[1][1], kv_heads = shapes[1][2], m = shapes[3][1];
  if (count(ndims[5], shapes[5]) != 3) return 4;
  const float* attrs = static_cast<const float*>(params[5]);
  if (int64_t(attrs[0]) != heads || int64_t(attrs[2]) != kv_heads) return 6;
  const float scale = attrs[1];
  if (shapes[1][3] != d || kv_heads <= 0 || heads % kv_heads || shapes[3][0] != tokens || shapes[4][0] != tokens ||
      shapes[6][0] != tokens || shapes[6][1] != heads || shapes[6][2] != d)
    return 4;
  const int32_t* tables = static_cast<const int32_t*>(params[3]);
  const int32_t* lens = static_cast<const int32_t*>(params[4]);
  for (int64_t i = 0; i < tokens; ++i) {  // every block a query reads, checked first
    if (lens[i] < 0 || lens[i] > m * bs) return 4;
    for (int64_t j = 0; j * bs < lens[i]; ++j)
      if (tables[i * m + j] < 0 || tables[i * m + j] >= blocks) return 4;
  }
  const int64_t group = heads / kv_heads;
  parallel(tokens * heads, [&](int64_t task) {
    const int64_t i = task / heads, h = task % heads, kvh = h / group;
    std::vector<float> q(d), out(d), scores;
    for (int64_t c = 0; c < d; ++c) q[c] = load(params[0], t, (i * heads + h) * d + c);
    // position p's key: block tables[i][p / BS], row p % BS, kv head kvh
    scores.assign(size_t(lens[i]), 0.f);
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < lens[i]; ++p) {
      const int64_t base = ((int64_t(tables[i * m + p / bs]) * bs + p % bs) * kv_heads + kvh) * d;
      float s = 0.f;
      for (int64_t c = 0; c < d; ++c) s += q[c] * load(params[1], t, base + c);
      scores[p] = s * scale;
      top = std::max(top, scores[p]);
    }
    for (int64_t c = 0; c < d; ++c) out[c] = 0.f;
    float total = 0.f;
    for (int64_t p = 0; p < lens[i]; ++p) {
      const int64_t base = ((int64_t(tables[i * m + p / bs]) * bs + p % bs) * kv_heads + kvh) * d;
      const float e = std::exp(scores[p] - top);
      total += e;
      for (int64_t c = 0; c < d; ++c) out[c] += e * load(params[2], t, base + c);
    }
    for (int64_t c = 0; c < d; ++c) store(params[6], t, (i * heads + h) * d + c, total > 0.f ? out[c] / total : 0.f);
  });
  return 0;
}

// ---- a mixture of experts' fused operators (export/network/moe.py FusedExperts) -------------------------------

// MoeGatingTopKSoftmax: x [..., E] T, attrs [k] -> y [..., k] T, expert_idx [..., k] int32, row_idx [..., k] int32.
// Per row: the softmax of x in float32, then its k largest, in descending order (equal probabilities: the lower
// expert first, as torch.topk and the reference order them); row_idx[i][j] = j * rows + i (the row's j-th choice in
// the column-major numbering MoeInitRouting reads). `finished` (a mask of rows to skip) is not implemented.
int moe_gating_top_k_softmax(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 5) return 1;
  const Dtype t = dtype_of(dtypes[0]);
  if (t == BAD || std::strcmp(dtypes[1], "float32") || dtype_of(dtypes[2]) != t || std::strcmp(dtypes[3], "int32") ||
      std::strcmp(dtypes[4], "int32"))
    return 2;
  if (ndims[0] < 2 || ndims[0] > 3 || ndims[2] != ndims[0] || ndims[3] != ndims[0] || ndims[4] != ndims[0]) return 3;
  if (count(ndims[1], shapes[1]) != 1) return 4;
  const int64_t experts = shapes[0][ndims[0] - 1], rows = count(ndims[0], shapes[0]) / std::max<int64_t>(experts, 1);
  const int64_t k = int64_t(static_cast<const float*>(params[1])[0]);
  if (k < 1 || k > experts) return 6;
  for (int o = 2; o < 5; ++o) {
    for (int i = 0; i + 1 < ndims[0]; ++i)
      if (shapes[o][i] != shapes[0][i]) return 4;
    if (shapes[o][ndims[0] - 1] != k) return 4;
  }
  int32_t* index = static_cast<int32_t*>(params[3]);
  int32_t* row_idx = static_cast<int32_t*>(params[4]);
  std::vector<float> p(experts);
  std::vector<int64_t> order(experts);
  for (int64_t i = 0; i < rows; ++i) {
    float top = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t e = 0; e < experts; ++e) top = std::max(top, p[e] = load(params[0], t, i * experts + e));
    for (int64_t e = 0; e < experts; ++e) total += p[e] = std::exp(p[e] - top);
    for (int64_t e = 0; e < experts; ++e) p[e] /= total, order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    for (int64_t j = 0; j < k; ++j) {
      store(params[2], t, i * k + j, p[order[j]]);
      index[i * k + j] = int32_t(order[j]);
      row_idx[i * k + j] = int32_t(j * rows + i);
    }
  }
  return 0;
}

// MoeInitRoutingV2, dropless (drop_pad_mode 0, active_num 0): x [N, H] T, expert_idx [N, k] int32, attrs
// [active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag,
// expert_tokens_before_capacity_flag] -> expanded_x [N * k, H] T, expanded_row_idx [N * k] int32,
// expert_tokens_count_or_cumsum [E] int32, expert_tokens_before_capacity [E] int32. The N * k choices, numbered
// i * k + j, sorted by expert, stably (an expert's choices in that order): expanded_x[p] is the row of the p-th,
// expanded_row_idx[i * k + j] the p at which choice (i, j) went (MindSpore's example, drop/pad mode, shows that
// direction); the counts (flag 2) or their running sums (flag 1) per expert; before_capacity (a drop/pad output)
// zeros. An expert id outside [0, expert_num) is refused (4) before anything is written.
int moe_init_routing_v2(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 7) return 1;
  const Dtype t = dtype_of(dtypes[0]);
  if (t == BAD || std::strcmp(dtypes[1], "int32") || std::strcmp(dtypes[2], "float32") || dtype_of(dtypes[3]) != t ||
      std::strcmp(dtypes[4], "int32") || std::strcmp(dtypes[5], "int32") || std::strcmp(dtypes[6], "int32"))
    return 2;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[3] != 2 || ndims[4] != 1 || ndims[5] != 1 || ndims[6] != 1) return 3;
  if (count(ndims[2], shapes[2]) != 6) return 4;
  const float* attrs = static_cast<const float*>(params[2]);
  const int64_t active = int64_t(attrs[0]), experts = int64_t(attrs[2]), drop_pad = int64_t(attrs[3]);
  const int64_t flag = int64_t(attrs[4]);
  if (active != 0 || drop_pad != 0 || flag < 0 || flag > 2) return 6;
  const int64_t n = shapes[0][0], h = shapes[0][1], k = shapes[1][1];
  if (shapes[1][0] != n || shapes[3][0] != n * k || shapes[3][1] != h || shapes[4][0] != n * k ||
      shapes[5][0] != experts || shapes[6][0] != experts)
    return 4;
  const int32_t* chosen = static_cast<const int32_t*>(params[1]);
  for (int64_t c = 0; c < n * k; ++c)
    if (chosen[c] < 0 || chosen[c] >= experts) return 4;
  std::vector<int64_t> order(n * k);
  for (int64_t c = 0; c < n * k; ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return chosen[a] < chosen[b]; });
  int32_t* where = static_cast<int32_t*>(params[4]);
  const int64_t row_bytes = h * (t == F32 ? 4 : 2);
  for (int64_t p = 0; p < n * k; ++p) {
    std::memcpy(static_cast<uint8_t*>(params[3]) + p * row_bytes,
                static_cast<const uint8_t*>(params[0]) + (order[p] / k) * row_bytes, row_bytes);
    where[order[p]] = int32_t(p);
  }
  int32_t* tokens = static_cast<int32_t*>(params[5]);
  std::fill(tokens, tokens + experts, 0);
  for (int64_t c = 0; c < n * k; ++c) ++tokens[chosen[c]];
  if (flag == 1)
    for (int64_t e = 1; e < experts; ++e) tokens[e] += tokens[e - 1];
  int32_t* before = static_cast<int32_t*>(params[6]);
  std::fill(before, before + experts, 0);
  return 0;
}

// GroupedMatmulV4, one tensor per list grouped along M (split_item 3, group_type 0): x [M, K] T, weight [E, K, N] (T,
// or int8 / int4 for weight-only quantization), group_list [E] int64 (group_list_type 1: rows per group; 0: running
// sums), optionally antiquant_scale [E, N] or [E, G, N] T with antiquant_offset of its shape (weight = (w + offset)
// * scale, G groups of K / G inputs), attrs [split_item, group_type, group_list_type, act_type] -> y [M, N] T: group
// e's rows (consecutive, in order) times weight e, float32 sums; rows past the last group are zeros. int4 weights are
// [E, K, N / 2] uint8, two per byte along N, the lower nibble first (MindSpore's qint4x2), signed.
int grouped_matmul_v4(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 5 && nparam != 6 && nparam != 7) return 1;
  const bool quant = nparam > 5, offset = nparam == 7;
  const int attrs_at = nparam - 2, y_at = nparam - 1;
  const Dtype t = dtype_of(dtypes[0]);
  const bool int8 = !std::strcmp(dtypes[1], "int8"), int4 = !std::strcmp(dtypes[1], "uint8");
  if (t == BAD || dtype_of(dtypes[y_at]) != t || std::strcmp(dtypes[2], "int64") ||
      std::strcmp(dtypes[attrs_at], "float32"))
    return 2;
  if (quant ? !(int8 || int4) || dtype_of(dtypes[3]) != t || (offset && dtype_of(dtypes[4]) != t)
            : dtype_of(dtypes[1]) != t)
    return 2;
  if (ndims[0] != 2 || ndims[1] != 3 || ndims[2] != 1 || ndims[y_at] != 2) return 3;
  const float* attrs = static_cast<const float*>(params[attrs_at]);
  if (count(ndims[attrs_at], shapes[attrs_at]) != 4) return 4;
  const int64_t list_type = int64_t(attrs[2]);
  if (int64_t(attrs[0]) != 3 || int64_t(attrs[1]) != 0 || (list_type != 0 && list_type != 1) || int64_t(attrs[3]))
    return 6;
  const int64_t m = shapes[0][0], kk = shapes[0][1], experts = shapes[1][0];
  const int64_t nn = shapes[1][2] * (int4 ? 2 : 1);
  if (shapes[1][1] != kk || shapes[2][0] != experts || shapes[y_at][0] != m || shapes[y_at][1] != nn) return 4;
  int64_t groups = 1;
  if (quant) {
    for (int j = 3; j < 3 + (offset ? 2 : 1); ++j)
      if (ndims[j] == 2 ? shapes[j][0] != experts || shapes[j][1] != nn
                        : ndims[j] != 3 || shapes[j][0] != experts || shapes[j][2] != nn)
        return 4;
    if (offset && (ndims[4] != ndims[3] || (ndims[3] == 3 && shapes[4][1] != shapes[3][1]))) return 4;
    groups = ndims[3] == 3 ? shapes[3][1] : 1;
    if (groups < 1 || kk % groups) return 4;
  }
  const int64_t* list = static_cast<const int64_t*>(params[2]);
  std::vector<int64_t> ends(experts);
  for (int64_t e = 0, at = 0; e < experts; ++e) {  // each group's end row, checked before anything is written
    at = list_type == 1 ? at + list[e] : list[e];
    if (at < (e ? ends[e - 1] : 0) || at > m) return 4;
    ends[e] = at;
  }
  const int64_t per_group = kk / groups;
  parallel(m, [&](int64_t row) {
    const int64_t e = std::upper_bound(ends.begin(), ends.end(), row) - ends.begin();  // the group holding `row`
    std::vector<float> out(nn, 0.f);
    if (e < experts) {
      for (int64_t c = 0; c < kk; ++c) {
        const float xv = load(params[0], t, row * kk + c);
        for (int64_t o = 0; o < nn; ++o) {
          float w;
          if (!quant) {
            w = load(params[1], t, (e * kk + c) * nn + o);
          } else {
            float q;
            if (int8) {
              q = float(static_cast<const int8_t*>(params[1])[(e * kk + c) * nn + o]);
            } else {
              const uint8_t byte = static_cast<const uint8_t*>(params[1])[(e * kk + c) * (nn / 2) + o / 2];
              const int nib = (o % 2) ? byte >> 4 : byte & 15;
              q = float(nib >= 8 ? nib - 16 : nib);
            }
            const int64_t s = (e * groups + c / per_group) * nn + o;
            w = (q + (offset ? load(params[4], t, s) : 0.f)) * load(params[3], t, s);
          }
          out[o] += xv * w;
        }
      }
    }
    for (int64_t o = 0; o < nn; ++o) store(params[y_at], t, row * nn + o, out[o]);
  });
  return 0;
}

// MoeTokenUnpermute (padded_mode false): permuted_tokens [M, H] T, sorted_indices [M] int32, probs [N, k] (T or
// float32; without it k = 1 and weights 1), attrs [padded_mode] -> out [N, H] T, N = M / k: out[i] = sum over j of
// permuted_tokens[sorted_indices[i * k + j]] * probs[i][j], in float32 (sorted_indices as MoeInitRoutingV2's
// expanded_row_idx gives it: where each choice's row went). As CANN's kernel does, a term whose index is outside
// [0, M) or whose probability is exactly 0 is skipped (an index past the rows: a choice another expert-parallel rank
// computes).
int moe_token_unpermute(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 4 && nparam != 5) return 1;
  const bool probs = nparam == 5;
  const int attrs_at = nparam - 2, y_at = nparam - 1;
  const Dtype t = dtype_of(dtypes[0]), pt = probs ? dtype_of(dtypes[2]) : F32;
  if (t == BAD || pt == BAD || std::strcmp(dtypes[1], "int32") || std::strcmp(dtypes[attrs_at], "float32") ||
      dtype_of(dtypes[y_at]) != t)
    return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || (probs && ndims[2] != 2) || ndims[y_at] != 2) return 3;
  if (count(ndims[attrs_at], shapes[attrs_at]) != 1) return 4;
  if (static_cast<const float*>(params[attrs_at])[0] != 0.f) return 6;
  const int64_t m = shapes[0][0], h = shapes[0][1];
  const int64_t n = shapes[y_at][0], k = probs ? shapes[2][1] : 1;
  if (shapes[1][0] != m || n * k != m || shapes[y_at][1] != h || (probs && shapes[2][0] != n)) return 4;
  const int32_t* index = static_cast<const int32_t*>(params[1]);
  parallel(n, [&](int64_t i) {
    std::vector<float> out(h, 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const float w = probs ? load(params[2], pt, i * k + j) : 1.f;
      const int64_t src = index[i * k + j];
      if (src < 0 || src >= m || w == 0.f) continue;
      for (int64_t c = 0; c < h; ++c) out[c] += load(params[0], t, src * h + c) * w;
    }
    for (int64_t c = 0; c < h; ++c) store(params[y_at], t, i * h + c, out[c]);
  });
  return 0;
}

}  // namespace

extern "C" {

int MsliteLlmAtlasReshapeAndCache(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                                  void*) {
  return reshape_and_cache(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasPagedAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                                 void*) {
  return paged_attention(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasPromptFlashAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                       void*, void*) {
  return prompt_flash_attention(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasRmsNorm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return rms_norm(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasAddRmsNorm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                             void*) {
  return add_rms_norm(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasRotaryPositionEmbedding(int nparam, void** params, int* ndims, int64_t** shapes,
                                          const char** dtypes, void*, void*) {
  return rotary_position_embedding(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasMoeGatingTopKSoftmax(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                       void*, void*) {
  return moe_gating_top_k_softmax(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasMoeInitRoutingV2(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                   void*, void*) {
  return moe_init_routing_v2(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasGroupedMatmulV4(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                                  void*) {
  return grouped_matmul_v4(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmAtlasMoeTokenUnpermute(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                    void*, void*) {
  return moe_token_unpermute(nparam, params, ndims, shapes, dtypes);
}

}  // extern "C"
