// mslite-llm CPU kernels: y = x . W^T (+ b) and an embedding lookup, as MindSpore aot Custom ops.
//
// Why: MindSpore 2.10's CPU MatMul reads the weights with one core when x has one row
// (about 7.5 GB/s here), and decoding one token is that GEMV, 1.98 GB of weights for the
// Qwen2-0.5B shape. This kernel splits the output rows across threads and reads W once
// (docs/architecture.md, "Facts the design rests on"; docs/performance-log.md, "Decode: our own GEMV kernel",
// 2026-11-21). MindSpore has no fast CPU kernel for 16-bit weights either, so W may be float16 or bfloat16: each
// weight is widened to float32 in registers as it is loaded and all arithmetic is float32 (FMA). x, b and y are
// always float32.
//
// Two forms, chosen by the rows of x (M):
//   M <= GEMV_MAX_ROWS (decode): dot products that read each weight once per call (M=1: one weight row
//     at a time, a sequential stream per thread; 4 weight rows against 2 rows of x, or 3 against 4 from
//     M=4, in register tiles); threads split the output rows.
//   larger M (prefill): a cache-blocked GEMM. A block of W (KC inputs x NC outputs) is widened and
//     packed into a per-thread buffer in 16-output panels, then a 6x16 microkernel (6 rows of x
//     by 16 outputs, 12 ymm accumulators, x broadcast from its rows) runs over it; threads split
//     the outputs (and the rows of x when there are few outputs), each packing its own blocks.
//
// Threads: a small pool of our own rather than OpenMP, because the op runs ~170 times per token
// between MindSpore's own kernels: workers spin only briefly (SPIN_US) after a call and then
// sleep, so they do not compete with MindSpore's threads on a small machine, and the process's
// libgomp (torch loads one) plays no part.
//
// ISA: AVX2+FMA+F16C code is compiled per function (target attributes, no global -mavx2) and
// chosen at load with __builtin_cpu_supports (AVX-512 where the CPU has it, unless
// MSLITE_LLM_CPU_KERNELS_ISA=avx2); on AArch64, NEON; plain C++ runs everywhere else (also forced with
// MSLITE_LLM_CPU_KERNELS_ISA=generic, read at load; for tests and benchmarks). MsliteLlmIsa() says which.
//
// Interface (MindSpore aot CPU): int F(int nparam, void** params, int* ndims, int64_t** shapes,
// const char** dtypes, void* stream, void* extra); 0 on success, else 1 wrong number of tensors,
// 2 unsupported dtype, 3 wrong ranks, 4 shapes that do not fit, 5 an id outside the table.
//   MsliteLlmGemv:     params = x [M, I] f32, W [O, I] f32/f16/bf16, y [M, O] f32
//   MsliteLlmGemvBias: params = x [M, I] f32, W [O, I] f32/f16/bf16, b [O] f32, y [M, O] f32
//   MsliteLlmEmbed:    params = ids [N] int32/int64, table [V, E] f32/f16/bf16, y [N, E] f32
//                      (ids may have any rank; y is ids' shape plus [E])
// The decode step's fused ops (see their section): MsliteLlmRmsNorm, MsliteLlmQkvRope, MsliteLlmGemvAdd,
// MsliteLlmSwiGlu, MsliteLlmDecodeAttention; cpu_kernels/__init__.py lists their tensors.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
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

namespace {

constexpr int64_t ROWS_PER_TASK = 128;  // GEMV: at most this many output rows per task (task_rows)
constexpr int64_t MIN_PARALLEL_ROWS = 256;
constexpr int64_t GEMV_MAX_ROWS = 16;  // rows of x up to which the GEMV form wins (benchmarks/bench_kernels.py: by
                                       // 5-30 % at 10-16 rows, weights not in cache; the GEMM from 24)
constexpr int64_t GEMV_WIDE_ROWS = 4;  // GEMV: from this many rows of x on, 4x3 tiles instead of 2x4
constexpr int64_t PACK_PREFETCH = 128;  // GEMM: weights the pack prefetches ahead in each row
constexpr int64_t MR = 6, NR = 16;  // GEMM microkernel: rows of x by outputs
constexpr int64_t KC = 1024;  // GEMM: at most this many inputs per packed block (blocks of equal size);
                              // 256..1024 measured within 3 %, 1024 reads W in longer runs
constexpr int64_t MC = 48;    // GEMM: rows of x per pass over a packed block (MC x KC floats, with it in L2)
constexpr int64_t NC = 64;    // GEMM: outputs per task (its packed block, KC x NC floats, in L2)
constexpr int64_t ATTENTION_BLOCK = 8;  // attention: consecutive queries of one cache row per task
                                        // (docs/architecture.md, "cpu_kernels/")
constexpr int64_t MIN_PARALLEL_WORK = int64_t(1) << 20;  // GEMM (MACs), embed (floats): less runs on the caller
const int SPIN_US = std::getenv("MSLLM_SPIN_US") ? std::atoi(std::getenv("MSLLM_SPIN_US")) : 100;  // how long an idle worker polls for the next call before sleeping

inline void cpu_relax() {
#ifdef MSLLM_X86
  _mm_pause();
#elif defined(MSLLM_NEON)
  __asm__ __volatile__("yield");
#else
  std::this_thread::yield();
#endif
}

// ---- weight types ------------------------------------------------------------------------------

struct f16 { uint16_t bits; };   // IEEE binary16
struct bf16 { uint16_t bits; };  // the upper half of a float32

enum WType { W_F32 = 0, W_F16 = 1, W_BF16 = 2, W_NONE = -1 };

WType weight_type(const char* dtype) {
  if (std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "float") == 0) return W_F32;
  if (std::strcmp(dtype, "float16") == 0 || std::strcmp(dtype, "half") == 0) return W_F16;
  if (std::strcmp(dtype, "bfloat16") == 0) return W_BF16;
  return W_NONE;
}

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

template <class T>
inline void widen_generic(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

// A per-thread float buffer that only grows: the GEMM's packed blocks, the generic path's widened rows.
class Scratch {
 public:
  ~Scratch() { std::free(ptr_); }
  float* get(size_t floats) {
    if (floats > size_) {
      std::free(ptr_);
      ptr_ = nullptr;
      size_ = 0;
      void* p = nullptr;
      if (posix_memalign(&p, 64, floats * sizeof(float)) != 0) return nullptr;
      ptr_ = static_cast<float*>(p);
      size_ = floats;
    }
    return ptr_;
  }

 private:
  float* ptr_ = nullptr;
  size_t size_ = 0;
};

thread_local Scratch t_scratch;

// ---- generic C++ ------------------------------------------------------------------------------

// y[r * ldy + o] = x_r . W_o (+ b_o) for output rows [o0, o1) and every row r of x. Any number of rows.
typedef void (*RowsFn)(const float* x, int64_t rows, const void* w, const float* b, int64_t in, float* y,
                       int64_t ldy, int64_t o0, int64_t o1);

inline float dot_generic(const float* a, const float* c, int64_t in) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= in; i += 4) {
    s0 += a[i] * c[i];
    s1 += a[i + 1] * c[i + 1];
    s2 += a[i + 2] * c[i + 2];
    s3 += a[i + 3] * c[i + 3];
  }
  for (; i < in; ++i) s0 += a[i] * c[i];
  return (s0 + s1) + (s2 + s3);
}

template <class T>
void rows_generic(const float* x, int64_t rows, const void* wv, const float* b, int64_t in, float* y, int64_t ldy,
                  int64_t o0, int64_t o1) {
  const T* w = static_cast<const T*>(wv);
  const bool f32 = std::is_same<T, float>::value;
  float* row = f32 ? nullptr : t_scratch.get(size_t(std::max<int64_t>(in, 1)));
  for (int64_t o = o0; o < o1; ++o) {
    const float* wo = reinterpret_cast<const float*>(w + o * in);
    if (row != nullptr) {
      widen_generic(w + o * in, in, row);  // once per weight row, whatever the rows of x
      wo = row;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float s;
      if (f32 || row != nullptr) {
        s = dot_generic(wo, x + r * in, in);
      } else {  // no memory for a widened row
        s = 0.f;
        for (int64_t i = 0; i < in; ++i) s += to_f32(w[o * in + i]) * x[r * in + i];
      }
      y[r * ldy + o] = s + (b ? b[o] : 0.f);
    }
  }
}

