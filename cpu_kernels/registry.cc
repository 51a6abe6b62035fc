// Every extern "C" entry of mslite-llm's CPU kernel library but atlas_ops.cc's (what MindSpore's aot Custom ops and
// cpu_kernels/__init__.py call): thin wrappers over the kernel families' op bodies (ops.h), the code path, the thread
// count and the in-graph timing. Nothing else lives here: a kernel change touches its family's file, not this one.
// atlas_ops.cc keeps its own entries (the Ascend operators' stand-ins: plain C++, a self-contained file).
//
// Interface (MindSpore aot CPU): int F(int nparam, void** params, int* ndims, int64_t** shapes,
// const char** dtypes, void* stream, void* extra); 0 on success, else 1 wrong number of tensors,
// 2 unsupported dtype, 3 wrong ranks, 4 shapes that do not fit, 5 an id outside the table.
//   MsliteLlmGemv:     params = x [M, I] f32, W [O, I] f32/f16/bf16, y [M, O] f32
//   MsliteLlmGemvBias: params = x [M, I] f32, W [O, I] f32/f16/bf16, b [O] f32, y [M, O] f32
//   MsliteLlmEmbed:    params = ids [N] int32/int64, table [V, E] f32/f16/bf16, y [N, E] f32
//                      (ids may have any rank; y is ids' shape plus [E])
//   MsliteLlmEmbedQuant: params = ids, q [V, E] int8 | [V, E / 2] uint8 (int4, input 2j low nibble), scale [G, V]
//                      f32 (, offset [G, V] f32), y [N, E] f32 = (q + offset) * scale per group of E / G inputs
// The decode step's fused ops (decode_ops.cc): MsliteLlmRmsNorm, MsliteLlmQkvRope, MsliteLlmGemvAdd,
// MsliteLlmSwiGlu, MsliteLlmPagedDecodeQkv, MsliteLlmWriteCache, MsliteLlmNormSwiGlu, MsliteLlmDecodeTail (and
// MsliteLlmQkvRopeValid, MsliteLlmPagedDecodeLayerValid: the chunk graph's, a row count first); the attention
// over the paged cache (attention.cc): MsliteLlmPagedAttention; those that read or write the cache under a second
// name for bfloat16 caches (...Kv16); cpu_kernels/__init__.py lists their tensors. The int8/int4 matmuls
// (matmul_quant.cc, whose comment lists their tensors and one more error code): MsliteLlmQuantMatmul,
// MsliteLlmQuantMatmulOffset, MsliteLlmAtlasWeightQuantBatchMatmul.
#include <chrono>

#include "common.h"
#include "matmul16.h"
#include "matmul_quant.h"
#include "ops.h"
#include "pool.h"

using namespace msllm;

