// mslite-llm CPU kernels: y = x . W^T (+ b) for a few rows of x, as MindSpore aot Custom ops.
//
// Why: MindSpore 2.10's CPU MatMul reads the weights with one core when x has one row
// (about 7.5 GB/s here), and decoding one token is that GEMV, 1.98 GB of weights for the
// Qwen2-0.5B shape. This kernel splits the output rows across threads and reads W once
// (scripts/PERFORMANCE.md). It is used only by the incremental graph of `--device cpu`
// folders; graphs for Atlas keep MindSpore's MatMul.
//
// Threads: a small pool of our own rather than OpenMP, because the op runs ~170 times per token
// between MindSpore's own kernels: workers spin only briefly (SPIN_US) after a call and then
// sleep, so they do not compete with MindSpore's threads on a small machine, and the process's
// libgomp (torch loads one) plays no part.
//
// Interface (MindSpore aot CPU): int F(int nparam, void** params, int* ndims, int64_t** shapes,
// const char** dtypes, void* stream, void* extra); 0 on success.
//   MsliteLlmGemv:     params = x [B, I] f32, W [O, I] f32, y [B, O] f32
//   MsliteLlmGemvBias: params = x [B, I] f32, W [O, I] f32, b [O] f32, y [B, O] f32
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MSLLM_X86 1
#endif

namespace {

constexpr int64_t ROWS_PER_TASK = 128;  // output rows a thread takes at a time
constexpr int64_t MIN_PARALLEL_ROWS = 256;
constexpr int SPIN_US = 100;  // how long an idle worker polls for the next call before sleeping

inline void cpu_relax() {
#ifdef MSLLM_X86
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// ---- the dot products --------------------------------------------------------------------------

// y[r * ldy + o] = x_r . W_o (+ b_o) for output rows [o0, o1) and every row r of x.
typedef void (*RowsFn)(const float* x, int64_t rows, const float* w, const float* b, int64_t in, float* y,
                       int64_t ldy, int64_t o0, int64_t o1);

void rows_generic(const float* x, int64_t rows, const float* w, const float* b, int64_t in, float* y, int64_t ldy,
                  int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* wo = w + o * in;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * in;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      int64_t i = 0;
      for (; i + 4 <= in; i += 4) {
        s0 += wo[i] * xr[i];
        s1 += wo[i + 1] * xr[i + 1];
        s2 += wo[i + 2] * xr[i + 2];
        s3 += wo[i + 3] * xr[i + 3];
      }
      for (; i < in; ++i) s0 += wo[i] * xr[i];
      y[r * ldy + o] = (s0 + s1) + (s2 + s3) + (b ? b[o] : 0.f);
    }
  }
}

#ifdef MSLLM_X86
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// R rows of x by C rows of W at a time, R*C accumulators in registers: each load feeds several FMAs.
template <int R, int C>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* x, const float* w, const float* b, int64_t in,
                                                            float* y, int64_t ldy, int64_t o) {
  const int64_t in8 = in & ~int64_t(7);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* wo = w + o * in;
  for (int64_t i = 0; i < in8; i += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(wo + c * in + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * in + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t i = in8; i < in; ++i) s += wo[c * in + i] * x[r * in + i];
      y[r * ldy + o + c] = s + (b ? b[o + c] : 0.f);
    }
  }
}

__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, int64_t rows, const float* w, const float* b,
                                                     int64_t in, float* y, int64_t ldy, int64_t o0, int64_t o1) {
  int64_t o = o0;
  if (rows == 1) {  // decode at batch 1: four weight streams per x load
    for (; o + 4 <= o1; o += 4) tile_avx2<1, 4>(x, w, b, in, y, ldy, o);
  } else {  // four weight rows at a time against two rows of x, again for the next two while they are in cache
    for (; o + 4 <= o1; o += 4) {
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2) tile_avx2<2, 4>(x + r * in, w, b, in, y + r * ldy, ldy, o);
      if (r < rows) tile_avx2<1, 4>(x + r * in, w, b, in, y + r * ldy, ldy, o);
    }
  }
  if (o < o1) rows_generic(x, rows, w, b, in, y, ldy, o, o1);
}
#endif

RowsFn pick_rows() {
#ifdef MSLLM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return rows_avx2;
#endif
  return rows_generic;
}

const RowsFn g_rows = pick_rows();

// ---- the thread pool ---------------------------------------------------------------------------

struct Job {
  const float* x;
  int64_t rows;
  const float* w;
  const float* b;
  int64_t in, out;
  float* y;
  std::atomic<int64_t> next{0};

  void work() {
    for (;;) {
      const int64_t o0 = next.fetch_add(ROWS_PER_TASK, std::memory_order_relaxed);
      if (o0 >= out) return;
      g_rows(x, rows, w, b, in, y, out, o0, std::min(out, o0 + ROWS_PER_TASK));
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
    for (int k = 1; k < threads; ++k) workers_.emplace_back([this, now] { loop(now); });
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

int default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n ? int(n) : 1;
}

bool is_f32(const char* dtype) { return std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "float") == 0; }

int gemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, bool with_bias) {
  const int expected = with_bias ? 4 : 3;
  if (nparam != expected) return 1;
  for (int k = 0; k < nparam; ++k)
    if (!is_f32(dtypes[k])) return 2;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[nparam - 1] != 2 || (with_bias && ndims[2] != 1)) return 3;
  const int64_t rows = shapes[0][0], in = shapes[0][1], out = shapes[1][0];
  if (shapes[1][1] != in || shapes[nparam - 1][0] != rows || shapes[nparam - 1][1] != out) return 4;
  if (with_bias && shapes[2][0] != out) return 4;
  Job job;
  job.x = static_cast<const float*>(params[0]);
  job.w = static_cast<const float*>(params[1]);
  job.b = with_bias ? static_cast<const float*>(params[2]) : nullptr;
  job.y = static_cast<float*>(params[nparam - 1]);
  job.rows = rows;
  job.in = in;
  job.out = out;
  const int threads = g_threads > 0 ? g_threads : default_threads();
  if (threads <= 1 || out < MIN_PARALLEL_ROWS) {
    job.work();
    return 0;
  }
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (g_pool == nullptr) g_pool = new Pool();  // never deleted: no joins at process exit
  if (g_pool->threads() != threads) g_pool->resize(threads);
  g_pool->run(&job);
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

// Threads the kernels use; 0 restores the default (the machine's cores). The runtime passes its CPU thread count.
void MsliteLlmSetThreads(int threads) { g_threads = threads < 0 ? 0 : threads; }

}  // extern "C"