typedef void (*WidenFn)(const void* src, int64_t n, float* dst);

template <class T>
void widen_rows_generic(const void* src, int64_t n, float* dst) {
  widen_generic(static_cast<const T*>(src), n, dst);
}

// ---- AVX2 + FMA + F16C --------------------------------------------------------------------------

#ifdef MSLLM_X86
MSLLM_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
MSLLM_AVX2 inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
MSLLM_AVX2 inline __m256 load8(const bf16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

MSLLM_AVX2 inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// GEMV: R rows of x by C rows of W at a time, R*C accumulators in registers: each load feeds several FMAs.
template <class T, int R, int C>
MSLLM_AVX2 inline void tile_avx2(const float* x, const T* w, const float* b, int64_t in, float* y, int64_t ldy,
                                 int64_t o) {
  const int64_t in8 = in & ~int64_t(7);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const T* wo = w + o * in;
  // The next C weight rows follow these in memory: prefetch them, an equal share per step. Short rows are
  // short streams for the hardware prefetcher; measured on the 0.5B shapes (weights not in cache), this
  // reads 16-bit rows of 896 up to 1.6x faster, float32 ones only with 4 rows of x (at 1-2 rows they
  // already come at the memory's pace and the extra instructions cost ~5 %). 16-bit rows of 4864
  // (down_proj) gain 1.4x on an EPYC with AVX-512 (0.23 -> 0.17 ms), float32 ones nothing.
  const bool prefetch = sizeof(T) == 2 || (in * int64_t(sizeof(T)) <= 4096 && R >= 4);
  constexpr int64_t PREFETCH_STEP = C * 8 * int64_t(sizeof(T));
  const char* next = reinterpret_cast<const char*>(wo + C * in);
  for (int64_t i = 0; i < in8; i += 8) {
    if (prefetch) {
      for (int64_t off = 0; off < PREFETCH_STEP; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      next += PREFETCH_STEP;
    }
    __m256 wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = load8(wo + c * in + i);
      __asm__("" : "+x"(wv[c]));  // in a register: else GCC folds float weights into each FMA, loading them R times
    }
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * in + i);
      __asm__("" : "+x"(xv));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t i = in8; i < in; ++i) s += to_f32(wo[c * in + i]) * x[r * in + i];
      y[r * ldy + o + c] = s + (b ? b[o + c] : 0.f);
    }
  }
}

// One row of x (the decode step at batch 1) against one weight row at a time, 32 inputs a step in four accumulators:
// each thread reads its weights as one sequential stream. Tiles of four weight rows side by side (tile_avx2<T, 1, 4>,
// which this replaced) read four short streams at once (896 inputs: 3.5 KB of float32), which the hardware
// prefetcher follows worse: the 0.5B shape's step matrices took 0.84x (float32) and 0.89x (16-bit) of the time,
// interleaved in one process on an AMD EPYC (docs/performance-log.md, "The CPU decode step on the AVX2 path",
// 2026-11-24); a plain read of rows side by side measured 0.67x the bandwidth of one stream there.
template <class T>
MSLLM_AVX2 inline void seq_rows_avx2(const float* x, const T* w, const float* b, int64_t in, float* y, int64_t o0,
                                     int64_t o1) {
  const int64_t in32 = in & ~int64_t(31);
  for (int64_t o = o0; o < o1; ++o) {
    const T* wo = w + o * in;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i < in32; i += 32) {
      a0 = _mm256_fmadd_ps(load8(wo + i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(load8(wo + i + 8), _mm256_loadu_ps(x + i + 8), a1);
      a2 = _mm256_fmadd_ps(load8(wo + i + 16), _mm256_loadu_ps(x + i + 16), a2);
      a3 = _mm256_fmadd_ps(load8(wo + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= in; i += 8) a0 = _mm256_fmadd_ps(load8(wo + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < in; ++i) s += to_f32(wo[i]) * x[i];
    y[o] = s + (b ? b[o] : 0.f);
  }
}

// All rows of x against C weight rows: R rows of x at a time, again for the next R while the weight rows are in cache.
template <class T, int R, int C>
MSLLM_AVX2 inline void tiles_avx2(const float* x, int64_t rows, const T* w, const float* b, int64_t in, float* y,
                                  int64_t ldy, int64_t o) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) tile_avx2<T, R, C>(x + r * in, w, b, in, y + r * ldy, ldy, o);
  for (; r + 2 <= rows; r += 2) tile_avx2<T, 2, C>(x + r * in, w, b, in, y + r * ldy, ldy, o);
  if (r < rows) tile_avx2<T, 1, C>(x + r * in, w, b, in, y + r * ldy, ldy, o);
}

template <class T>
MSLLM_AVX2 void rows_avx2(const float* x, int64_t rows, const void* wv, const float* b, int64_t in, float* y,
                          int64_t ldy, int64_t o0, int64_t o1) {
  const T* w = static_cast<const T*>(wv);
  int64_t o = o0;
  if (rows == 1) {  // decode at batch 1: one weight row at a time
    seq_rows_avx2<T>(x, w, b, in, y, o0, o1);
    return;
  }
  if (rows < GEMV_WIDE_ROWS) {  // 2x4 tiles: 8 accumulators
    for (; o + 4 <= o1; o += 4) tiles_avx2<T, 2, 4>(x, rows, w, b, in, y, ldy, o);
  } else {  // 4x3 tiles: 12 accumulators, each weight widened once per 4 rows of x
    for (; o + 3 <= o1; o += 3) tiles_avx2<T, 4, 3>(x, rows, w, b, in, y, ldy, o);
  }
  for (; o < o1; ++o) tiles_avx2<T, 2, 1>(x, rows, w, b, in, y, ldy, o);
}

template <class T>
MSLLM_AVX2 void widen_rows_avx2(const void* src, int64_t n, float* dst) {
  const T* s = static_cast<const T*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(s + i));
  for (; i < n; ++i) dst[i] = to_f32(s[i]);
}

MSLLM_AVX2 inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Packs W[n0 .. n0+ncols) x [k0 .. k0+kc), widened, as panels of NR outputs: bp[p][k][j] = W[n0+NR*p+j][k0+k],
// zeros past ncols.
template <class T>
MSLLM_AVX2 void pack_b(const T* w, int64_t in, int64_t n0, int64_t ncols, int64_t k0, int64_t kc, float* bp) {
  const int64_t kc8 = kc & ~int64_t(7);
  for (int64_t p = 0; p * NR < ncols; ++p) {
    float* panel = bp + p * NR * kc;
    const int64_t valid = std::min<int64_t>(NR, ncols - p * NR);
    for (int64_t h = 0; h < NR; h += 8) {  // two halves of 8 outputs
      const T* src = w + (n0 + p * NR + h) * in + k0;
      if (valid >= h + 8) {
        for (int64_t k = 0; k < kc8; k += 8) {
          for (int j = 0; j < 8; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(src + j * in + k + PACK_PREFETCH), _MM_HINT_T0);
          __m256 r[8];
          for (int j = 0; j < 8; ++j) r[j] = load8(src + j * in + k);
          transpose8(r);
          for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + (k + j) * NR + h, r[j]);
        }
        for (int64_t k = kc8; k < kc; ++k)
          for (int j = 0; j < 8; ++j) panel[k * NR + h + j] = to_f32(src[j * in + k]);
      } else {
        const int64_t rows = std::max<int64_t>(0, valid - h);
        for (int64_t k = 0; k < kc; ++k)
          for (int64_t j = 0; j < 8; ++j) panel[k * NR + h + j] = j < rows ? to_f32(src[j * in + k]) : 0.f;
      }
    }
  }
}

