// The thread pool every kernel family of the library runs its tasks on, and the thread count they share.
//
// Threads: a small pool of our own rather than OpenMP, because the op runs ~170 times per token
// between MindSpore's own kernels: workers spin only briefly (SPIN_US) after a call and then
// sleep, so they do not compete with MindSpore's threads on a small machine, and the process's
// libgomp (torch loads one) plays no part. One pool for the whole library (the float and the quantized matmuls, the
// attention, the fused ops): a call's tasks start on threads that are already spinning, and one count (set_threads:
// what cpu_kernels.set_threads last gave, else the machine's cores) governs them all.
#ifndef MSLITE_LLM_CPU_KERNELS_POOL_H_
#define MSLITE_LLM_CPU_KERNELS_POOL_H_

#include "common.h"

namespace msllm {

constexpr int64_t ROWS_PER_TASK = 128;  // GEMV: at most this many output rows per task (task_rows)
constexpr int64_t MIN_PARALLEL_ROWS = 256;  // GEMV: fewer output rows run on the caller

extern thread_local int t_slot;  // this thread's place in the pool: the caller 0, the workers 1, 2, ...

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

// Runs job->work() on the caller and, when `parallel` and more than one thread is to be used, on every worker of
// the pool too; returns when all are done.
void run(Job* job, bool parallel);

// Several matrices' rows kernels in one pool dispatch: part m is y_m [rows_m, out_m] = x_m [rows_m, in] . W_m^T
// (+ b_m), in tasks of step_m outputs (default task_rows), each thread a contiguous share of all the parts' tasks
// in order. The decode step's q/k/v (one x, three weights: decode_ops.cc) and a mixture of experts' chosen experts
// (each its own rows: moe.cc) run through it.
struct PartsJob : Job {
  RowsFn fn = nullptr;
  int64_t in = 0;
  struct Part {
    const float* x;
    int64_t rows;
    const void* w;
    const float* b;
    float* y;
    int64_t out, step;
  };
  std::vector<Part> parts;
  std::vector<int64_t> first_task{0};
  Shares shares;

  void add(const float* x, int64_t rows, const void* w, const float* b, float* y, int64_t out, int64_t step = 0);
  void work() override;
  // every part's tasks, over the pool where their outputs together reach MIN_PARALLEL_ROWS
  void run_all();
};

// The threads the kernels use: what set_threads last gave, else the cores this process may use.
int threads_to_use();

// Threads the kernels use; 0 (or less) restores the default. MsliteLlmSetThreads.
void set_threads(int threads);

// GEMV: output rows per task, a multiple of 12 (the tiles take 4 or 3 rows), so that each thread gets about 8
// tasks: 128-row tasks left 7 of them for the 896-output matrices of the 0.5B shape, one thread idle at the end.
int64_t task_rows(int64_t out);

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_POOL_H_
