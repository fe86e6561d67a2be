// The native decode step's own worker threads (decode_cpu.cpp), instead of torch's OpenMP team.
//
// Why: libgomp keeps one team per thread that ever started a parallel region, and once its
// managed threads outnumber the CPUs it throttles every team's spin to ~1000 iterations, so its
// workers sleep between the step's ~150 regions and each region pays a futex wake (50-80 us on
// these VMs). A server always has two such threads: the main thread loads the model with torch
// ops, the engine thread decodes. Measured on the 2-core Xeon, SmolLM2 one row: 5 ms a step from
// the only OpenMP thread, 10-15 ms from a second one (52 tok/s in the server against 154 in
// process). This pool does not depend on who else uses OpenMP.
//
// parallel_for(begin, end, grain, f) splits [begin, end) as at::parallel_for does (at most
// ceil((end - begin) / grain) chunks, one per thread, of ceil(range / chunks) items each); the
// calling thread runs chunk 0. Workers spin (pause) for KVSERVE_NATIVE_SPIN_US microseconds
// (default 200) after their last chunk, then sleep on a condition variable, so an idle server
// takes no CPU and a step's regions, microseconds apart, find them awake. The number of threads
// is torch's (at::get_num_threads(), -t), read at each call; each calling thread (an engine) has
// its own pool. After fork() the child starts a new
// pool on first use (the parent's workers do not exist there).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvserve_pool {

class Pool {
 public:
  explicit Pool(int workers) {
    const char* s = std::getenv("KVSERVE_NATIVE_SPIN_US");
    spin_ns_ = (s && *s ? std::atoll(s) : 200) * 1000;
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { loop(i + 1); });
    for (auto& t : threads_) t.detach();  // they live as long as the process
  }

  int workers() const { return static_cast<int>(threads_.size()); }

  // f(chunk index, chunk begin, chunk end) for every chunk; returns when all ran
  void run(int64_t begin, int64_t end, int64_t chunks, const std::function<void(int64_t, int64_t)>& f) {
    const int64_t per = (end - begin + chunks - 1) / chunks;
    f_ = &f;
    begin_ = begin;
    end_ = end;
    per_ = per;
    chunks_ = chunks;
    acks_.store(0, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_seq_cst);  // publishes the job above
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(m_);
      cv_.notify_all();
    }
    f(begin, std::min(end, begin + per));
    // every worker acknowledges every job (so none reads the next one's fields as this one's)
    const int n = workers();
    // (yielding now and then: a worker woken onto this CPU runs instead of waiting out our slice)
    for (int k = 1; acks_.load(std::memory_order_acquire) < n; ++k) {
      _mm_pause();
      if (k % 64 == 0) std::this_thread::yield();
    }
  }

 private:
  void loop(int id) {
    uint64_t seen = 0;  // the generation the pool was made at (a job may come before this thread runs)
    for (;;) {
      uint64_t g = gen_.load(std::memory_order_acquire);
      if (g == seen) {
        const auto t0 = std::chrono::steady_clock::now();
        int k = 0;
        while ((g = gen_.load(std::memory_order_acquire)) == seen) {
          _mm_pause();
          if (++k % 64 != 0) continue;
          std::this_thread::yield();
          if (std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() >
              spin_ns_) {
            std::unique_lock<std::mutex> lk(m_);
            sleeping_.fetch_add(1, std::memory_order_seq_cst);
            cv_.wait(lk, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
            sleeping_.fetch_sub(1, std::memory_order_seq_cst);
            k = 0;
          }
        }
      }
      seen = g;
      const int64_t b = begin_ + id * per_;
      if (id < chunks_ && b < end_) (*f_)(b, std::min(end_, b + per_));
      acks_.fetch_add(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> acks_{0};
  std::atomic<int> sleeping_{0};
  std::mutex m_;
  std::condition_variable cv_;
  const std::function<void(int64_t, int64_t)>* f_ = nullptr;
  int64_t begin_ = 0, end_ = 0, per_ = 0, chunks_ = 0;
  int64_t spin_ns_ = 200000;
};

// one pool per calling thread (two engines in one process decode at once without sharing one)
inline Pool*& pool_slot() {
  thread_local Pool* p = nullptr;
  return p;
}

inline void forget_pool_in_child() { pool_slot() = nullptr; }  // the parent's workers are not here

// [begin, end) in chunks of at least `grain` over torch's thread count; f(chunk begin, chunk end)
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  const int64_t nt = std::max(1, at::get_num_threads());
  const int64_t chunks = std::min<int64_t>(nt, (end - begin + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1) {
    f(begin, end);
    return;
  }
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  Pool*& p = pool_slot();
  if (p == nullptr || p->workers() < nt - 1) p = new Pool(static_cast<int>(nt - 1));  // an old pool's workers sleep on
  const std::function<void(int64_t, int64_t)> fn = [&](int64_t b, int64_t e) { f(b, e); };
  p->run(begin, end, chunks, fn);
}

}  // namespace kvserve_pool