// C[R x ncols] (+)= A[R x kc] . panel, A rows lda apart, C rows ldc apart. first: C = bias (or 0) + product.
// The 12 accumulators are named variables, not an array: GCC keeps an array of vectors in memory here.
template <int R>
MSLLM_AVX2 void micro(int64_t kc, const float* a, int64_t lda, const float* bp, float* c, int64_t ldc, int64_t ncols,
                      bool first, const float* bias) {
  alignas(32) float tmp[R][NR];
  const bool full = ncols == NR;
  float* cc = full ? c : tmp[0];  // where the tile is read and written
  const int64_t ldcc = full ? ldc : NR;
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (first) {
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (bias != nullptr) {
      alignas(32) float bb[NR] = {0};
      for (int64_t j = 0; j < ncols; ++j) bb[j] = bias[j];
      b0 = _mm256_load_ps(bb);
      b1 = _mm256_load_ps(bb + 8);
    }
    c00 = c10 = c20 = c30 = c40 = c50 = b0;
    c01 = c11 = c21 = c31 = c41 = c51 = b1;
  } else {
    if (!full)
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < NR; ++j) tmp[r][j] = j < ncols ? c[r * ldc + j] : 0.f;
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
#define MSLLM_LOAD_ROW(r)                                 \
    if (R > r) {                                          \
      c##r##0 = _mm256_loadu_ps(cc + r * ldcc);           \
      c##r##1 = _mm256_loadu_ps(cc + r * ldcc + 8);       \
    }
    MSLLM_LOAD_ROW(0) MSLLM_LOAD_ROW(1) MSLLM_LOAD_ROW(2) MSLLM_LOAD_ROW(3) MSLLM_LOAD_ROW(4) MSLLM_LOAD_ROW(5)
#undef MSLLM_LOAD_ROW
  }
  const float* a0 = a;
  const float* a1 = a + (R > 1 ? 1 : 0) * lda;
  const float* a2 = a + (R > 2 ? 2 : 0) * lda;
  const float* a3 = a + (R > 3 ? 3 : 0) * lda;
  const float* a4 = a + (R > 4 ? 4 : 0) * lda;
  const float* a5 = a + (R > 5 ? 5 : 0) * lda;
#define MSLLM_FMA_ROW(r)                                  \
    if (R > r) {                                          \
      const __m256 av = _mm256_broadcast_ss(a##r + k);    \
      c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);         \
      c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);         \
    }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(bp + k * NR), b1 = _mm256_load_ps(bp + k * NR + 8);
    MSLLM_FMA_ROW(0) MSLLM_FMA_ROW(1) MSLLM_FMA_ROW(2) MSLLM_FMA_ROW(3) MSLLM_FMA_ROW(4) MSLLM_FMA_ROW(5)
  }
#undef MSLLM_FMA_ROW
#define MSLLM_STORE_ROW(r)                                \
  if (R > r) {                                            \
    _mm256_storeu_ps(cc + r * ldcc, c##r##0);             \
    _mm256_storeu_ps(cc + r * ldcc + 8, c##r##1);         \
  }
  MSLLM_STORE_ROW(0) MSLLM_STORE_ROW(1) MSLLM_STORE_ROW(2) MSLLM_STORE_ROW(3) MSLLM_STORE_ROW(4) MSLLM_STORE_ROW(5)
#undef MSLLM_STORE_ROW
  if (!full)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < ncols; ++j) c[r * ldc + j] = tmp[r][j];
}

// The same tile with AVX-512 (one zmm per row of 16 outputs): on CPUs with full-width AVX-512 units (AMD Zen 5,
// Intel server cores) twice the FLOPs of the AVX2 form. Two accumulators per row (even and odd k) keep 12
// independent FMA chains in flight; partial tiles use masked loads and stores.
template <int R>
MSLLM_AVX512 void micro512(int64_t kc, const float* a, int64_t lda, const float* bp, float* c, int64_t ldc,
                           int64_t ncols, bool first, const float* bias) {
  const __mmask16 mask = ncols >= NR ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  __m512 e0, e1, e2, e3, e4, e5, o0, o1, o2, o3, o4, o5;
  e0 = e1 = e2 = e3 = e4 = e5 = o0 = o1 = o2 = o3 = o4 = o5 = _mm512_setzero_ps();
  const __m512 start = (first && bias != nullptr) ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#define MSLLM_INIT_ROW(r) \
  if (R > r) e##r = first ? start : _mm512_maskz_loadu_ps(mask, c + r * ldc);
  MSLLM_INIT_ROW(0) MSLLM_INIT_ROW(1) MSLLM_INIT_ROW(2) MSLLM_INIT_ROW(3) MSLLM_INIT_ROW(4) MSLLM_INIT_ROW(5)
#undef MSLLM_INIT_ROW
  const float* a0 = a;
  const float* a1 = a + (R > 1 ? 1 : 0) * lda;
  const float* a2 = a + (R > 2 ? 2 : 0) * lda;
  const float* a3 = a + (R > 3 ? 3 : 0) * lda;
  const float* a4 = a + (R > 4 ? 4 : 0) * lda;
  const float* a5 = a + (R > 5 ? 5 : 0) * lda;
#define MSLLM_FMA2_ROW(r)                                            \
  if (R > r) {                                                       \
    e##r = _mm512_fmadd_ps(_mm512_set1_ps(a##r[k]), b0, e##r);       \
    o##r = _mm512_fmadd_ps(_mm512_set1_ps(a##r[k + 1]), b1, o##r);   \
  }
  int64_t k = 0;
#pragma GCC unroll 2
  for (; k + 2 <= kc; k += 2) {
    const __m512 b0 = _mm512_load_ps(bp + k * NR), b1 = _mm512_load_ps(bp + (k + 1) * NR);
    MSLLM_FMA2_ROW(0) MSLLM_FMA2_ROW(1) MSLLM_FMA2_ROW(2) MSLLM_FMA2_ROW(3) MSLLM_FMA2_ROW(4) MSLLM_FMA2_ROW(5)
  }
#undef MSLLM_FMA2_ROW
#define MSLLM_TAIL_STORE_ROW(r)                                                              \
  if (R > r) {                                                                               \
    if (k < kc) e##r = _mm512_fmadd_ps(_mm512_set1_ps(a##r[k]), _mm512_load_ps(bp + k * NR), e##r); \
    _mm512_mask_storeu_ps(c + r * ldc, mask, _mm512_add_ps(e##r, o##r));                   \
  }
  MSLLM_TAIL_STORE_ROW(0) MSLLM_TAIL_STORE_ROW(1) MSLLM_TAIL_STORE_ROW(2) MSLLM_TAIL_STORE_ROW(3)
  MSLLM_TAIL_STORE_ROW(4) MSLLM_TAIL_STORE_ROW(5)
#undef MSLLM_TAIL_STORE_ROW
}

typedef void (*MicroFn)(int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, bool, const float*);
const MicroFn k_micro[MR + 1] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>};
const MicroFn k_micro512[MR + 1] = {nullptr, micro512<1>, micro512<2>, micro512<3>, micro512<4>, micro512<5>,
                                    micro512<6>};

// y[m0..m1, n0..n1) = x[m0..m1) . W[n0..n1)^T (+ b): one GEMM task, with the tiles of MICRO.
template <class T, const MicroFn* MICRO>
MSLLM_AVX2 void gemm_block_avx2(const float* x, const void* wv, const float* b, int64_t in, int64_t out, float* y,
                                int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const T* w = static_cast<const T*>(wv);
  const int64_t ncols = n1 - n0, panels = (ncols + NR - 1) / NR;
  // the inputs in blocks of equal size (a multiple of 8), at most KC
  const int64_t blocks = (in + KC - 1) / KC, block = ((in + blocks - 1) / blocks + 7) / 8 * 8;
  float* bp = t_scratch.get(size_t(block * NC));
  if (bp == nullptr) {  // no memory for the packed block: the GEMV form needs none
    rows_avx2<T>(x + m0 * in, m1 - m0, w, b, in, y + m0 * out, out, n0, n1);
    return;
  }
  for (int64_t pc = 0; pc < in; pc += block) {
    const int64_t kc = std::min(block, in - pc);
    pack_b(w, in, n0, ncols, pc, kc, bp);
    for (int64_t ic = m0; ic < m1; ic += MC) {
      const int64_t mc = std::min(MC, m1 - ic);
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t nc = std::min<int64_t>(NR, ncols - p * NR);
        const float* panel = bp + p * NR * kc;
        const float* bias = (b != nullptr && pc == 0) ? b + n0 + p * NR : nullptr;
        int64_t ir = ic;
        for (; ir + MR <= ic + mc; ir += MR)
          MICRO[MR](kc, x + ir * in + pc, in, panel, y + ir * out + n0 + p * NR, out, nc, pc == 0, bias);
        if (ir < ic + mc)
          MICRO[ic + mc - ir](kc, x + ir * in + pc, in, panel, y + ir * out + n0 + p * NR, out, nc, pc == 0, bias);
      }
    }
  }
}
#endif

