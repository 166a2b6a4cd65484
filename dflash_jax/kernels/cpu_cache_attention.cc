// Attention of a few queries over one layer of a KV cache plus the step's new keys, on a CPU, in
// one call: out [B, Tq, Hq, D] = softmax over the visible keys of (q . k) * scale, times v.
//
// XLA:CPU runs the jnp reference (a loop over cache chunks with an online softmax) as a few dozen
// small operations per chunk, which cost more than their arithmetic: SmolLM2 at 300 filled slots,
// 30 layers, 1 query ~6 ms and 16 queries ~27 ms of a step. Here each (row, query, kv head) reads
// its visible keys once for the G query heads that share them: scores, a vectorised exp, the
// weighted sum of the values. Every query is computed on its own, so its result does not depend
// on how many queries share the call (a verify and a decode step agree).
//
// cache_k/cache_v [L, B, S, Hkv, D] are read in place at `layer` (no slice is copied); the visible
// keys of query (b, t) are the cache slots in [cache_start, cache_end)[b, t, r] and the new keys
// in [new_start, new_end)[b, t, r], r = 0, 1 (a key in both ranges counts once), as
// `masks.KeyRanges`. A query that sees no key yields zeros.
//
// Large calls (a verify over a long cache) split their (row, query, kv head) units over the helper
// threads of cpu_pool.h. Built with cpu_rows_matmul.cc by dflash_jax/kernels/cpu_ffi.py and called
// through XLA's FFI as "dflash_cache_attention".
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_pool.h"
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

// exp(x) for x <= 0 (scores minus their maximum), Cephes' expf polynomial: relative error ~1e-7.
inline __m256 ExpNonPositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // exp(-87) ~ 1.6e-38: below it, 2^n leaves the normals
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float Dot(const float* a, const float* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = HorizontalSum(_mm256_add_ps(acc0, acc1));
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void Axpy(float a, const float* x, float* y, int64_t d) {  // y += a * x
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < d; ++i) y[i] += a * x[i];
}

// The keys of one source (cache layer or new keys) visible through two ranges: [s0, e0) and the
// part of [s1, e1) outside it, clamped to [0, n).
struct Visible {
  int64_t s0, e0, s1, e1;
  Visible(const int32_t* start, const int32_t* end, int64_t n) {
    s0 = std::clamp<int64_t>(start[0], 0, n);
    e0 = std::clamp<int64_t>(end[0], s0, n);
    s1 = std::clamp<int64_t>(start[1], 0, n);
    e1 = std::clamp<int64_t>(end[1], s1, n);
  }
  template <typename F>
  void ForEach(F f) const {
    for (int64_t i = s0; i < e0; ++i) f(i);
    for (int64_t i = s1; i < e1; ++i)
      if (i < s0 || i >= e0) f(i);
  }
};

// Eight sums at once: [sum a0, ..., sum a7].
inline __m256 Sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scores [0, n) -> exp(score - max) in place, lanes [n, n rounded up to 8) set to 0 (whatever they
// held); returns 1 / the sum. Vectorised in groups of 8, so a score's weight does not depend on n.
inline float ExpInPlace(float* scores, int64_t n) {
  const float top = *std::max_element(scores, scores + n);
  const int64_t padded = (n + 7) & ~int64_t{7};
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += 8) {
    __m256 e = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(scores + i), _mm256_set1_ps(top)));
    if (i + 8 > n) {  // the tail's lanes past n
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), lane));
      e = _mm256_and_ps(e, keep);
    }
    _mm256_storeu_ps(scores + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.0f / HorizontalSum(sum);
}

// One query head over its n visible keys (rows k[i], v[i] of DV x 8 floats), D = 8 * DV: scores
// eight keys at a time, the softmax, and the values' weighted sum in registers. `scores` holds at
// least n rounded up to 8 floats. A key's score and weight are computed the same way wherever it
// falls, so the result depends only on this query and its keys.
template <int DV>
void QueryHead(const float* q, const float* const* k, const float* const* v, int64_t n, float scale,
               float* scores, float* out) {
  __m256 qv[DV];
  for (int d = 0; d < DV; ++d) qv[d] = _mm256_loadu_ps(q + 8 * d);
  const int64_t padded = (n + 7) & ~int64_t{7};
  for (int64_t i = 0; i < padded; i += 8) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) {
      const float* kj = k[std::min(i + j, n - 1)];  // the tail repeats the last key; dropped below
      __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
      for (int d = 1; d < DV; ++d) acc = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kj + 8 * d), acc);
      a[j] = acc;
    }
    _mm256_storeu_ps(scores + i, _mm256_mul_ps(Sum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                               _mm256_set1_ps(scale)));
  }
  const float inv = ExpInPlace(scores, n);
  __m256 acc[DV];
  for (int d = 0; d < DV; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 w = _mm256_set1_ps(scores[i]);
    for (int d = 0; d < DV; ++d) acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[i] + 8 * d), acc[d]);
  }
  for (int d = 0; d < DV; ++d) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], _mm256_set1_ps(inv)));
}

struct Problem {
  const float *q, *ck, *cv, *nk, *nv;  // ck, cv: the layer's [B, S, Hkv, D]
  const int32_t *cache_start, *cache_end, *new_start, *new_end;
  float* out;
  int64_t B, Tq, Hq, Hkv, D, S, T;
  float scale;
};

