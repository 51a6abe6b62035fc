// The paged KV cache as this project's CPU kernels hold it (docs/architecture.md, "The KV cache: a pool of blocks"):
// key_cache and value_cache [NB, KH, BS, D], NB blocks of BS positions, each kv head's positions of a block
// contiguous (one [BS, D] matrix: what the attention's scores read as weight rows). A token's slot is block * BS +
// position in the block; a sequence's block table lists its blocks in order. decode_ops.cc writes through slots,
// attention.cc reads through block tables. float32, or bfloat16 (a folder with bfloat16 weights: half the bytes a
// step reads and twice the tokens a pool holds): k and v are computed in float32 and rounded to nearest even as they
// are written; the attention widens them (exactly) as it reads them.
#ifndef MSLITE_LLM_CPU_KERNELS_PAGED_H_
#define MSLITE_LLM_CPU_KERNELS_PAGED_H_

#include "common.h"
#include "dtypes.h"

namespace msllm {

struct PagedCache {
  int64_t blocks = 0, kv_heads = 0, block_size = 0, d = 0;
  bool bf16 = false;  // the caches' elements: bfloat16, else float32

  bool ok() const { return blocks > 0 && kv_heads > 0 && block_size > 0 && d > 0; }
  int64_t slots() const { return blocks * block_size; }
  // where position p of kv head h of block b begins
  int64_t at(int64_t b, int64_t h, int64_t p) const { return ((b * kv_heads + h) * block_size + p) * d; }
  int64_t elem_bytes() const { return bf16 ? 2 : 4; }
  // the first byte of position 0 of kv head h of block b in a cache
  const char* block(const void* cache, int64_t b, int64_t h) const {
    return static_cast<const char*>(cache) + at(b, h, 0) * elem_bytes();
  }
};

// the two caches' dtypes (both float32 or both bfloat16) into c.bf16; false for any other pair
inline bool paged_dtypes(const char* key, const char* value, PagedCache* c) {
  const Dtype k = dtype_of(key);
  if (k != dtype_of(value) || (k != F32 && k != BF16)) return false;
  c->bf16 = k == BF16;
  return true;
}

inline PagedCache paged_cache(const int64_t* shape) {
  PagedCache c;
  c.blocks = shape[0], c.kv_heads = shape[1], c.block_size = shape[2], c.d = shape[3];
  return c;
}

// k, v [rows, KH * D] float32 into the caches at each row's slot (a negative slot: not written; bfloat16 caches: each
// value rounded to nearest even, dtypes.h float_to_bf16, as a float32 -> bfloat16 Cast); slots checked by the caller
inline void write_paged(const PagedCache& c, const float* k, const float* v, int64_t rows, const int32_t* slots,
                        void* kc, void* vc) {
  for (int64_t r = 0; r < rows; ++r) {
    if (slots[r] < 0) continue;
    const int64_t b = slots[r] / c.block_size, p = slots[r] % c.block_size;
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      const float* kr = k + (r * c.kv_heads + h) * c.d;
      const float* vr = v + (r * c.kv_heads + h) * c.d;
      if (c.bf16) {
        uint16_t* kd = static_cast<uint16_t*>(kc) + c.at(b, h, p);
        uint16_t* vd = static_cast<uint16_t*>(vc) + c.at(b, h, p);
        for (int64_t i = 0; i < c.d; ++i) kd[i] = float_to_bf16(kr[i]), vd[i] = float_to_bf16(vr[i]);
      } else {
        std::memcpy(static_cast<float*>(kc) + c.at(b, h, p), kr, size_t(c.d) * sizeof(float));
        std::memcpy(static_cast<float*>(vc) + c.at(b, h, p), vr, size_t(c.d) * sizeof(float));
      }
    }
  }
}

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_PAGED_H_
