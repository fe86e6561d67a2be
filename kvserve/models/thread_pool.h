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
// is torch's (at::get_num_threads(), -t), read at each call (a new pool when it changes); each
// calling thread (an engine) has its own pool, joined when that thread ends. A nested call inside a
// chunk runs serially; an exception from any chunk is rethrown to the caller once every worker is
// done with the job. After fork() the child starts a new
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
#include <exception>
#include <memory>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvserve_pool {

// true inside a chunk (on the caller and on the workers): a nested parallel_for runs serially
inline bool& in_region() {
  thread_local bool r = false;
  return r;
}

class Pool {
 public:
  explicit Pool(int workers) {
    const char* s = std::getenv("KVSERVE_NATIVE_SPIN_US");
    spin_ns_ = (s && *s ? std::atoll(s) : 200) * 1000;
    try {
      for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { loop(i + 1); });
    } catch (...) {  // a thread could not start: stop the ones that did, then report
      stop();
      throw;
    }
  }

  ~Pool() { stop(); }

  int workers() const { return static_cast<int>(threads_.size()); }

  // f(chunk begin, chunk end) for every chunk; returns when all ran. An exception from a chunk
  // (on any thread) is rethrown here, after every worker is done with this job.
  void run(int64_t begin, int64_t end, int64_t chunks, const std::function<void(int64_t, int64_t)>& f) {
    const int64_t per = (end - begin + chunks - 1) / chunks;
    f_ = &f;
    begin_ = begin;
    end_ = end;
    per_ = per;
    chunks_ = chunks;
    error_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    acks_.store(0, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_seq_cst);  // publishes the job above
    wake();
    in_region() = true;
    try {
      f(begin, std::min(end, begin + per));
    } catch (...) {
      fail(std::current_exception());
    }
    in_region() = false;
    // every worker acknowledges every job (so none reads the next one's fields as this one's)
    // (yielding now and then: a worker woken onto this CPU runs instead of waiting out our slice)
    const int n = workers();
    for (int k = 1; acks_.load(std::memory_order_acquire) < n; ++k) {
      _mm_pause();
      if (k % 64 == 0) std::this_thread::yield();
    }
    if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
  }

 private:
  void wake() {
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(m_);
      cv_.notify_all();
    }
  }

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lk(err_m_);
    if (!failed_.load(std::memory_order_relaxed)) {
      error_ = e;
      failed_.store(true, std::memory_order_release);
    }
  }

  void stop() {
    stopping_.store(true, std::memory_order_seq_cst);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    {
      std::lock_guard<std::mutex> lk(m_);
      cv_.notify_all();
    }
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

  void loop(int id) {
    in_region() = true;  // a chunk's nested parallel_for runs serially on this worker
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
      if (stopping_.load(std::memory_order_seq_cst)) return;
      seen = g;
      const int64_t b = begin_ + id * per_;
      if (id < chunks_ && b < end_) {
        try {
          (*f_)(b, std::min(end_, b + per_));
        } catch (...) {
          fail(std::current_exception());
        }
      }
      acks_.fetch_add(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> acks_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  std::mutex m_, err_m_;
  std::condition_variable cv_;
  std::exception_ptr error_;
  const std::function<void(int64_t, int64_t)>* f_ = nullptr;
  int64_t begin_ = 0, end_ = 0, per_ = 0, chunks_ = 0;
  int64_t spin_ns_ = 200000;
};

// one pool per calling thread (two engines in one process decode at once without sharing one);
// its workers are joined when that thread ends
inline std::unique_ptr<Pool>& pool_slot() {
  thread_local std::unique_ptr<Pool> p;
  return p;
}

// after fork() only the forking thread exists: forget (leak) its pool without joining threads
// that are not there; the child makes a new one on first use
inline void forget_pool_in_child() { pool_slot().release(); }

inline void register_atfork() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
}

// [begin, end) in chunks of at least `grain` over torch's thread count; f(chunk begin, chunk end).
// Inside a chunk (nested) it runs serially.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  const int64_t nt = std::max(1, at::get_num_threads());
  const int64_t g = std::max<int64_t>(grain, 1);
  const int64_t chunks = std::min<int64_t>(nt, (end - begin + g - 1) / g);
  if (chunks <= 1 || in_region()) {
    f(begin, end);
    return;
  }
  register_atfork();
  std::unique_ptr<Pool>& p = pool_slot();
  if (!p || p->workers() != nt - 1) {
    p.reset();  // the old workers joined (a changed thread count)
    p = std::make_unique<Pool>(static_cast<int>(nt - 1));
  }
  const std::function<void(int64_t, int64_t)> fn = [&](int64_t b, int64_t e) { f(b, e); };
  p->run(begin, end, chunks, fn);
}

}  // namespace kvserve_pool