namespace {

// ---- timing the kernels in a graph (benchmarks/bench_decode_step.py --in_graph) ------------------------------
// With MSLITE_LLM_CPU_KERNELS_PROFILE=1 (read at load) each exported op adds its calls and wall time to a counter:
// what our kernels cost inside MindSpore's graph, against the step's whole time. Off: one predictable branch. (The
// float kernels' ops; the quantized matmuls are not counted.)
// The last slot, OP_GAP, is not an op: the time from the end of one of our ops to the start of the next, when under
// 2 ms (inside one graph call): what MindSpore's runtime spends between our kernels.
enum Op { OP_GEMV, OP_GEMV_BIAS, OP_GEMM_VALID, OP_EMBED, OP_RMS_NORM, OP_QKV_ROPE, OP_GEMV_ADD, OP_SWIGLU,
          OP_ATTENTION, OP_DECODE_QKV, OP_NORM_SWIGLU, OP_DECODE_TAIL, OP_QUANT_MATMUL, OP_DECODE_LAYER, OP_MOE, OP_GAP,
          OP_COUNT };
const bool g_profile = std::getenv("MSLITE_LLM_CPU_KERNELS_PROFILE") != nullptr;
std::atomic<int64_t> g_profile_ns[OP_COUNT], g_profile_calls[OP_COUNT], g_last_end{0};

template <class F>
int timed(Op op, F&& f) {
  if (!g_profile) return f();
  using clock = std::chrono::steady_clock;
  const auto ns = [](clock::time_point t) {
    return int64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
  };
  const int64_t t0 = ns(clock::now());
  const int64_t gap = t0 - g_last_end.load();
  if (g_last_end.load() && gap < 2000000) g_profile_ns[OP_GAP] += gap, g_profile_calls[OP_GAP] += 1;
  const int rc = f();
  const int64_t t1 = ns(clock::now());
  g_profile_ns[op] += t1 - t0;
  g_profile_calls[op] += 1;
  g_last_end = t1;
  return rc;
}

// the *Valid ops' call (below): valid int32 [1] first, the body's tensors after it
template <class F>
int with_valid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, F body) {
  if (nparam < 2) return 1;
  if (std::strcmp(dtypes[0], "int32") != 0) return 2;
  if (ndims[0] != 1) return 3;
  if (shapes[0][0] != 1) return 4;
  ValidRows live(*static_cast<const int32_t*>(params[0]));
  return body(nparam - 1, params + 1, ndims + 1, shapes + 1, dtypes + 1);
}

}  // namespace

extern "C" {

int MsliteLlmGemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_GEMV, [&] { return gemv(nparam, params, ndims, shapes, dtypes, false, false); });
}

int MsliteLlmGemvBias(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_GEMV_BIAS, [&] { return gemv(nparam, params, ndims, shapes, dtypes, true, false); });
}

int MsliteLlmGemmValid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  // with the bias: 5 params
  return timed(OP_GEMM_VALID, [&] { return gemv(nparam, params, ndims, shapes, dtypes, nparam == 5, true); });
}

