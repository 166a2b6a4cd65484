// The helper threads both CPU kernels split their work over (cpu_rows_matmul.cc,
// cpu_cache_attention.cc; one library, one pool per process): `RunParts` posts parts 1.. of a job
// to helper threads, runs part 0 on the calling thread, and returns when all are done. A caller that
// finds the pool taken (XLA runs independent operations concurrently) runs every part itself.
// After a part a helper spins for kSpin, yielding its core to any other runnable thread every 64
// pauses, then sleeps: a decode step calls the kernels some 200 times, every 50-100 us, and a
// helper woken from sleep each time (kSpin 0) cost SmolLM2's whole greedy decode (the Q4_1 target,
// 2 cores) 14.1-16.4 ms per autoregressive step against 11.5-12.0 with a 1 ms spin, and 19.8-23.5
// against 16.9-17.3 ms per speculative cycle of block 2 (one process, both builds called
// alternately, 3 prompts x 96 tokens, median of 4-5 rounds, 2-3 runs; identical tokens). (Earlier,
// spinning 300 us without yielding had slowed a step, 38 -> 47 ms, when XLA's own threads did
// more of it; the kernels now do most of a step.)
//
// A part no helper has taken when the caller is done with its own is taken back and run by the
// caller (each part is claimed by exactly one thread, a compare-and-swap on its slot), and the
// caller yields while it waits for the parts helpers did take. Without that, a busy machine made
// the kernels wait on helpers the OS had not scheduled: with one other busy process on the 2
// cores, SmolLM2's greedy decode of 3 prompts x 48 tokens took 7.97 s instead of 0.88 s.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace dflash {

// Part `part` of `parts` of some work described by `context`.
using PartFn = void (*)(const void* context, int part, int parts);

class Pool {
 public:
  // start_helpers false (tests/cpu_pool_check.cc): the slots without their threads, so that the
  // caller takes back every part it posts.
  explicit Pool(int helpers, bool start_helpers = true) : slots_(helpers) {
    if (!start_helpers) return;
    for (int i = 0; i < helpers; ++i) std::thread([this, i] { Loop(i); }).detach();
  }
  int helpers() const { return static_cast<int>(slots_.size()); }

  // Runs fn(context, p, parts) for p in [0, parts), parts <= helpers() + 1.
  void RunParts(PartFn fn, const void* context, int parts) {
    if (parts <= 1 || busy_.test_and_set(std::memory_order_acquire)) {
      for (int p = 0; p < parts; ++p) fn(context, p, parts);
      return;
    }
    for (int i = 1; i < parts; ++i) Post(i - 1, Job{fn, context, i, parts});
    fn(context, 0, parts);
    for (int i = 1; i < parts; ++i) TakeBackOrWait(i - 1);
    busy_.clear(std::memory_order_release);
  }

 private:
  struct Job {
    PartFn fn;
    const void* context;
    int part, parts;
  };
  static constexpr int kIdle = 0, kPosted = 1, kTaken = 2, kDone = 3;
  static constexpr auto kSpin = std::chrono::microseconds(1000);

  struct Slot {
    std::atomic<int> state{kIdle};
    std::atomic<bool> sleeping{false};
    std::mutex mu;
    std::condition_variable cv;
    Job job{};
  };

  void Post(int i, const Job& job) {
    Slot& s = slots_[i];
    s.job = job;
    s.state.store(kPosted);
    if (s.sleeping.load()) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.cv.notify_one();
    }
  }

  // The posted job of slot s for the thread that calls this first (its helper or the caller).
  static bool Claim(Slot& s) {
    int posted = kPosted;
    return s.state.compare_exchange_strong(posted, kTaken, std::memory_order_acquire);
  }

  static void Run(const Job& j) { j.fn(j.context, j.part, j.parts); }

  // Slot i's part: run here if its helper has not claimed it yet, else waited for.
  void TakeBackOrWait(int i) {
    Slot& s = slots_[i];
    if (Claim(s)) {
      Run(s.job);
    } else {
      for (int spins = 1; s.state.load(std::memory_order_acquire) != kDone; ++spins) {
        _mm_pause();
        if (spins % 64 == 0) std::this_thread::yield();
      }
    }
    s.state.store(kIdle, std::memory_order_release);
  }

  void Loop(int i) {
    Slot& s = slots_[i];
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; s.state.load(std::memory_order_acquire) != kPosted; ++spins) {
        _mm_pause();
        if (spins % 64 == 0) std::this_thread::yield();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(s.mu);
          s.sleeping.store(true);
          s.cv.wait(lock, [&] { return s.state.load() == kPosted; });
          s.sleeping.store(false);
        }
      }
      if (!Claim(s)) continue;  // the caller took it back
      Run(s.job);
      s.state.store(kDone, std::memory_order_release);
    }
  }

  std::vector<Slot> slots_;
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
};

// The process's pool: a helper per further core (at most 7), made on first use, never destroyed.
Pool& SharedPool();

}  // namespace dflash
