// What every kernel family of mslite-llm's CPU library shares: the includes, the ISA macros, the weight types of the
// float families and their conversions, the rows kernels' signature, and the one choice of the code path.
//
// The library is a set of MindSpore aot Custom ops split by kernel family, each family's ISA forms side by side in
// its own file (as ggml-cpu keeps its quants and arch code apart), so that a kernel change touches one family:
//   pool.h / pool.cc      the thread pool every family runs its tasks on, and the thread count
//   matmul16.h / .cc      matmuls of float32/float16/bfloat16 weights (GEMV, GEMM), the embedding lookup
//   attention.cc          the decode step's attention over the KV cache
//   decode_ops.cc         the decode step's fused ops (RMSNorm, q/k/v with RoPE, SwiGLU, the layer's tail)
//   matmul_quant.cc       matmuls of int8/int4 weights, WeightQuantBatchMatmul's CPU stand-in
//   moe.cc                a mixture of experts' sparse MLP: the router, the routing, the chosen experts' SwiGLU
//   atlas_ops.cc          CPU stand-ins of Ascend's fused operators (plain C++, self-contained; dtypes.h)
//   ops.h                 the op bodies the families define, for registry.cc
//   registry.cc           every extern "C" entry of the families above (MindSpore calls these)
//
// ISA: AVX2+FMA+F16C code is compiled per function (target attributes, no global -mavx2) and
// chosen at load with __builtin_cpu_supports (AVX-512 where the CPU has it, unless
// MSLITE_LLM_CPU_KERNELS_ISA=avx2); on AArch64, NEON; plain C++ runs everywhere else (also forced with
// MSLITE_LLM_CPU_KERNELS_ISA=generic, read at load; for tests and benchmarks). MsliteLlmIsa() says which.
// isa() below makes that choice once for the whole library; each family picks its own kernel table from it when the
// library loads (a function-local static: safe whatever order the files' tables are initialised in).
#ifndef MSLITE_LLM_CPU_KERNELS_COMMON_H_
#define MSLITE_LLM_CPU_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MSLLM_X86 1
#define MSLLM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MSLLM_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define MSLLM_NEON 1  // every AArch64 CPU has NEON (Advanced SIMD), FMA and float16 conversion: no run-time check
#endif

namespace msllm {

inline void cpu_relax() {
#ifdef MSLLM_X86
  _mm_pause();
#elif defined(MSLLM_NEON)
  __asm__ __volatile__("yield");
#else
  std::this_thread::yield();
#endif
}

// ---- the code path ------------------------------------------------------------------------------

enum Isa { ISA_GENERIC, ISA_AVX2, ISA_AVX512, ISA_NEON };

// The code path this library runs, chosen on the first call (every family's kernel table asks while the library
// loads) from MSLITE_LLM_CPU_KERNELS_ISA and the CPU. ISA_AVX2 is AVX2 + FMA + F16C (the quantized family needs no
// F16C; every AVX2 CPU has it).
inline Isa isa() {
  static const Isa chosen = [] {
    const char* env = std::getenv("MSLITE_LLM_CPU_KERNELS_ISA");
    if (env != nullptr && std::strcmp(env, "generic") == 0) return ISA_GENERIC;
#ifdef MSLLM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      // AVX-512 where the CPU has it (not with MSLITE_LLM_CPU_KERNELS_ISA=avx2)
      if (__builtin_cpu_supports("avx512f") && !(env != nullptr && std::strcmp(env, "avx2") == 0)) return ISA_AVX512;
      return ISA_AVX2;
    }
#endif
#ifdef MSLLM_NEON
    return ISA_NEON;
#endif
    return ISA_GENERIC;
  }();
  return chosen;
}

// Whether the AVX-512 path may use the forms of its extensions where the CPU has them (VNNI for the quantized
// matmuls, BF16 for bfloat16 weights): not with MSLITE_LLM_CPU_KERNELS_ISA=avx512, which holds an AVX-512 machine to
// the AVX-512F forms a CPU without them runs (tests force each path so).
inline bool isa_extensions() {
  static const bool allowed = [] {
    const char* env = std::getenv("MSLITE_LLM_CPU_KERNELS_ISA");
    return !(env != nullptr && std::strcmp(env, "avx512") == 0);
  }();
  return allowed;
}

