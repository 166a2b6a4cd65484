// y [M, N] = x [M, K] . w [N, K]^T in float32 for a few rows M: the weight products of a decode
// step or a short verify on a CPU, where XLA's GEMM kernels read the weights more than once for
// 2-16 rows (SmolLM2's LM head: 1 row 5 ms, 2 rows 17 ms). Here every weight row is read from
// memory once: four weight rows at a time are dotted with two rows of x (eight AVX2 accumulators),
// further pairs of x rows re-read the four weight rows from L1. The output columns of a large
// enough product are split between the calling thread and a helper thread per further core. The
// helpers sleep between calls: spinning for them (300 us) slowed a SmolLM2 decode step with a
// cache from 38 to 47 ms on 2 cores, because it took a core from XLA's own threads.
//
// Built by dflash_jax/kernels/cpu_matmul.py with the C++ compiler of the machine (-mavx2 -mfma)
// and called through XLA's FFI as the custom call "dflash_rows_matmul".
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 shuffled = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, shuffled);
  shuffled = _mm_movehl_ps(shuffled, s);
  return _mm_cvtss_f32(_mm_add_ss(s, shuffled));
}

// Output columns [n0, n1): y[m * N + n] = sum_k x[m * K + k] * w[n * K + k].
void RowsMatmulColumns(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t n1) {
  const int64_t k8 = K & ~int64_t{7};
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* w0 = w + n * K;
    const float* w1 = w0 + K;
    const float* w2 = w1 + K;
    const float* w3 = w2 + K;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
      const float* xa = x + m * K;
      const float* xb = xa + K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int64_t k = 0; k < k8; k += 8) {
        const __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
        const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
        const __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
        a0 = _mm256_fmadd_ps(va, v0, a0);
        a1 = _mm256_fmadd_ps(va, v1, a1);
        a2 = _mm256_fmadd_ps(va, v2, a2);
        a3 = _mm256_fmadd_ps(va, v3, a3);
        b0 = _mm256_fmadd_ps(vb, v0, b0);
        b1 = _mm256_fmadd_ps(vb, v1, b1);
        b2 = _mm256_fmadd_ps(vb, v2, b2);
        b3 = _mm256_fmadd_ps(vb, v3, b3);
      }
      float ra[4] = {HorizontalSum(a0), HorizontalSum(a1), HorizontalSum(a2), HorizontalSum(a3)};
      float rb[4] = {HorizontalSum(b0), HorizontalSum(b1), HorizontalSum(b2), HorizontalSum(b3)};
      for (int64_t k = k8; k < K; ++k) {
        ra[0] += xa[k] * w0[k]; ra[1] += xa[k] * w1[k]; ra[2] += xa[k] * w2[k]; ra[3] += xa[k] * w3[k];
        rb[0] += xb[k] * w0[k]; rb[1] += xb[k] * w1[k]; rb[2] += xb[k] * w2[k]; rb[3] += xb[k] * w3[k];
      }
      for (int j = 0; j < 4; ++j) {
        y[m * N + n + j] = ra[j];
        y[(m + 1) * N + n + j] = rb[j];
      }
    }
    if (m < M) {  // an odd last row
      const float* xa = x + m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < k8; k += 8) {
        const __m256 va = _mm256_loadu_ps(xa + k);
        a0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w0 + k), a0);
        a1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w1 + k), a1);
        a2 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w2 + k), a2);
        a3 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w3 + k), a3);
      }
      float ra[4] = {HorizontalSum(a0), HorizontalSum(a1), HorizontalSum(a2), HorizontalSum(a3)};
      for (int64_t k = k8; k < K; ++k) {
        ra[0] += xa[k] * w0[k]; ra[1] += xa[k] * w1[k]; ra[2] += xa[k] * w2[k]; ra[3] += xa[k] * w3[k];
      }
      for (int j = 0; j < 4; ++j) y[m * N + n + j] = ra[j];
    }
  }
  for (; n < n1; ++n) {  // the last n1 % 4 columns
    const float* w0 = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xa = x + m * K;
      __m256 a0 = _mm256_setzero_ps();
      for (int64_t k = 0; k < k8; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xa + k), _mm256_loadu_ps(w0 + k), a0);
      float r = HorizontalSum(a0);
      for (int64_t k = k8; k < K; ++k) r += xa[k] * w0[k];
      y[m * N + n] = r;
    }
  }
}

struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t M, N, K, n0, n1;
};

// Helper threads, one job slot each. A caller that finds the pool taken (XLA runs independent
// products concurrently) computes its product alone.
class Pool {
 public:
  explicit Pool(int helpers) : slots_(helpers) {
    for (int i = 0; i < helpers; ++i) std::thread([this, i] { Loop(i); }).detach();
  }
  int helpers() const { return static_cast<int>(slots_.size()); }
  bool TryAcquire() { return !busy_.test_and_set(std::memory_order_acquire); }
  void Release() { busy_.clear(std::memory_order_release); }

  void Post(int i, const Job& job) {
    Slot& s = slots_[i];
    s.job = job;
    s.state.store(kPosted);
    if (s.sleeping.load()) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.cv.notify_one();
    }
  }

  void Wait(int i) {
    Slot& s = slots_[i];
    while (s.state.load(std::memory_order_acquire) != kDone) _mm_pause();
    s.state.store(kIdle, std::memory_order_relaxed);
  }

 private:
  static constexpr int kIdle = 0, kPosted = 1, kDone = 2;
  static constexpr auto kSpin = std::chrono::microseconds(0);  // 256 pauses (a few us), then sleep

  struct Slot {
    std::atomic<int> state{kIdle};
    std::atomic<bool> sleeping{false};
    std::mutex mu;
    std::condition_variable cv;
    Job job{};
  };

  void Loop(int i) {
    Slot& s = slots_[i];
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; s.state.load(std::memory_order_acquire) != kPosted; ++spins) {
        _mm_pause();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(s.mu);
          s.sleeping.store(true);
          s.cv.wait(lock, [&] { return s.state.load() == kPosted; });
          s.sleeping.store(false);
        }
      }
      const Job& j = s.job;
      RowsMatmulColumns(j.x, j.w, j.y, j.M, j.N, j.K, j.n0, j.n1);
      s.state.store(kDone, std::memory_order_release);
    }
  }

  std::vector<Slot> slots_;
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
};

constexpr int kMaxHelpers = 7;
constexpr int64_t kMinColumnsPerPart = 64;
constexpr int64_t kMinMultiplyAddsToSplit = int64_t{1} << 18;  // smaller products: one thread, no helper spins

Pool& SharedPool() {
  static Pool* pool = [] {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    return new Pool(std::clamp(cores - 1, 0, kMaxHelpers));  // never destroyed: helpers run until exit
  }();
  return *pool;
}

void RowsMatmul(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  Pool& pool = SharedPool();
  const int parts = std::min<int64_t>(pool.helpers() + 1, std::max<int64_t>(N / kMinColumnsPerPart, 1));
  if (parts == 1 || M * N * K < kMinMultiplyAddsToSplit || !pool.TryAcquire()) {
    RowsMatmulColumns(x, w, y, M, N, K, 0, N);
    return;
  }
  const int64_t step = ((N + parts - 1) / parts + 3) & ~int64_t{3};
  for (int i = 1; i < parts; ++i) {
    pool.Post(i - 1, Job{x, w, y, M, N, K, std::min(N, i * step), std::min(N, (i + 1) * step)});
  }
  RowsMatmulColumns(x, w, y, M, N, K, 0, std::min(N, step));
  for (int i = 1; i < parts; ++i) pool.Wait(i - 1);
  pool.Release();
}

ffi::Error RowsMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2 || xd.back() != wd[1]) {
    return ffi::Error::InvalidArgument("dflash_rows_matmul: x [..., K] and w [N, K] disagree");
  }
  const int64_t K = wd[1], N = wd[0];
  const int64_t M = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  if (static_cast<int64_t>(y->element_count()) != M * N) {
    return ffi::Error::InvalidArgument("dflash_rows_matmul: output is not [..., N]");
  }
  RowsMatmul(x.typed_data(), w.typed_data(), y->typed_data(), M, N, K);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashRowsMatmul, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
