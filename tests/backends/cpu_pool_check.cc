// Checks dflash::Pool (dflash_jax/backends/cpu/cpu_pool.h) on its own, built and run by
// tests/test_cpu_pool.py: every part of every job runs exactly once, whichever thread claims it
// (its helper, or the caller taking it back), also when another thread keeps the cores busy and
// when two callers share the pool. Part 0 does no work, so the caller reaches for part 1 while its
// helper may: with the helper's compare-and-swap dropped (it ran whatever it saw posted), the
// 20000-job check failed in each of 3 runs ("part 2 of 4 ran 2 times"). Prints one line per check;
// exits 1 on the first failure.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "cpu_pool.h"

namespace {

constexpr int kMaxParts = 8;

struct Call {
  std::atomic<int> runs[kMaxParts];
  std::atomic<int> by_caller{0};
  std::thread::id caller;
};

void CountPart(const void* context, int part, int parts) {
  Call& call = *const_cast<Call*>(static_cast<const Call*>(context));
  call.runs[part].fetch_add(1);
  if (std::this_thread::get_id() == call.caller) call.by_caller.fetch_add(1);
  volatile double sink = 0;  // none in part 0: the caller claims the next part as its helper may
  for (int i = 0; i < 200 * part; ++i) sink = sink + i * 0.5;
  (void)parts;
}

// Runs `calls` jobs of 1..max_parts parts through `pool`; returns the number of parts the calling
// thread ran, or -1 (after printing why) when a part ran other than exactly once.
long RunJobs(dflash::Pool& pool, int calls, int max_parts, unsigned seed) {
  long by_caller = 0;
  for (int c = 0; c < calls; ++c) {
    const int parts = 1 + static_cast<int>((seed = seed * 1103515245u + 12345u) >> 16) % max_parts;
    Call call;
    for (auto& r : call.runs) r.store(0);
    call.caller = std::this_thread::get_id();
    pool.RunParts(CountPart, &call, parts);
    for (int p = 0; p < kMaxParts; ++p) {
      const int expected = p < parts ? 1 : 0;
      if (call.runs[p].load() != expected) {
        std::printf("FAIL: call %d, part %d of %d ran %d times\n", c, p, parts, call.runs[p].load());
        return -1;
      }
    }
    by_caller += call.by_caller.load();
  }
  return by_caller;
}

int Check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAIL", what);
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  {  // no helper threads: the caller takes back every posted part
    dflash::Pool pool(3, /*start_helpers=*/false);
    long total = 0;
    for (int c = 0; c < 500; ++c) {
      Call call;
      for (auto& r : call.runs) r.store(0);
      call.caller = std::this_thread::get_id();
      pool.RunParts(CountPart, &call, 4);
      for (int p = 0; p < 4; ++p)
        if (call.runs[p].load() != 1) return Check(false, "take-back: a part ran other than once");
      total += call.by_caller.load();
    }
    if (Check(total == 500 * 4, "take-back: the caller ran all 2000 parts of 500 jobs without helpers")) return 1;
  }
  dflash::Pool& pool = *new dflash::Pool(3);  // never destroyed, as SharedPool(): its helpers run until exit
  {
    const long by_caller = RunJobs(pool, 20000, 4, 1u);
    if (by_caller < 0) return 1;
    std::printf("ok: 20000 jobs of 1-4 parts, each part once (%ld run by the caller)\n", by_caller);
  }
  {  // a busy thread per core competes with the helpers, so the caller takes some parts back
    std::atomic<bool> stop{false};
    std::vector<std::thread> busy;
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < cores; ++i)
      busy.emplace_back([&] { while (!stop.load(std::memory_order_relaxed)) {} });
    const long by_caller = RunJobs(pool, 5000, 4, 2u);
    stop.store(true);
    for (auto& t : busy) t.join();
    if (by_caller < 0) return 1;
    std::printf("ok: 5000 jobs beside %u busy threads, each part once (%ld run by the caller)\n", cores, by_caller);
  }
  {  // two callers at once: the one that finds the pool taken runs its parts itself
    long results[2] = {0, 0};
    std::thread other([&] { results[1] = RunJobs(pool, 5000, 4, 3u); });
    results[0] = RunJobs(pool, 5000, 4, 4u);
    other.join();
    if (Check(results[0] >= 0 && results[1] >= 0, "two callers sharing the pool, 5000 jobs each, each part once"))
      return 1;
  }
  return 0;
}