typedef void (*GemmFn)(const float* x, const void* w, const float* b, int64_t in, int64_t out, float* y, int64_t m0,
                       int64_t m1, int64_t n0, int64_t n1);

// ---- AVX-512 GEMV for one row of x (the decode step at batch 1) ----------------------------------
// 16 weights per load instead of 8: half the instructions per byte read, so the loads come closer to the
// memory's pace (docs/performance-log.md, "The decode step: where the time goes, and fused ops", 2026-11-23).
// Other row counts use the AVX2 tiles.
#ifdef MSLLM_X86
MSLLM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MSLLM_AVX512 inline __m512 load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
MSLLM_AVX512 inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// seq_rows_avx2 with 16 weights per load: half the instructions per byte read (tiles of four weight rows in this
// width took 35-38 ms for the float32 step against 50-57 for AVX2 ones: docs/performance-log.md, "The decode step:
// where the time goes, and fused ops", 2026-11-23; one sequential row at a time took 0.89x (float32) to 0.78x
// (bfloat16) of those tiles: the same log, "The CPU decode step on the AVX2 path", 2026-11-24).
template <class T>
MSLLM_AVX512 inline void seq_rows512(const float* x, const T* w, const float* b, int64_t in, float* y, int64_t o0,
                                     int64_t o1) {
  const int64_t in64 = in & ~int64_t(63);
  for (int64_t o = o0; o < o1; ++o) {
    const T* wo = w + o * in;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i < in64; i += 64) {
      a0 = _mm512_fmadd_ps(load16(wo + i), _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(load16(wo + i + 16), _mm512_loadu_ps(x + i + 16), a1);
      a2 = _mm512_fmadd_ps(load16(wo + i + 32), _mm512_loadu_ps(x + i + 32), a2);
      a3 = _mm512_fmadd_ps(load16(wo + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i + 16 <= in; i += 16) a0 = _mm512_fmadd_ps(load16(wo + i), _mm512_loadu_ps(x + i), a0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; i < in; ++i) s += to_f32(wo[i]) * x[i];
    y[o] = s + (b ? b[o] : 0.f);
  }
}

template <class T>
MSLLM_AVX512 void rows_avx512(const float* x, int64_t rows, const void* wv, const float* b, int64_t in, float* y,
                              int64_t ldy, int64_t o0, int64_t o1) {
  if (rows != 1) {
    rows_avx2<T>(x, rows, wv, b, in, y, ldy, o0, o1);
    return;
  }
  seq_rows512<T>(x, static_cast<const T*>(wv), b, in, y, o0, o1);
}
#endif

// ---- NEON (AArch64: the Atlas hosts' Kunpeng 920, ARMv8.2) -------------------------------------------
// The AVX2 forms' shapes in 128-bit registers: one row of x against one weight row at a time (a sequential stream
// per thread), more rows of x in tiles of up to 4 that widen each weight once per tile. 16-bit weights are widened
// in registers (float16: FCVTL; bfloat16: a 16-bit shift left), all arithmetic float32 FMA. No GEMM form (the rows
// form takes every M, as the generic path does). Compile-tested with Debian's cross compiler and run under
// qemu-user against float64 references (tests/test_neon_kernels.py); its speed on a Kunpeng has not been measured.
#ifdef MSLLM_NEON
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const f16* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
inline float32x4_t load4(const bf16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}

// R rows of x (R <= 4) against one weight row: two accumulators per row of x, 8 inputs a step
template <class T, int R>
inline void tile_neon(const float* x, const T* wo, int64_t in, float* out) {
  const int64_t in8 = in & ~int64_t(7);
  float32x4_t acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vdupq_n_f32(0.f);
  for (int64_t i = 0; i < in8; i += 8) {
    const float32x4_t w0 = load4(wo + i), w1 = load4(wo + i + 4);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = vfmaq_f32(acc[r][0], w0, vld1q_f32(x + r * in + i));
      acc[r][1] = vfmaq_f32(acc[r][1], w1, vld1q_f32(x + r * in + i + 4));
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1]));
    for (int64_t i = in8; i < in; ++i) s += to_f32(wo[i]) * x[r * in + i];
    out[r] = s;
  }
}

// one row of x: four accumulators, 16 inputs a step
template <class T>
inline float dot_neon(const float* x, const T* wo, int64_t in) {
  const int64_t in16 = in & ~int64_t(15);
  float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i < in16; i += 16) {
    a0 = vfmaq_f32(a0, load4(wo + i), vld1q_f32(x + i));
    a1 = vfmaq_f32(a1, load4(wo + i + 4), vld1q_f32(x + i + 4));
    a2 = vfmaq_f32(a2, load4(wo + i + 8), vld1q_f32(x + i + 8));
    a3 = vfmaq_f32(a3, load4(wo + i + 12), vld1q_f32(x + i + 12));
  }
  for (; i + 4 <= in; i += 4) a0 = vfmaq_f32(a0, load4(wo + i), vld1q_f32(x + i));
  float s = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
  for (; i < in; ++i) s += to_f32(wo[i]) * x[i];
  return s;
}

template <class T>
void rows_neon(const float* x, int64_t rows, const void* wv, const float* b, int64_t in, float* y, int64_t ldy,
               int64_t o0, int64_t o1) {
  const T* w = static_cast<const T*>(wv);
  float out[4];
  for (int64_t o = o0; o < o1; ++o) {
    const T* wo = w + o * in;
    const float bias = b ? b[o] : 0.f;
    if (rows == 1) {
      y[o] = dot_neon(x, wo, in) + bias;
      continue;
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      tile_neon<T, 4>(x + r * in, wo, in, out);
      for (int k = 0; k < 4; ++k) y[(r + k) * ldy + o] = out[k] + bias;
    }
    for (; r + 2 <= rows; r += 2) {
      tile_neon<T, 2>(x + r * in, wo, in, out);
      for (int k = 0; k < 2; ++k) y[(r + k) * ldy + o] = out[k] + bias;
    }
    if (r < rows) y[r * ldy + o] = dot_neon(x + r * in, wo, in) + bias;
  }
}

template <class T>
void widen_rows_neon(const void* src, int64_t n, float* dst) {
  const T* s = static_cast<const T*>(src);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, load4(s + i));
  for (; i < n; ++i) dst[i] = to_f32(s[i]);
}
#endif

// ---- attention over the KV cache ----------------------------------------------------------------------------
// Each task is a block of consecutive queries that read the same cache row (a prompt's tokens in the prefill and
// chunk graphs; one query per row in the decode step) and one kv head: the G query heads of that kv head for every
// query of the block are one matrix of rows, so each key and value row is read once per task, not once per query
// head and token. Scores are the rows form of the GEMV kernels (K rows as the weight rows), then per query its
// softmax over its own valid positions (the exp in intrinsics on x86) and the weighted sum of the value rows, in
// plain loops the compiler vectorizes for each path (attend_rows_body is compiled once per target).

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial after 2^n range reduction (x = n ln2 + r,
// ln2 in a high and a low part); relative error ~2e-7. At or below EXP_LOW it gives 0. The scalar form, and the
// 8- and 16-lane ones below with the same constants (GCC does not vectorize the scalar form's float selects).
constexpr float EXP_LOW = -87.0f, EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f,
                EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  x = x < EXP_LOW ? EXP_LOW : x;
  const float fx = x * EXP_LOG2E + 0.5f;
  int32_t n = int32_t(fx);
  n -= (float(n) > fx);  // floor
  const float fn = float(n);
  float r = x - fn * EXP_LN2_HI;
  r -= fn * EXP_LN2_LO;
  float p = EXP_POLY[0];
  for (int i = 1; i < 6; ++i) p = p * r + EXP_POLY[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= EXP_LOW ? 0.f : p * scale;
}

// s[p] = exp(s[p] * scale - best) for scores whose largest times scale is `best`: the plain loop (generic, NEON)
__attribute__((always_inline)) inline void exp_rows_generic(float* s, int64_t n, float scale, float best) {
  for (int64_t p = 0; p < n; ++p) s[p] = exp_nonpositive(s[p] * scale - best);
}

#ifdef MSLLM_X86
MSLLM_AVX2 inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 low = _mm256_set1_ps(EXP_LOW);
  x = _mm256_max_ps(x, low);
  const __m256 fn = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(EXP_LN2_HI), x);
  r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(EXP_LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fn), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, low, _CMP_LE_OQ), y);
}