// ---- AMX tiles ---------------------------------------------------------------------------------
// Whether this process may use AMX tiles (Intel's AMX-TILE: 8 tile registers of up to 16 rows of 64 bytes, and the
// tile unit's dot products): the AVX-512 path with its extensions, a CPU with AMX-TILE, Linux granting the process the
// tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, asked once here; without it the first tile
// instruction faults), and not MSLITE_LLM_CPU_KERNELS_AMX=0 (read at load). Each family also checks the dot product
// it uses (AMX-INT8 for banded int8 weights, matmul_quant.cc; AMX-BF16 for bfloat16 ones, matmul16.cc); tiles_on() is
// the one switch of both (set_tiles: tests and benchmarks compare the vector forms in one process).
inline bool amx_granted() {
  static const bool granted = [] {
#if defined(MSLLM_X86) && defined(__linux__)
    if (isa() != ISA_AVX512 || !isa_extensions()) return false;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile")) return false;
    const char* env = std::getenv("MSLITE_LLM_CPU_KERNELS_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;  // Linux's asm/prctl.h, fpu/xstate.h
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
  }();
  return granted;
}

inline std::atomic<bool>& tiles_switch() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool tiles_on() { return amx_granted() && tiles_switch().load(std::memory_order_relaxed); }

#ifdef MSLLM_X86
// A tile configuration (palette 1): per tile its bytes a row and its rows. Loaded per call on the calling thread
// (tile_configure: the configuration is the thread's, and another library on it may have loaded its own), released
// after (tile_release: the tile state back to its initial one). By hand: GCC 12's _tile_loadconfig names only the
// first 8 bytes of the configuration as read, so the stores of the rest may be dropped (the tiles then unconfigured:
// SIGILL at the first tile instruction).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void tile_configure(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" : : "m"(c) : "memory"); }
inline void tile_release() { __asm__ volatile("tilerelease" : : : "memory"); }
#endif

inline const char* isa_name(Isa i) {
  switch (i) {
    case ISA_AVX512: return "avx512";
    case ISA_AVX2: return "avx2";
    case ISA_NEON: return "neon";
    default: return "generic";
  }
}

// ---- weight types ------------------------------------------------------------------------------

struct f16 { uint16_t bits; };   // IEEE binary16
struct bf16 { uint16_t bits; };  // the upper half of a float32

// W_QUANT: an int8/int4 weight with its scales, `w` a QuantWeight (matmul_quant.h); never a tensor's own dtype
enum WType { W_F32 = 0, W_F16 = 1, W_BF16 = 2, W_QUANT = 3, W_NONE = -1 };

inline WType weight_type(const char* dtype) {
  if (std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "float") == 0) return W_F32;
  if (std::strcmp(dtype, "float16") == 0 || std::strcmp(dtype, "half") == 0) return W_F16;
  if (std::strcmp(dtype, "bfloat16") == 0) return W_BF16;
  return W_NONE;
}

inline bool is_f32(const char* dtype) { return weight_type(dtype) == W_F32; }

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) { return bits_to_float(uint32_t(v.bits) << 16); }
inline float to_f32(f16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16, exp = (v.bits >> 10) & 0x1fu, man = v.bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = float(man) * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf, nan
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

// a . b over n floats, four partial sums (the plain C++ forms of the float and the quantized matmuls)
inline float dot_generic(const float* a, const float* b, int64_t n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// y = x * rsqrt(mean(x^2) + eps) * w, per row (HF Qwen2RMSNorm in float32; the sum in double): the fused decode ops'
// and the MoE op's input norm.
inline void norm_rows(const float* x, int64_t rows, int64_t e, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * e;
    double ss = 0.0;
    for (int64_t i = 0; i < e; ++i) ss += double(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(float(ss / double(e > 0 ? e : 1)) + eps);
    for (int64_t i = 0; i < e; ++i) y[r * e + i] = w[i] * (xr[i] * inv);
  }
}

// Cephes' expf: x = n ln2 + r (ln2 in a high and a low part), e^r = 1 + r + r^2 P(r), P of degree 5 (EXP_POLY, highest
// power first). The attention's softmax (attention.cc exp_nonpositive*) and the SwiGLU's silu (matmul16.cc
// silu_times_avx512) evaluate it.
constexpr float EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef MSLLM_X86
// the sum of an AVX2 register's 8 lanes, in this order: the float32 rows kernel's (matmul16.cc tile_avx2) and the
// attention's paired scores (attention.cc scores_avx512), which must give the same sums
MSLLM_AVX2 inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
#endif

// ---- the rows kernels' signature ---------------------------------------------------------------

// y[r * ldy + o] = x_r . W_o (+ b_o) for output rows [o0, o1) and every row r of x. Any number of rows. W [out, in]
// of the kernel's weight type. The GEMV's unit of work (matmul16.cc), the attention's scores (K rows as W) and the
// fused ops' projections all run through one.
typedef void (*RowsFn)(const float* x, int64_t rows, const void* w, const float* b, int64_t in, float* y,
                       int64_t ldy, int64_t o0, int64_t o1);

// ---- per-thread buffers of a call site ----------------------------------------------------------------------
// A buffer that scales with a call's rows, kept per thread and per call site between calls (grow only; contents
// undefined): a prompt piece's rows made each call's vectors hundreds of KB, which malloc maps and unmaps, so every
// call took a page fault per 4 KB (docs/performance-log.md 51). One larger than SCRATCH_KEEP (a long prompt's, all at
// once) is freed when the call ends, so memory after a call stays what it was before.
//   thread_local std::vector<float> buf;  Scratch<float> s(buf);  float* p = s.get(n);
constexpr size_t SCRATCH_KEEP = size_t(32) << 20;

template <class T>
struct Scratch {
  std::vector<T>& buf;
  explicit Scratch(std::vector<T>& b) : buf(b) {}
  T* get(int64_t n) {
    if (int64_t(buf.size()) < n) buf.resize(size_t(n));
    return buf.data();
  }
  ~Scratch() {
    if (buf.capacity() * sizeof(T) > SCRATCH_KEEP) std::vector<T>().swap(buf);
  }
};

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_COMMON_H_
