// The 16-bit float formats of the stand-ins' tensors (float16, bfloat16) read and written as float32, shared by
// atlas_ops.cc (the Ascend fused operators' stand-ins) and matmul_quant.cc (WeightQuantBatchMatmul's stand-in).
// Conversions round to nearest even, as a float32 -> float16/bfloat16 Cast does; all arithmetic is float32.
#ifndef MSLITE_LLM_CPU_KERNELS_DTYPES_H_
#define MSLITE_LLM_CPU_KERNELS_DTYPES_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace msllm {

enum Dtype { F32, F16, BF16, BAD };

inline Dtype dtype_of(const char* name) {
  if (!std::strcmp(name, "float32")) return F32;
  if (!std::strcmp(name, "float16")) return F16;
  if (!std::strcmp(name, "bfloat16")) return BF16;
  return BAD;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal
    const float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t float_to_half(float f) {  // round to nearest even, as a float32 -> float16 Cast
  const uint32_t u = float_bits(f), sign = (u >> 16) & 0x8000;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return uint16_t(sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0));
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal (or zero), rounded to nearest even
    const float v = bits_float(abs) * 16777216.0f;  // in units of 2^-24
    const float r = std::nearbyint(v);
    return uint16_t(sign | uint32_t(r));
  }
  const uint32_t rounded = abs + 0x0fffu + ((abs >> 13) & 1u);
  return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float load(const void* p, Dtype t, int64_t i) {
  if (t == F32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return t == F16 ? half_to_float(h) : bits_float(uint32_t(h) << 16);
}

inline void store(void* p, Dtype t, int64_t i, float v) {
  if (t == F32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = t == F16 ? float_to_half(v) : float_to_bf16(v);
}

// a value rounded to dtype t, as float (what a tensor of t holds)
inline float round_to(Dtype t, float v) {
  if (t == F32) return v;
  return t == F16 ? half_to_float(float_to_half(v)) : bits_float(uint32_t(float_to_bf16(v)) << 16);
}

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_DTYPES_H_