MSLLM_AVX2 inline void exp_rows_avx2(float* s, int64_t n, float scale, float best) {
  const __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(best);
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) _mm256_storeu_ps(s + p, exp_nonpositive8(_mm256_fmsub_ps(_mm256_loadu_ps(s + p), vs, vb)));
  for (; p < n; ++p) s[p] = exp_nonpositive(s[p] * scale - best);
}

MSLLM_AVX512 inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 low = _mm512_set1_ps(EXP_LOW);
  x = _mm512_max_ps(x, low);
  const __m512 fn = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(EXP_LN2_HI), x);
  r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(EXP_LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fn), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GT_OQ), y);
}

MSLLM_AVX512 inline void exp_rows_avx512(float* s, int64_t n, float scale, float best) {
  const __m512 vs = _mm512_set1_ps(scale), vb = _mm512_set1_ps(best);
  int64_t p = 0;
  for (; p + 16 <= n; p += 16)
    _mm512_storeu_ps(s + p, exp_nonpositive16(_mm512_fmsub_ps(_mm512_loadu_ps(s + p), vs, vb)));
  for (; p < n; ++p) s[p] = exp_nonpositive(s[p] * scale - best);
}
#endif

// The softmax and the weighted sum of values of a task's query rows: scores [rows, ld] (row r's first lengths[r]
// valid) -> out[r] [d] = softmax(scores_r * scale) . V over v rows [., d]. Each row's maximum and sum are kept in 8
// lanes (the compiler does not reorder float reductions), its weights normalised in place; then the value rows are
// read in blocks of PV_POSITIONS (in L1) for every query row, each row's output in blocks of PV_BLOCK values over
// two positions at a time, in vector registers.
constexpr int64_t PV_BLOCK = 32, PV_POSITIONS = 128;
typedef void (*AttendRowsFn)(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
                             const float* v, int64_t d, float* const* out);

template <void (*ExpRows)(float*, int64_t, float, float)>
__attribute__((always_inline)) inline void attend_rows_body(float* scores, int64_t rows, int64_t ld,
                                                            const int64_t* lengths, float scale, const float* v,
                                                            int64_t d, float* const* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    const int64_t n = lengths[r];
    float lanes[8];
    for (int j = 0; j < 8; ++j) lanes[j] = -INFINITY;
    int64_t p = 0;
    for (; p + 8 <= n; p += 8)
      for (int j = 0; j < 8; ++j) lanes[j] = lanes[j] > s[p + j] ? lanes[j] : s[p + j];
    float best = -INFINITY;
    for (int j = 0; j < 8; ++j) best = std::max(best, lanes[j]);
    for (; p < n; ++p) best = std::max(best, s[p]);
    ExpRows(s, n, scale, best * scale);
    for (int j = 0; j < 8; ++j) lanes[j] = 0.f;
    for (p = 0; p + 8 <= n; p += 8)
      for (int j = 0; j < 8; ++j) lanes[j] += s[p + j];
    float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; p < n; ++p) total += s[p];
    const float norm = total > 0.f ? 1.f / total : 0.f;
    for (p = 0; p < n; ++p) s[p] *= norm;
    for (int64_t i = 0; i < d; ++i) out[r][i] = 0.f;
  }
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, lengths[r]);
  for (int64_t p0 = 0; p0 < longest; p0 += PV_POSITIONS)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p1 = std::min(lengths[r], p0 + PV_POSITIONS);
      if (p1 <= p0) continue;
      const float* w = scores + r * ld;
      int64_t i0 = 0;
      for (; i0 + PV_BLOCK <= d; i0 += PV_BLOCK) {
        float acc0[PV_BLOCK], acc1[PV_BLOCK];
        for (int i = 0; i < PV_BLOCK; ++i) acc0[i] = out[r][i0 + i], acc1[i] = 0.f;
        const float* vp = v + p0 * d + i0;
        int64_t p = p0;
        for (; p + 2 <= p1; p += 2, vp += 2 * d) {
          const float w0 = w[p], w1 = w[p + 1];
          for (int i = 0; i < PV_BLOCK; ++i) acc0[i] += w0 * vp[i];
          for (int i = 0; i < PV_BLOCK; ++i) acc1[i] += w1 * vp[d + i];
        }
        if (p < p1)
          for (int i = 0; i < PV_BLOCK; ++i) acc0[i] += w[p] * vp[i];
        for (int i = 0; i < PV_BLOCK; ++i) out[r][i0 + i] = acc0[i] + acc1[i];
      }
      for (int64_t i = i0; i < d; ++i) {  // a head size not a multiple of the block
        float acc = out[r][i];
        for (int64_t p = p0; p < p1; ++p) acc += w[p] * v[p * d + i];
        out[r][i] = acc;
      }
    }
}

void attend_rows_generic(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
                         const float* v, int64_t d, float* const* out) {
  attend_rows_body<exp_rows_generic>(scores, rows, ld, lengths, scale, v, d, out);
}
#ifdef MSLLM_X86
MSLLM_AVX2 void attend_rows_avx2(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
                                 const float* v, int64_t d, float* const* out) {
  attend_rows_body<exp_rows_avx2>(scores, rows, ld, lengths, scale, v, d, out);
}
MSLLM_AVX512 void attend_rows_avx512(float* scores, int64_t rows, int64_t ld, const int64_t* lengths, float scale,
                                     const float* v, int64_t d, float* const* out) {
  attend_rows_body<exp_rows_avx512>(scores, rows, ld, lengths, scale, v, d, out);
}
#endif

// ---- the kernels this machine runs ---------------------------------------------------------------

struct Kernels {
  const char* isa;
  RowsFn rows[3];
  GemmFn gemm[3];  // null: no GEMM form, the rows form takes every M
  WidenFn widen[3];
  AttendRowsFn attend_rows;  // the attention's softmax and weighted sum of values
};

Kernels pick_kernels() {
  const Kernels generic = {"generic",
                           {rows_generic<float>, rows_generic<f16>, rows_generic<bf16>},
                           {nullptr, nullptr, nullptr},
                           {widen_rows_generic<float>, widen_rows_generic<f16>, widen_rows_generic<bf16>},
                           attend_rows_generic};
  const char* isa = std::getenv("MSLITE_LLM_CPU_KERNELS_ISA");
  if (isa != nullptr && std::strcmp(isa, "generic") == 0) return generic;
#ifdef MSLLM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    // AVX-512 where the CPU has it (not with MSLITE_LLM_CPU_KERNELS_ISA=avx2): the GEMM's tiles, and the GEMV
    // for one row of x; the packing and the GEMV for more rows stay AVX2
    if (__builtin_cpu_supports("avx512f") && !(isa != nullptr && std::strcmp(isa, "avx2") == 0))
      return {"avx512",
              {rows_avx512<float>, rows_avx512<f16>, rows_avx512<bf16>},
              {gemm_block_avx2<float, k_micro512>, gemm_block_avx2<f16, k_micro512>,
               gemm_block_avx2<bf16, k_micro512>},
              {widen_rows_avx2<float>, widen_rows_avx2<f16>, widen_rows_avx2<bf16>},
              attend_rows_avx512};
    return {"avx2",
            {rows_avx2<float>, rows_avx2<f16>, rows_avx2<bf16>},
            {gemm_block_avx2<float, k_micro>, gemm_block_avx2<f16, k_micro>, gemm_block_avx2<bf16, k_micro>},
            {widen_rows_avx2<float>, widen_rows_avx2<f16>, widen_rows_avx2<bf16>},
            attend_rows_avx2};
  }