int MsliteLlmEmbed(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_EMBED, [&] { return embed(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmEmbedQuant(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                        void*) {
  return timed(OP_EMBED, [&] { return embed_quant(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmRmsNorm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_RMS_NORM, [&] { return rms_norm(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmQkvRope(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_QKV_ROPE, [&] { return qkv_rope(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmGemvAdd(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_GEMV_ADD, [&] { return gemv_add(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmSwiGlu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_SWIGLU, [&] { return swiglu(nparam, params, ndims, shapes, dtypes); });
}

// The paged cache's ops (paged.h): names of their own, so an installation from before the paged cache refuses a
// folder that calls them when it loads (cpu_kernels.unknown_functions), and a folder from before is refused by its
// format version.
int MsliteLlmPagedAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                            void*) {
  return timed(OP_ATTENTION, [&] { return decode_attention(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmPagedDecodeQkv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                            void*) {
  return timed(OP_DECODE_QKV, [&] { return decode_qkv(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmWriteCache(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return write_cache(nparam, params, ndims, shapes, dtypes);
}

int MsliteLlmNormSwiGlu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_NORM_SWIGLU, [&] { return norm_swiglu(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmDecodeTail(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_DECODE_TAIL, [&] { return decode_tail(nparam, params, ndims, shapes, dtypes); });
}

// The chunk graph's layer in one call, and its q/k/v where a layer takes several calls, under names of their own
// (export/network/layers.py: its piece is right-padded to the graph's tokens): valid int32 [1], the rows that hold a
// token (the step rows, then the piece's valid ones), then the op's own tensors. Rows past it are not computed and
// come out zero (ops.h ValidRows), so a piece costs its tokens, not the graph's size. An installation from before
// them refuses such a folder when it loads.
int MsliteLlmQkvRopeValid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                          void*) {
  return timed(OP_QKV_ROPE, [&] { return with_valid(nparam, params, ndims, shapes, dtypes, qkv_rope); });
}

int MsliteLlmPagedDecodeLayerValid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                   void*, void*) {
  return timed(OP_DECODE_LAYER, [&] { return with_valid(nparam, params, ndims, shapes, dtypes, decode_layer); });
}

// A decode step's layer in one call (decode_ops.cc decode_layer): MsliteLlmPagedDecodeQkv's, MsliteLlmPagedAttention's
// and MsliteLlmDecodeTail's tensors after a layout int32 [3].
int MsliteLlmPagedDecodeLayer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                              void*) {
  return timed(OP_DECODE_LAYER, [&] { return decode_layer(nparam, params, ndims, shapes, dtypes); });
}

// The fused ops under the names quantized folders' graphs call (cpu_kernels.QUANTIZED_OPS): the same bodies, which
// read a weight's q, scale[, offset]. An installation from before they could lacks these names, so it refuses such a
// folder when it loads, naming them (cpu_kernels.unknown_functions), instead of failing at the first step.
int MsliteLlmQuantQkvRope(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* s,
                          void* e) {
  return MsliteLlmQkvRope(nparam, params, ndims, shapes, dtypes, s, e);
}

int MsliteLlmQuantGemvAdd(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* s,
                          void* e) {
  return MsliteLlmGemvAdd(nparam, params, ndims, shapes, dtypes, s, e);
}

int MsliteLlmQuantPagedDecodeQkv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                 void* s, void* e) {
  return MsliteLlmPagedDecodeQkv(nparam, params, ndims, shapes, dtypes, s, e);
}

int MsliteLlmQuantPagedDecodeLayer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                   void* s, void* e) {
  return MsliteLlmPagedDecodeLayer(nparam, params, ndims, shapes, dtypes, s, e);
}

int MsliteLlmQuantNormSwiGlu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* s,
                             void* e) {
  return MsliteLlmNormSwiGlu(nparam, params, ndims, shapes, dtypes, s, e);
}

int MsliteLlmQuantDecodeTail(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* s,
                             void* e) {
  return MsliteLlmDecodeTail(nparam, params, ndims, shapes, dtypes, s, e);
}

int MsliteLlmQuantQkvRopeValid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* s,
                               void* e) {
  return MsliteLlmQkvRopeValid(nparam, params, ndims, shapes, dtypes, s, e);
}

int MsliteLlmQuantPagedDecodeLayerValid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                        void* s, void* e) {
  return MsliteLlmPagedDecodeLayerValid(nparam, params, ndims, shapes, dtypes, s, e);
}

int MsliteLlmQuantMatmul(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_QUANT_MATMUL, [&] { return quant_matmul_op(nparam, params, ndims, shapes, dtypes, false, false); });
}

int MsliteLlmQuantMatmulOffset(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                               void*) {
  return timed(OP_QUANT_MATMUL, [&] { return quant_matmul_op(nparam, params, ndims, shapes, dtypes, true, false); });
}

int MsliteLlmQuantMatmulValid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                              void*) {
  return timed(OP_QUANT_MATMUL, [&] { return quant_matmul_op(nparam, params, ndims, shapes, dtypes, false, true); });
}

int MsliteLlmQuantMatmulOffsetValid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                    void*, void*) {
  return timed(OP_QUANT_MATMUL, [&] { return quant_matmul_op(nparam, params, ndims, shapes, dtypes, true, true); });
}

// A mixture of experts' sparse MLP (moe.cc, whose comment lists the tensors): layout [3], x (or h, ln_w, eps), the
// router, gate_up, down (each one float tensor or q, scale[, offset]), y.
int MsliteLlmMoe(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_MOE, [&] { return moe(nparam, params, ndims, shapes, dtypes); });
}

// A mixture of experts' decode step layer in one call (moe.cc decode_moe_layer): layout int32 [4], then
// MsliteLlmPagedDecodeQkv's, the attention's, o_proj's and MsliteLlmMoe's tensors (timed as a whole layer).
int MsliteLlmPagedDecodeMoeLayer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                                 void*) {
  return timed(OP_DECODE_LAYER, [&] { return decode_moe_layer(nparam, params, ndims, shapes, dtypes); });
}

// The ops that read or write the paged cache once more, under the names a graph with bfloat16 caches calls
// (cpu_kernels.KV16_OPS; paged.h: a folder of a bfloat16 dtype keeps its KV cache so): the same bodies, which
// take either cache dtype. An installation whose kernels read float32 caches only lacks these names, so it refuses
// such a folder when it loads, naming them (cpu_kernels.unknown_functions), instead of failing at its first step.
#define MSLLM_KV16(name)                                                                                            \
  int name##Kv16(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* s, void* e) { \
    return name(nparam, params, ndims, shapes, dtypes, s, e);                                                     \
  }
MSLLM_KV16(MsliteLlmPagedAttention)
MSLLM_KV16(MsliteLlmPagedDecodeQkv)
MSLLM_KV16(MsliteLlmWriteCache)
MSLLM_KV16(MsliteLlmPagedDecodeLayer)
MSLLM_KV16(MsliteLlmPagedDecodeLayerValid)
MSLLM_KV16(MsliteLlmPagedDecodeMoeLayer)
MSLLM_KV16(MsliteLlmQuantPagedDecodeQkv)
MSLLM_KV16(MsliteLlmQuantPagedDecodeLayer)
MSLLM_KV16(MsliteLlmQuantPagedDecodeLayerValid)
#undef MSLLM_KV16

// The quantized ops once more, for weights in bands of 16 rows (matmul_quant.h repack_int4_r16, repack_int8_r16):
// names the runtime gives a graph's ops at load after it repacked every quantized weight they read
// (lite_runtime/backends/ms.py _repacked_weights); never in a folder as exported. The same bodies, the weights read as
// banded.
#define MSLLM_R16(name)                                                                                            \
  int name##R16(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* s, void* e) { \
    R16Call banded;                                                                                              \
    return name(nparam, params, ndims, shapes, dtypes, s, e);                                                    \
  }
MSLLM_R16(MsliteLlmQuantQkvRope)
MSLLM_R16(MsliteLlmQuantGemvAdd)
MSLLM_R16(MsliteLlmQuantPagedDecodeQkv)
MSLLM_R16(MsliteLlmQuantPagedDecodeLayer)
MSLLM_R16(MsliteLlmQuantNormSwiGlu)
MSLLM_R16(MsliteLlmQuantDecodeTail)
MSLLM_R16(MsliteLlmQuantQkvRopeValid)
MSLLM_R16(MsliteLlmQuantPagedDecodeLayerValid)
MSLLM_R16(MsliteLlmQuantMatmul)
MSLLM_R16(MsliteLlmQuantMatmulOffset)
MSLLM_R16(MsliteLlmQuantMatmulValid)
MSLLM_R16(MsliteLlmQuantMatmulOffsetValid)
MSLLM_R16(MsliteLlmMoe)
MSLLM_R16(MsliteLlmPagedDecodeMoeLayer)
MSLLM_R16(MsliteLlmQuantPagedDecodeQkvKv16)
MSLLM_R16(MsliteLlmQuantPagedDecodeLayerKv16)
MSLLM_R16(MsliteLlmQuantPagedDecodeLayerValidKv16)
MSLLM_R16(MsliteLlmPagedDecodeMoeLayerKv16)
#undef MSLLM_R16

// Repacks int4 q [n, k / 2] in place into bands of 16 rows: 0, or 4 when k is not a multiple of 32 (nothing changed).
int MsliteLlmRepackInt4R16(void* q, int64_t n, int64_t k) {
  return repack_int4_r16(static_cast<uint8_t*>(q), n, k) ? 0 : 4;
}

// 1 when int4 weights of k inputs in groups of `group` take the banded form here, in the default activations mode
int MsliteLlmInt4R16Runs(int64_t k, int64_t group) { return r16_runs(k, group) ? 1 : 0; }

// Repacks int8 q [n, k] in place into bands of 16 rows, biased (matmul_quant.h repack_int8_r16): 0, or 4 when k is
// not a multiple of 32 (nothing changed)
int MsliteLlmRepackInt8R16(void* q, int64_t n, int64_t k) {
  return repack_int8_r16(static_cast<int8_t*>(q), n, k) ? 0 : 4;
}

// 1 when int8 weights of k inputs in groups of `group` take the banded form here, in the default activations mode
int MsliteLlmInt8R16Runs(int64_t k, int64_t group) { return int8_r16_runs(k, group) ? 1 : 0; }

int MsliteLlmAtlasWeightQuantBatchMatmul(int nparam, void** params, int* ndims, int64_t** shapes,
                                         const char** dtypes, void*, void*) {
  return weight_quant_batch_matmul(nparam, params, ndims, shapes, dtypes);
}

// One of our ops called with its weights as places in one arena (lite_runtime/backends/arena.py; docs/architecture.md
// "Weights handed over as one arena"): MindSpore's CPU runtime pays per tensor it hands a kernel (~0.5-1 us each once a
// step's weights have swept its caches, docs/performance-log.md 57), and a quantized layer op takes ~40. The runtime
// rewrites such a node at load to call this with
//   table int64 [T], arena uint8 [A], the op's other inputs in their order (passed), its outputs;
// the table: ARENA_MAGIC, the op's function (its address in this library), n (the op's inputs), passed (how many
// follow the arena), then per input of the op: where (0 passed: the next one; 1 arena, 2 table: at byte `offset`),
// offset, dtype (ArenaDtype), rank, dims[rank]; a table input's bytes (a folded Constant) after the entries. The op's
// tensor lists are rebuilt and it is called: the same pointers, the same results. Errors: 1 a table that does not
// fit the call, 2 a dtype code outside ArenaDtype, 3 a rank over 8, 4 a place outside the arena or the table.
namespace {
constexpr int64_t ARENA_MAGIC = 0x314e524141534d4cLL;  // "LMSAARN1" little-endian: a table of this version
constexpr const char* ARENA_DTYPES[] = {"float32", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
                                        "bool", "float64"};
constexpr int ARENA_MAX = 256;  // tensors of one op (inputs and outputs)
using AotOp = int (*)(int, void**, int*, int64_t**, const char**, void*, void*);
constexpr int64_t ARENA_SIZES[] = {4, 2, 2, 1, 1, 2, 4, 8, 1, 8};
}  // namespace

int MsliteLlmArenaCall(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                       void* extra) {
  if (nparam < 2 || ndims[0] != 1 || ndims[1] != 1) return 1;
  if (std::strcmp(dtypes[0], "int64") != 0 || std::strcmp(dtypes[1], "uint8") != 0) return 2;
  const int64_t* t = static_cast<const int64_t*>(params[0]);
  const int64_t tlen = shapes[0][0], alen = shapes[1][0];
  char* arena = static_cast<char*>(params[1]);
  if (tlen < 4 || t[0] != ARENA_MAGIC) return 1;
  const int64_t n = t[2], passed = t[3], outputs = nparam - 2 - passed;
  if (n < 0 || passed < 0 || outputs < 0 || n + outputs > ARENA_MAX) return 1;
  void* p[ARENA_MAX];
  int nd[ARENA_MAX];
  int64_t* sh[ARENA_MAX];
  const char* dt[ARENA_MAX];
  int64_t at = 4, next = 2;
  for (int64_t i = 0; i < n; ++i) {
    if (at + 4 > tlen) return 1;
    const int64_t where = t[at], offset = t[at + 1], dtype = t[at + 2], rank = t[at + 3];
    if (where == 0) {
      if (next >= 2 + passed) return 1;
      p[i] = params[next], nd[i] = ndims[next], sh[i] = shapes[next], dt[i] = dtypes[next];
      ++next, at += 4;
      continue;
    }
    if (dtype < 0 || dtype >= int64_t(sizeof(ARENA_DTYPES) / sizeof(*ARENA_DTYPES))) return 2;
    if (rank < 0 || rank > 8) return 3;
    if (at + 4 + rank > tlen) return 1;
    int64_t bytes = ARENA_SIZES[dtype];
    for (int64_t d = 0; d < rank; ++d) {
      const int64_t dim = t[at + 4 + d];
      if (dim < 0 || (dim && bytes > (int64_t(1) << 56) / dim)) return 4;
      bytes *= dim;
    }
    const int64_t limit = where == 1 ? alen : (where == 2 ? tlen * 8 : -1);
    if (limit < 0) return 1;
    if (offset < 0 || offset > limit || bytes > limit - offset) return 4;
    p[i] = (where == 1 ? arena : reinterpret_cast<char*>(const_cast<int64_t*>(t))) + offset;
    nd[i] = int(rank), sh[i] = const_cast<int64_t*>(t + at + 4), dt[i] = ARENA_DTYPES[dtype];
    at += 4 + rank;
  }
  if (next != 2 + passed) return 1;
  for (int64_t o = 0; o < outputs; ++o) {
    p[n + o] = params[next + o], nd[n + o] = ndims[next + o], sh[n + o] = shapes[next + o];
    dt[n + o] = dtypes[next + o];
  }
  const AotOp op = reinterpret_cast<AotOp>(static_cast<intptr_t>(t[1]));
  return op(int(n + outputs), p, nd, sh, dt, stream, extra);
}

// With MSLITE_LLM_CPU_KERNELS_PROFILE set: per op (in Op's order), calls and nanoseconds since the last reset into
// calls[OP_COUNT] and ns[OP_COUNT]; returns OP_COUNT, or 0 when profiling is off. reset: zero the counters after.
int MsliteLlmProfile(int64_t* calls, int64_t* ns, int reset) {
  if (!g_profile) return 0;
  for (int i = 0; i < OP_COUNT; ++i) {
    calls[i] = reset ? g_profile_calls[i].exchange(0) : g_profile_calls[i].load();
    ns[i] = reset ? g_profile_ns[i].exchange(0) : g_profile_ns[i].load();
  }
  return OP_COUNT;
}

// The code path this machine runs, for every family: "avx512", "avx2" (AVX2 + FMA + F16C), "neon" or "generic".
const char* MsliteLlmIsa() { return isa_name(isa()); }

// The quantized matmuls' decode form: "avx512_vnni" (AVX-512 with VNNI), "avx2", "neon" or "generic".
const char* MsliteLlmQuantForm() { return quant_form(); }
// AMX tiles for banded int8/int4 and bfloat16 weights on (1) or off (0), -1 asks: 1 where they are in force
int MsliteLlmSetTiles(int mode) {
  if (mode == 0 || mode == 1) tiles_switch().store(mode == 1);
  return tiles_on() && (int8_tiles_here() || bf16_tiles_here()) ? 1 : 0;
}

// The bfloat16 weights' form at several rows of x: "avx512_bf16" (x rounded to bfloat16) or "float32".
const char* MsliteLlmBf16Form() { return bf16_form(); }

// Threads the kernels use; 0 restores the default (the machine's cores). The runtime passes its CPU thread count.
void MsliteLlmSetThreads(int threads) { set_threads(threads); }

// How the quantized matmuls' decode form rounds x (matmul_quant.h Activations): 0 int8 (the default: int4 weights'
// x in int8 where they fit, the others' in int16), 1 exact (which also holds bfloat16 weights to float32's form), 2
// int16; a negative mode restores the default (MSLITE_LLM_QUANT_ACTIVATIONS, else int8). Returns the mode now in force.
int MsliteLlmSetQuantActivations(int mode) {
  if (mode != -2) set_quant_activations(mode);  // -2: only ask
  return quant_activations();
}

}  // extern "C"
