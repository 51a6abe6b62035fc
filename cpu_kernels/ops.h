// The Custom op bodies each kernel family defines, for registry.cc, which exports them as extern "C" functions.
// Each takes MindSpore's aot CPU arguments (nparam, params, ndims, shapes, dtypes; registry.cc lists the tensors)
// and returns 0, or the error code registry.cc's comment gives.
#ifndef MSLITE_LLM_CPU_KERNELS_OPS_H_
#define MSLITE_LLM_CPU_KERNELS_OPS_H_

#include <cstdint>
#include <vector>

namespace msllm {

// matmul16.cc: float32/float16/bfloat16 weights
int gemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_bias,
         bool prompt_rows);
int embed(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
// ids, q int8 [V, E] | uint8 [V, E / 2] (int4), scale [G, V] f32 (, offset [G, V] f32), y f32: matmul16.cc
int embed_quant(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

// attention.cc
int decode_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

// decode_ops.cc
int rms_norm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int qkv_rope(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int gemv_add(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int decode_qkv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int write_cache(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int norm_swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int decode_tail(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int decode_layer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

// While alive, qkv_rope, decode_qkv and decode_tail (so decode_layer) compute their first `rows` rows of x only and
// write zeros past them, and decode_qkv writes no cache slot past them (registry.cc's *Valid ops: a chunk graph's
// step rows and its piece's valid tokens, the padding after them); per thread, as R16Call.
struct ValidRows {
  explicit ValidRows(int64_t rows);
  ~ValidRows();
};
// rows, or the live ValidRows' count where that is smaller (at least 0)
int64_t valid_rows(int64_t rows);

// int8/int4 weights: the op body in matmul16.cc (its matmul() dispatches by rows), the rest in matmul_quant.cc
int quant_matmul_op(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_offset,
                    bool prompt_rows);
int weight_quant_batch_matmul(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

// A composite op's call of one op body (decode_layer; moe.cc's decode_moe_layer): the body's tensors gathered from
// the composite's own (`take`) and from float32 buffers between the bodies (`scratch`), as MindSpore would hand
// them; the lists kept per thread, so a warm call allocates nothing. `run` calls the body and empties the lists.
class SubCall {
 public:
  typedef int (*Body)(int, void**, int*, int64_t**, const char**);
  SubCall(void** params, int* ndims, int64_t** shapes, const char** dtypes)
      : params_(params), ndims_(ndims), shapes_(shapes), dtypes_(dtypes) {
    lists().clear();
  }
  SubCall& take(int i) {
    Lists& l = lists();
    l.p.push_back(params_[i]), l.nd.push_back(ndims_[i]), l.sh.push_back(shapes_[i]), l.dt.push_back(dtypes_[i]);
    return *this;
  }
  SubCall& take(int from, int to) {  // tensors [from, to)
    for (int i = from; i < to; ++i) take(i);
    return *this;
  }
  SubCall& scratch(float* buf, int64_t* shape) {  // a float32 [shape[0], shape[1]] buffer
    Lists& l = lists();
    l.p.push_back(buf), l.nd.push_back(2), l.sh.push_back(shape), l.dt.push_back("float32");
    return *this;
  }
  int run(Body body) {
    Lists& l = lists();
    const int rc = body(int(l.p.size()), l.p.data(), l.nd.data(), l.sh.data(), l.dt.data());
    l.clear();
    return rc;
  }

 private:
  struct Lists {
    std::vector<void*> p;
    std::vector<int> nd;
    std::vector<int64_t*> sh;
    std::vector<const char*> dt;
    void clear() { p.clear(), nd.clear(), sh.clear(), dt.clear(); }
  };
  static Lists& lists() {
    thread_local Lists l;
    return l;
  }
  void** params_;
  int* ndims_;
  int64_t** shapes_;
  const char** dtypes_;
};

// decode_ops.cc: the first half of a decode step's layer, shared by decode_layer and moe.cc's decode_moe_layer:
// decode_qkv on params[1, 1 + nq) (x first; key_cache at 1 + kc, value_cache after it), then the attention with the
// lengths, rows and tables after them. Its output [N, H*D] is left in a per-thread buffer: *attn, its shape in
// attn_shape. 0, or the sub-ops' code.
int decode_attend(void** params, int* ndims, int64_t** shapes, const char** dtypes, int nq, int kc, float** attn,
                  int64_t* attn_shape);

// moe.cc: a mixture of experts' sparse MLP (the router, the routing, the chosen experts; float or quantized)
int moe(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);
int decode_moe_layer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_OPS_H_