#endif
#ifdef MSLLM_NEON
  return {"neon",
          {rows_neon<float>, rows_neon<f16>, rows_neon<bf16>},
          {nullptr, nullptr, nullptr},
          {widen_rows_neon<float>, widen_rows_neon<f16>, widen_rows_neon<bf16>},
          attend_rows_generic};
#endif
  return generic;
}

const Kernels g_kernels = pick_kernels();

// ---- the thread pool ---------------------------------------------------------------------------

thread_local int t_slot = 0;  // this thread's place in the pool: the caller 0, the workers 1, 2, ...

struct Job {
  std::atomic<int64_t> next{0};
  virtual ~Job() = default;
  virtual void work() = 0;  // claims tasks through `next` (or `claim`) until none is left
};

// Tasks 0..n-1 (in the order of the weights in memory) split into one contiguous share per thread, each thread
// taking its own share in order, then what is left of the others'. A GEMV at batch 1 is a read of its weights: one
// sequential stream per thread keeps the hardware prefetcher ahead, where tasks handed out in turn (thread A task 0,
// B task 1, A task 2...) make every thread jump at every task. Measured on the 0.5B shape's step matrices,
// interleaved in one process on an AMD EPYC: 0.92x the time (16-bit weights, AVX2), 0.96x (float32); AVX-512
// 0.94x / 0.96x (docs/performance-log.md, "Each thread one stream, and the layer after the attention in one call",
// 2026-11-25).
struct Shares {
  static constexpr int MAX = 16;
  int n = 1;
  std::atomic<int64_t> cursor[MAX];
  int64_t end[MAX];

  void split(int64_t tasks, int threads) {
    n = std::max(1, std::min(threads, int(MAX)));
    for (int k = 0; k < n; ++k) {
      cursor[k].store(tasks * k / n, std::memory_order_relaxed);
      end[k] = tasks * (k + 1) / n;
    }
  }

  template <class F>
  void claim(F&& task) {
    const int me = t_slot % n;
    for (int k = 0; k < n; ++k) {
      const int share = (me + k) % n;
      for (int64_t t; (t = cursor[share].fetch_add(1, std::memory_order_relaxed)) < end[share];) task(t);
    }
  }
};

class Pool {
 public:
  int threads() const { return int(workers_.size()) + 1; }

  void resize(int threads) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_ = false;
    const uint64_t now = generation_.load();  // read here: a worker may start after the first run() began
    for (int k = 1; k < threads; ++k) workers_.emplace_back([this, now, k] {
      t_slot = k;
      loop(now);
    });
  }

  // Runs job.work() on the caller and every worker; returns when all are done.
  void run(Job* job) {
    job_ = job;
    pending_.store(int(workers_.size()));
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      cv_.notify_all();
    }
    job->work();
    for (int spins = 0; pending_.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 4096) cpu_relax(); else std::this_thread::yield();
    }
  }

 private:
  void loop(uint64_t seen) {
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
      for (int k = 0; generation_.load(std::memory_order_acquire) == seen; ++k) {
        if ((k & 63) == 63 && std::chrono::steady_clock::now() > until) break;
        cpu_relax();
      }
      if (generation_.load() == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
      }
      seen = generation_.load();
      if (stop_) return;
      job_->work();
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  Job* job_ = nullptr;
  bool stop_ = false;
};

std::mutex g_pool_mutex;  // MindSpore may run two graphs' kernels from different threads
Pool* g_pool = nullptr;
int g_threads = 0;  // 0: the cores this process may use

int threads_to_use() {
  if (g_threads > 0) return g_threads;
  const unsigned n = std::thread::hardware_concurrency();
  return n ? int(n) : 1;
}

// GEMV: output rows per task, a multiple of 12 (the tiles take 4 or 3 rows), so that each thread gets about 8
// tasks: 128-row tasks left 7 of them for the 896-output matrices of the 0.5B shape, one thread idle at the end.
int64_t task_rows(int64_t out) {
  const int64_t per = out / (int64_t(threads_to_use()) * 8);
  return std::max<int64_t>(12, std::min<int64_t>(ROWS_PER_TASK, (per + 11) / 12 * 12));
}

void run(Job* job, bool parallel) {
  const int threads = threads_to_use();
  if (!parallel || threads <= 1) {
    job->work();
    return;
  }
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (g_pool == nullptr) g_pool = new Pool();  // never deleted: no joins at process exit
  if (g_pool->threads() != threads) g_pool->resize(threads);
  g_pool->run(job);
}

// ---- the jobs ------------------------------------------------------------------------------------

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// What follows a matmul in the fused ops, on y's columns [o0, o1) of `rows` rows (y and r have `out` columns,
// u `ldu`): with `up`, y = silu(y) * u (u = x . Wup^T); with a residual r, y += r.
void epilogue(float* y, int64_t rows, int64_t out, int64_t o0, int64_t o1, const float* u, int64_t ldu,
              const float* r) {
  for (int64_t m = 0; m < rows; ++m) {
    float* ym = y + m * out;
    if (u != nullptr)
      for (int64_t o = o0; o < o1; ++o) ym[o] = silu(ym[o]) * u[m * ldu + o];
    if (r != nullptr)
      for (int64_t o = o0; o < o1; ++o) ym[o] += r[m * out + o];
  }
}

// The GEMV form, threads splitting the output rows; optionally the fused ops' epilogue on each task's rows.
struct GemvJob : Job {
  RowsFn fn;
  const float* x;
  int64_t rows;
  const void* w;
  const float* b;
  int64_t in, out, step;
  float* y;
  const void* up = nullptr;  // SwiGLU: y = silu(x . W^T) * (x . up^T)
  const float* residual = nullptr;  // y += residual

  Shares shares;

  void work() override {
    float u[GEMV_MAX_ROWS * ROWS_PER_TASK];  // x . up^T for this task's rows (rows <= GEMV_MAX_ROWS with `up`)
    shares.claim([&](int64_t t) {
      const int64_t o0 = t * step, o1 = std::min(out, o0 + step);
      fn(x, rows, w, b, in, y, out, o0, o1);
      if (up != nullptr) fn(x, rows, up, nullptr, in, u - o0, ROWS_PER_TASK, o0, o1);  // u[m * ROWS_PER_TASK + o - o0]
      if (up != nullptr || residual != nullptr)
        epilogue(y, rows, out, o0, o1, up != nullptr ? u - o0 : nullptr, ROWS_PER_TASK, residual);
    });
  }
};

struct GemmJob : Job {
  GemmFn fn;
  const float* x;
  const void* w;
  const float* b;
  int64_t rows, in, out;
  float* y;
  int64_t col_tasks, row_step, tasks;

  void work() override {
    for (;;) {
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= tasks) return;
      const int64_t n0 = (t % col_tasks) * NC, m0 = (t / col_tasks) * row_step;
      fn(x, w, b, in, out, y, m0, std::min(rows, m0 + row_step), n0, std::min(out, n0 + NC));
    }
  }
};

struct EmbedJob : Job {
  WidenFn widen;
  const void* ids;
  bool ids64;
  const char* table;
  int64_t row_bytes, width, n;
  float* y;

  void work() override {
    constexpr int64_t IDS_PER_TASK = 16;
    for (;;) {
      const int64_t i0 = next.fetch_add(IDS_PER_TASK, std::memory_order_relaxed);
      if (i0 >= n) return;
      for (int64_t i = i0; i < std::min(n, i0 + IDS_PER_TASK); ++i) {
        const int64_t id = ids64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
        widen(table + id * row_bytes, width, y + i * width);
      }
    }
  }
};

bool is_f32(const char* dtype) { return weight_type(dtype) == W_F32; }

void matmul(const float* x, int64_t rows, const void* w, WType wt, const float* b, int64_t in, int64_t out, float* y,
            const void* up = nullptr, const float* residual = nullptr);

