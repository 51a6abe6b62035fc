// The thread pool (pool.h says why a pool of our own): workers that spin briefly after a call, then sleep.
#include "pool.h"

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace msllm {

thread_local int t_slot = 0;

namespace {

const int SPIN_US = std::getenv("MSLLM_SPIN_US") ? std::atoi(std::getenv("MSLLM_SPIN_US")) : 100;  // how long an idle worker polls for the next call before sleeping

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

// The cores, read once: std::thread::hardware_concurrency() reads /sys/devices/system/cpu/online on every call
// (glibc's get_nprocs), ~5 us on a VM, and threads_to_use is asked several times per matmul (a SmolLM2 int4 layer
// call spent about a third of its time there: docs/performance-log.md 53)
int cores() {
  static const int n = [] {
    const unsigned c = std::thread::hardware_concurrency();
    return c ? int(c) : 1;
  }();
  return n;
}

}  // namespace

int threads_to_use() { return g_threads > 0 ? g_threads : cores(); }

void set_threads(int threads) { g_threads = threads < 0 ? 0 : threads; }

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

void PartsJob::add(const float* x, int64_t rows, const void* w, const float* b, float* y, int64_t out,
                   int64_t step) {
  step = step > 0 ? step : task_rows(out);
  parts.push_back({x, rows, w, b, y, out, step});
  first_task.push_back(first_task.back() + (out + step - 1) / step);
}

void PartsJob::work() {
  shares.claim([&](int64_t t) {
    const size_t m = size_t(std::upper_bound(first_task.begin(), first_task.end(), t) - first_task.begin()) - 1;
    const Part& p = parts[m];
    const int64_t o0 = (t - first_task[m]) * p.step;
    fn(p.x, p.rows, p.w, p.b, in, p.y, p.out, o0, std::min(p.out, o0 + p.step));
  });
}

void PartsJob::run_all() {
  int64_t outs = 0;
  for (const Part& p : parts) outs += p.out;
  const bool parallel = outs >= MIN_PARALLEL_ROWS;
  shares.split(first_task.back(), parallel ? threads_to_use() : 1);
  run(this, parallel);
}

}  // namespace msllm
