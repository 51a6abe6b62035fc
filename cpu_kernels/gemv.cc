// mslite-llm CPU kernels: y = x . W^T (+ b) for a few rows of x, as MindSpore aot Custom ops.
//
// Why: MindSpore 2.10's CPU MatMul reads the weights with one core when x has one row
// (about 7.5 GB/s here), and decoding one token is that GEMV, 1.98 GB of weights for the
// Qwen2-0.5B shape. This kernel splits the output rows across threads and reads W once
// (scripts/PERFORMANCE.md). It is used only by the incremental graph of `--device cpu`
// folders; graphs for Atlas keep MindSpore's MatMul.
//
// Interface (MindSpore aot CPU): int F(int nparam, void** params, int* ndims, int64_t** shapes,
// const char** dtypes, void* stream, void* extra); 0 on success.
//   MsliteLlmGemv:     params = x [B, I] f32, W [O, I] f32, y [B, O] f32
//   MsliteLlmGemvBias: params = x [B, I] f32, W [O, I] f32, b [O] f32, y [B, O] f32
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MSLLM_X86 1
#endif

namespace {

int g_threads = 0;  // 0: OpenMP's default

int team_size() {
#ifdef _OPENMP
  return g_threads > 0 ? g_threads : omp_get_max_threads();
#else
  return 1;
#endif
}

float dot_generic(const float* a, const float* b, int64_t n) {
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

#ifdef MSLLM_X86
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  float r = _mm_cvtss_f32(h);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}
#endif

typedef float (*DotFn)(const float*, const float*, int64_t);

DotFn pick_dot() {
#ifdef MSLLM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return dot_avx2;
#endif
  return dot_generic;
}

const DotFn g_dot = pick_dot();

bool is_f32(const char* dtype) { return std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "float") == 0; }

int gemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_bias) {
  const int expected = with_bias ? 4 : 3;
  if (nparam != expected) return 1;
  for (int k = 0; k < nparam; ++k)
    if (!is_f32(dtypes[k])) return 2;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[nparam - 1] != 2) return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], out = shapes[1][0];
  if (shapes[1][1] != in || shapes[nparam - 1][0] != rows || shapes[nparam - 1][1] != out) return 4;
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  const float* b = with_bias ? static_cast<const float*>(params[2]) : nullptr;
  float* y = static_cast<float*>(params[nparam - 1]);
  const DotFn dot = g_dot;
  const int threads = team_size();
  // Output rows in blocks of 16, handed out 8 blocks at a time: a thread that the OS (or a busy
  // neighbour) holds back does not hold the others at the end of the loop.
  const int64_t blocks = (out + 15) / 16;
#pragma omp parallel for schedule(dynamic, 8) num_threads(threads) if (out >= 256)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t end = (blk + 1) * 16 < out ? (blk + 1) * 16 : out;
    for (int64_t o = blk * 16; o < end; ++o) {
      const float* wo = w + o * in;
      const float bias = b ? b[o] : 0.f;
      for (int64_t r = 0; r < rows; ++r) y[r * out + o] = dot(wo, x + r * in, in) + bias;
    }
  }
  return 0;
}

}  // namespace

extern "C" {

int MsliteLlmGemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return gemv(nparam, params, ndims, shapes, dtypes, false);
}

int MsliteLlmGemvBias(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void*, void*) {
  return gemv(nparam, params, ndims, shapes, dtypes, true);
}

// Threads the kernels use; 0 restores OpenMP's default. Called by the runtime with its CPU thread count.
void MsliteLlmSetThreads(int threads) { g_threads = threads < 0 ? 0 : threads; }

}  // extern "C"