// x [M, I] . W[O, I]^T (+ b [O]) -> y [M, O]. With `prompt_rows` (the full graph's form, MsliteLlmGemmValid) a
// valid_length [B] int32 input comes before y: x holds B rows of n = M / B tokens, right-padded, and only each
// row's first valid_length tokens are computed, the padding rows zeroed: a prompt of 100 tokens in the
// 128-token graph costs 100 rows, not 128.
int gemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_bias,
         bool prompt_rows = false) {
  const int expected = 3 + (with_bias ? 1 : 0) + (prompt_rows ? 1 : 0);
  if (nparam != expected) return 1;
  const int vi = nparam - 2;  // valid_length, with prompt_rows
  const WType wt = weight_type(dtypes[1]);
  if (!is_f32(dtypes[0]) || wt == W_NONE || !is_f32(dtypes[nparam - 1]) || (with_bias && !is_f32(dtypes[2])) ||
      (prompt_rows && std::strcmp(dtypes[vi], "int32") != 0))
    return 2;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[nparam - 1] != 2 || (with_bias && ndims[2] != 1) ||
      (prompt_rows && ndims[vi] != 1))
    return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], out = shapes[1][0];
  const int64_t batch = prompt_rows ? shapes[vi][0] : 1;
  if (shapes[1][1] != in || shapes[nparam - 1][0] != rows || shapes[nparam - 1][1] != out) return 4;
  if ((with_bias && shapes[2][0] != out) || batch <= 0 || rows % batch) return 4;
  const float* x = static_cast<const float*>(params[0]);
  const void* w = params[1];
  const float* b = with_bias ? static_cast<const float*>(params[2]) : nullptr;
  float* y = static_cast<float*>(params[nparam - 1]);
  if (rows <= 0 || out <= 0) return 0;
  if (in <= 0) {  // an empty sum
    if (prompt_rows) return 4;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) y[r * out + o] = b ? b[o] : 0.f;
    return 0;
  }
  if (!prompt_rows) {
    matmul(x, rows, w, wt, b, in, out, y);
    return 0;
  }
  const int32_t* valid = static_cast<const int32_t*>(params[vi]);
  const int64_t n = rows / batch;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t used = std::max<int64_t>(0, std::min<int64_t>(n, valid[r]));
    if (used > 0) matmul(x + r * n * in, used, w, wt, b, in, out, y + r * n * out);
    std::fill(y + (r * n + used) * out, y + (r + 1) * n * out, 0.f);
  }
  return 0;
}

// y [rows, out] = x [rows, in] . W^T (+ b), shapes already checked, rows, out and in positive. The fused ops'
// epilogue (see `epilogue`): `up` [out, in] of W's dtype for SwiGLU, `residual` [rows, out] to add.
void matmul(const float* x, int64_t rows, const void* w, WType wt, const float* b, int64_t in, int64_t out,
            float* y, const void* up, const float* residual) {
  if ((up != nullptr || residual != nullptr) && rows > GEMV_MAX_ROWS) {  // the product(s), then the epilogue
    std::vector<float> u(up != nullptr ? size_t(rows * out) : 0);
    matmul(x, rows, w, wt, b, in, out, y);
    if (up != nullptr) matmul(x, rows, up, wt, nullptr, in, out, u.data());
    epilogue(y, rows, out, 0, out, up != nullptr ? u.data() : nullptr, out, residual);
    return;
  }
  const GemmFn gemm = g_kernels.gemm[wt];
  if (rows <= GEMV_MAX_ROWS || gemm == nullptr) {  // with the epilogue in each task (its buffer holds 16 rows)
    GemvJob job;
    job.fn = g_kernels.rows[wt];
    job.x = x, job.rows = rows, job.w = w, job.b = b, job.in = in, job.out = out, job.y = y;
    job.up = up, job.residual = residual;
    job.step = task_rows(out);
    job.shares.split((out + job.step - 1) / job.step, out >= MIN_PARALLEL_ROWS ? threads_to_use() : 1);
    run(&job, out >= MIN_PARALLEL_ROWS);
    return;
  }
  GemmJob job;
  job.fn = gemm;
  job.x = x, job.w = w, job.b = b, job.rows = rows, job.in = in, job.out = out, job.y = y;
  job.col_tasks = (out + NC - 1) / NC;
  // few outputs (k/v projections): split the rows of x too, so that every thread has work
  const int threads = threads_to_use();
  int64_t row_tasks = 1;
  if (job.col_tasks < 4 * threads) row_tasks = std::min((4 * threads + job.col_tasks - 1) / job.col_tasks,
                                                        (rows + 4 * MR - 1) / (4 * MR));
  row_tasks = std::max<int64_t>(row_tasks, 1);
  job.row_step = ((rows + row_tasks - 1) / row_tasks + MR - 1) / MR * MR;
  job.tasks = job.col_tasks * ((rows + job.row_step - 1) / job.row_step);
  run(&job, rows * out * in >= MIN_PARALLEL_WORK);
}

int embed(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 3) return 1;
  const bool ids64 = std::strcmp(dtypes[0], "int64") == 0;
  const WType wt = weight_type(dtypes[1]);
  if ((!ids64 && std::strcmp(dtypes[0], "int32") != 0) || wt == W_NONE || !is_f32(dtypes[2])) return 2;
  if (ndims[0] < 0 || ndims[1] != 2 || ndims[2] != ndims[0] + 1) return 3;
  const int64_t vocab = shapes[1][0], width = shapes[1][1];
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) {
    if (shapes[2][d] != shapes[0][d]) return 4;
    n *= shapes[0][d];
  }
  if (shapes[2][ndims[0]] != width) return 4;
  for (int64_t i = 0; i < n; ++i) {  // all ids first: nothing is written for a bad call
    const int64_t id = ids64 ? static_cast<const int64_t*>(params[0])[i] : static_cast<const int32_t*>(params[0])[i];
    if (id < 0 || id >= vocab) return 5;
  }
  EmbedJob job;
  job.widen = g_kernels.widen[wt];
  job.ids = params[0];
  job.ids64 = ids64;
  job.table = static_cast<const char*>(params[1]);
  job.row_bytes = width * (wt == W_F32 ? 4 : 2);
  job.width = width;
  job.n = n;
  job.y = static_cast<float*>(params[2]);
  run(&job, n * width >= MIN_PARALLEL_WORK);
  return 0;
}


// ---- fused decode-step ops -------------------------------------------------------------------------
// MindSpore ran ~1150 kernels per decoded token of the 0.5B shape; the ~1000 small ones and the gaps between them
// were a quarter of the float32 step and nearly half of the bfloat16 one (docs/performance-log.md, "The decode step:
// where the time goes, and fused ops", 2026-11-23). These fold the decode step's chains of small ops into one call
// each. Float32 activations only.

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

