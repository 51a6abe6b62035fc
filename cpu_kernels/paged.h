// The paged KV cache as this project's CPU kernels hold it (docs/architecture.md, "The KV cache: a pool of blocks"):
// key_cache and value_cache [NB, KH, BS, D] float32, NB blocks of BS positions, each kv head's positions of a block
// contiguous (one [BS, D] matrix: what the attention's scores read as weight rows). A token's slot is block * BS +
// position in the block; a sequence's block table lists its blocks in order. decode_ops.cc writes through slots,
// attention.cc reads through block tables.
#ifndef MSLITE_LLM_CPU_KERNELS_PAGED_H_
#define MSLITE_LLM_CPU_KERNELS_PAGED_H_

#include "common.h"

namespace msllm {

struct PagedCache {
  int64_t blocks = 0, kv_heads = 0, block_size = 0, d = 0;

  bool ok() const { return blocks > 0 && kv_heads > 0 && block_size > 0 && d > 0; }
  int64_t slots() const { return blocks * block_size; }
  // where position p of kv head h of block b begins
  int64_t at(int64_t b, int64_t h, int64_t p) const { return ((b * kv_heads + h) * block_size + p) * d; }
};

inline PagedCache paged_cache(const int64_t* shape) {
  PagedCache c;
  c.blocks = shape[0], c.kv_heads = shape[1], c.block_size = shape[2], c.d = shape[3];
  return c;
}

// k, v [rows, KH * D] into the caches at each row's slot (a negative slot: not written); slots checked by the caller
inline void write_paged(const PagedCache& c, const float* k, const float* v, int64_t rows, const int32_t* slots,
                        float* kc, float* vc) {
  for (int64_t r = 0; r < rows; ++r) {
    if (slots[r] < 0) continue;
    const int64_t b = slots[r] / c.block_size, p = slots[r] % c.block_size;
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      std::memcpy(kc + c.at(b, h, p), k + (r * c.kv_heads + h) * c.d, size_t(c.d) * sizeof(float));
      std::memcpy(vc + c.at(b, h, p), v + (r * c.kv_heads + h) * c.d, size_t(c.d) * sizeof(float));
    }
  }
}

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_PAGED_H_