// Units [u0, u1) of B x Tq x Hkv: one query's G heads that share a kv head.
void AttendUnits(const Problem& pr, int64_t u0, int64_t u1) {
  const int64_t G = pr.Hq / pr.Hkv, D = pr.D, S = pr.S, T = pr.T, Hkv = pr.Hkv;
  std::vector<float> scores;        // [G, keys] (generic path) or [keys] (vectorised path)
  std::vector<int64_t> keys;        // visible keys: cache slot i as i, new key j as S + j
  std::vector<const float*> krow, vrow;
  int64_t listed = -1;              // the query whose keys are in `keys`
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t query = u / Hkv, h = u % Hkv, b = query / pr.Tq;
    if (query != listed) {
      keys.clear();
      Visible(pr.cache_start + query * 2, pr.cache_end + query * 2, S).ForEach([&](int64_t i) { keys.push_back(i); });
      Visible(pr.new_start + query * 2, pr.new_end + query * 2, T).ForEach([&](int64_t j) { keys.push_back(S + j); });
      listed = query;
    }
    const int64_t n = static_cast<int64_t>(keys.size());
    const int64_t padded = (n + 7) & ~int64_t{7};
    auto key_row = [&](int64_t key, const float* cache, const float* fresh) {
      return key < S ? cache + ((b * S + key) * Hkv + h) * D : fresh + ((b * T + key - S) * Hkv + h) * D;
    };
    const float* qh = pr.q + (query * pr.Hq + h * G) * D;
    float* oh = pr.out + (query * pr.Hq + h * G) * D;
    if (n == 0) {
      std::fill(oh, oh + G * D, 0.0f);
      continue;
    }
    if (D == 64 || D == 128) {
      krow.resize(n);
      vrow.resize(n);
      for (int64_t i = 0; i < n; ++i) {
        krow[i] = key_row(keys[i], pr.ck, pr.nk);
        vrow[i] = key_row(keys[i], pr.cv, pr.nv);
      }
      scores.resize(padded);
      for (int64_t g = 0; g < G; ++g) {
        if (D == 64) QueryHead<8>(qh + g * D, krow.data(), vrow.data(), n, pr.scale, scores.data(), oh + g * D);
        else QueryHead<16>(qh + g * D, krow.data(), vrow.data(), n, pr.scale, scores.data(), oh + g * D);
      }
      continue;
    }
    scores.assign(G * padded, 0.0f);
    std::fill(oh, oh + G * D, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float* k = key_row(keys[i], pr.ck, pr.nk);
      for (int64_t g = 0; g < G; ++g) scores[g * padded + i] = Dot(qh + g * D, k, D) * pr.scale;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores.data() + g * padded;
      const float inv = ExpInPlace(s, n);
      for (int64_t i = 0; i < n; ++i) Axpy(s[i] * inv, key_row(keys[i], pr.cv, pr.nv), oh + g * D, D);
    }
  }
}

constexpr int64_t kMinMultiplyAddsToSplit = int64_t{1} << 21;  // less: one thread, no helper wakes

ffi::Error CacheAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cache_k, ffi::Buffer<ffi::F32> cache_v,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> cache_start,
                              ffi::Buffer<ffi::S32> cache_end, ffi::Buffer<ffi::F32> new_k, ffi::Buffer<ffi::F32> new_v,
                              ffi::Buffer<ffi::S32> new_start, ffi::Buffer<ffi::S32> new_end, float scale,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), cd = cache_k.dimensions(), nd = new_k.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || nd.size() != 4) {
    return ffi::Error::InvalidArgument(
        "dflash_cache_attention: q [B, Tq, Hq, D], cache [L, B, S, Hkv, D], new [B, T, Hkv, D]");
  }
  const int64_t B = qd[0], Tq = qd[1], Hq = qd[2], D = qd[3];
  const int64_t L = cd[0], S = cd[2], Hkv = cd[3], T = nd[1];
  const size_t range_count = static_cast<size_t>(B * Tq * 2);
  if (cd[1] != B || cd[4] != D || nd[0] != B || nd[2] != Hkv || nd[3] != D || Hkv == 0 || Hq % Hkv != 0 ||
      cache_start.element_count() != range_count || cache_end.element_count() != range_count ||
      new_start.element_count() != range_count || new_end.element_count() != range_count) {
    return ffi::Error::InvalidArgument("dflash_cache_attention: shapes disagree");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("dflash_cache_attention: layer out of range");
  const int64_t layer_size = B * S * Hkv * D;
  const Problem problem{q.typed_data(), cache_k.typed_data() + l * layer_size, cache_v.typed_data() + l * layer_size,
                        new_k.typed_data(), new_v.typed_data(), cache_start.typed_data(), cache_end.typed_data(),
                        new_start.typed_data(), new_end.typed_data(), out->typed_data(), B, Tq, Hq, Hkv, D, S, T,
                        scale};
  const int64_t units = B * Tq * Hkv;
  dflash::Pool& pool = dflash::SharedPool();
  const int64_t work = B * Tq * Hq * (S + T) * D;  // an upper bound of the multiply-adds of the scores
  const int parts = work < kMinMultiplyAddsToSplit ? 1 : static_cast<int>(std::min<int64_t>(pool.helpers() + 1, units));
  pool.RunParts([](const void* context, int part, int parts) {
    const Problem& pr = *static_cast<const Problem*>(context);
    const int64_t units = pr.B * pr.Tq * pr.Hkv;
    AttendUnits(pr, units * part / parts, units * (part + 1) / parts);
  }, &problem, parts);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cache_k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cache_v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cache_start
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cache_end
                                  .Arg<ffi::Buffer<ffi::F32>>()   // new_k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // new_start
                                  .Arg<ffi::Buffer<ffi::S32>>()   // new_end
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