// x [M, E]; Wq [H*D, E], bq; Wk [KH*D, E], bk; Wv, bv; cos, sin [M, D] [; q_norm, k_norm [D], eps [1]]
// -> q [M, H*D], k, v [M, KH*D]: the three projections (one dispatch when M is small), the optional per-head
// RMSNorm of q and k (Qwen3), and RoPE on q and k. 12 params without the norms, 15 with them.
// q, k, v [rows, outs[m]] = x . W^T + b for the three (weights, bias) pairs in wb (W of type wt), then Qwen3's
// per-head norms (qn, kn; null: none) and RoPE on q and k (head size d): the q/k/v ops' shared body. The GEMV
// tasks of the three in one dispatch up to GEMV_MAX_ROWS rows, the GEMM form beyond.
void project_qkv_rope(const float* x, int64_t rows, int64_t in, WType wt, void* const* wb, const int64_t outs[3],
                      float* const ys[3], int64_t d, const float* cos, const float* sin, const float* qn,
                      const float* kn, float eps) {
  if (rows <= GEMV_MAX_ROWS || g_kernels.gemm[wt] == nullptr) {
    MultiGemvJob job;
    job.fn = g_kernels.rows[wt];
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

// x [M, I]; Wg, Wu [O, I] -> y [M, O] = silu(x . Wg^T) * (x . Wu^T) (the MLP before down_proj).
int swiglu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes);

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

// One new token per row against the KV cache: q [B, H*D]; K, V caches [B, KH, S, D]; valid_length [B] int32
// (positions 0 .. valid_length-1, the new one included, as written by the graph's ScatterNdUpdate) ->
// out [B, H*D]. Query head h reads key/value head h / (H / KH) (HF repeat_kv). Reads only the valid
// positions, where the MindSpore form multiplies the whole seq_length and masks.
struct AttentionJob : Job {
  const float *q, *k, *v;
  const int32_t* valid;
  const int32_t* rows;  // the cache row of each query row; nullptr: query row b reads cache row b
  int64_t batch, heads, kv_heads, seq, d, cache_rows;
  float* out;
  std::vector<int64_t> blocks;  // first query of each block, then `batch`

  int64_t row_of(int64_t b) const {
    return rows != nullptr ? std::min<int64_t>(std::max<int64_t>(rows[b], 0), cache_rows - 1) : b;
  }
  int64_t length_of(int64_t b) const { return std::max<int64_t>(0, std::min<int64_t>(seq, valid[b])); }

  // blocks of at most `most` consecutive queries reading one cache row
  void split(int64_t most) {
    blocks.clear();
    for (int64_t b = 0; b < batch; ++b)
      if (blocks.empty() || b - blocks.back() >= most || row_of(b) != row_of(blocks.back())) blocks.push_back(b);
    blocks.push_back(batch);
  }

  void work() override {
    const float scale = 1.0f / std::sqrt(float(d));
    const int64_t group = heads / kv_heads, nblocks = int64_t(blocks.size()) - 1;
    std::vector<float> qs, scores;
    std::vector<int64_t> lengths;
    std::vector<float*> outs;
    for (;;) {
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= nblocks * kv_heads) return;
      const int64_t blk = t / kv_heads, kvh = t % kv_heads, b0 = blocks[blk], b1 = blocks[blk + 1];
      const int64_t row = row_of(b0), nrows = (b1 - b0) * group;
      const float* kh = k + (row * kv_heads + kvh) * seq * d;
      const float* vh = v + (row * kv_heads + kvh) * seq * d;
      qs.resize(size_t(nrows * d));
      lengths.resize(size_t(nrows));
      outs.resize(size_t(nrows));
      int64_t longest = 0;
      for (int64_t b = b0; b < b1; ++b) {  // the block's query heads of kv head kvh, a row each
        std::memcpy(qs.data() + (b - b0) * group * d, q + (b * heads + kvh * group) * d,
                    size_t(group * d) * sizeof(float));
        for (int64_t g = 0; g < group; ++g) {
          lengths[(b - b0) * group + g] = length_of(b);
          outs[(b - b0) * group + g] = out + (b * heads + kvh * group + g) * d;
        }
        longest = std::max(longest, length_of(b));
      }
      scores.resize(size_t(std::max<int64_t>(nrows * longest, 1)));
      if (longest > 0) g_kernels.rows[W_F32](qs.data(), nrows, kh, nullptr, d, scores.data(), longest, 0, longest);
      g_kernels.attend_rows(scores.data(), nrows, longest, lengths.data(), scale, vh, d, outs.data());
    }
  }
};

// q [N, H*D] . the caches K, V [B, KH, S, D]: query row i attends to the first valid_length[i] positions of cache row
// i, or (with `rows` [N] int32, nparam 6) of cache row rows[i]: the chunk graph's step rows and piece tokens in one call.
int decode_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 5 && nparam != 6) return 1;
  const int out_index = nparam - 1;
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[1]) || !is_f32(dtypes[2]) || std::strcmp(dtypes[3], "int32") != 0 ||
      !is_f32(dtypes[out_index]) || (nparam == 6 && std::strcmp(dtypes[4], "int32") != 0))
    return 2;
  if (ndims[0] != 2 || ndims[1] != 4 || ndims[2] != 4 || ndims[3] != 1 || ndims[out_index] != 2 ||
      (nparam == 6 && ndims[4] != 1))
    return 3;
  const int64_t queries = shapes[0][0], cache_rows = shapes[1][0], kv_heads = shapes[1][1], seq = shapes[1][2],
                d = shapes[1][3];
  for (int k = 0; k < 4; ++k)
    if (shapes[2][k] != shapes[1][k]) return 4;
  if (d <= 0 || kv_heads <= 0 || shapes[0][1] % (kv_heads * d) || shapes[3][0] != queries ||
      shapes[out_index][0] != queries || shapes[out_index][1] != shapes[0][1] ||
      (nparam == 5 && queries != cache_rows) || (nparam == 6 && shapes[4][0] != queries))
    return 4;
  AttentionJob job;
  job.q = static_cast<const float*>(params[0]);
  job.k = static_cast<const float*>(params[1]);
  job.v = static_cast<const float*>(params[2]);
  job.valid = static_cast<const int32_t*>(params[3]);
  job.rows = nparam == 6 ? static_cast<const int32_t*>(params[4]) : nullptr;
  job.batch = queries, job.heads = shapes[0][1] / d, job.kv_heads = kv_heads, job.seq = seq, job.d = d;
  job.cache_rows = cache_rows;
  job.out = static_cast<float*>(params[out_index]);
  job.split(ATTENTION_BLOCK);
  int64_t longest = 0;
  for (int64_t b = 0; b < queries; ++b) longest = std::max<int64_t>(longest, job.valid[b]);
  run(&job, queries * job.heads * longest * d >= (int64_t(1) << 16));
  return 0;
}


// ---- timing the kernels in a graph (benchmarks/bench_decode_step.py --in_graph) ------------------------------
// With MSLITE_LLM_CPU_KERNELS_PROFILE=1 (read at load) each exported op adds its calls and wall time to a counter:
// what our kernels cost inside MindSpore's graph, against the step's whole time. Off: one predictable branch.
enum Op { OP_GEMV, OP_GEMV_BIAS, OP_GEMM_VALID, OP_EMBED, OP_RMS_NORM, OP_QKV_ROPE, OP_GEMV_ADD, OP_SWIGLU,
          OP_ATTENTION, OP_DECODE_QKV, OP_NORM_SWIGLU, OP_DECODE_TAIL, OP_COUNT };
const bool g_profile = std::getenv("MSLITE_LLM_CPU_KERNELS_PROFILE") != nullptr;
std::atomic<int64_t> g_profile_ns[OP_COUNT], g_profile_calls[OP_COUNT];

template <class F>
int timed(Op op, F&& f) {
  if (!g_profile) return f();
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = f();
  g_profile_ns[op] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                          .count();
  g_profile_calls[op] += 1;
  return rc;
}

}  // namespace

extern "C" {

int MsliteLlmGemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_GEMV, [&] { return gemv(nparam, params, ndims, shapes, dtypes, false); });
}

int MsliteLlmGemvBias(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_GEMV_BIAS, [&] { return gemv(nparam, params, ndims, shapes, dtypes, true); });
}

int MsliteLlmGemmValid(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  // with the bias: 5 params
  return timed(OP_GEMM_VALID, [&] { return gemv(nparam, params, ndims, shapes, dtypes, nparam == 5, true); });
}

int MsliteLlmEmbed(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_EMBED, [&] { return embed(nparam, params, ndims, shapes, dtypes); });
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

int MsliteLlmDecodeAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*,
                             void*) {
  return timed(OP_ATTENTION, [&] { return decode_attention(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmDecodeQkv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_DECODE_QKV, [&] { return decode_qkv(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmNormSwiGlu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_NORM_SWIGLU, [&] { return norm_swiglu(nparam, params, ndims, shapes, dtypes); });
}

int MsliteLlmDecodeTail(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return timed(OP_DECODE_TAIL, [&] { return decode_tail(nparam, params, ndims, shapes, dtypes); });
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

// The code path this machine runs: "avx512", "avx2" (AVX2 + FMA + F16C), "neon" or "generic".
const char* MsliteLlmIsa() { return g_kernels.isa; }

// Threads the kernels use; 0 restores the default (the machine's cores). The runtime passes its CPU thread count.
void MsliteLlmSetThreads(int threads) { g_threads = threads < 0 ? 0 : threads; }

}  // extern "C"
