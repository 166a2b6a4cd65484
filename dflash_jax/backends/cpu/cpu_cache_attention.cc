// Attention of queries over one layer of a KV cache plus the step's new keys, on a CPU, in one
// call: out [B, Tq, Hq, D] = softmax over the visible keys of (q . k) * scale, times v.
//
// XLA:CPU runs the jnp reference (a loop over cache chunks with an online softmax) as a few dozen
// small operations per chunk, which cost more than their arithmetic: SmolLM2 at 300 filled slots,
// 30 layers, 1 query ~6 ms and 16 queries ~27 ms of a step. Here a block of queries of one row and
// kv head, with the G query heads that share it, reads the visible keys in blocks small enough to
// stay in L1/L2 while every query head uses them: scores, a vectorised exp, the weighted sum of the
// values (a decode step: one query; a prefill chunk: 16 at a time). Every query is computed on its
// own, key by key in the same order whatever its block, so its result does not depend on how many
// queries share the call (a verify and a decode step agree).
//
// The keys and values (cache and new alike) are float32 or float16 (F16C converts eight at a time
// as they are read; every product and sum is float32): a float16 cache is half the bytes to read.
//
// cache_k/cache_v [L, B, S, Hkv, D] are read in place at `layer` (no slice is copied); the visible
// keys of query (b, t) are the cache slots in [cache_start, cache_end)[b, t, r] and the new keys
// in [new_start, new_end)[b, t, r], r = 0, 1 (a key in both ranges counts once), as
// `masks.KeyRanges`. A query that sees no key yields zeros.
//
// One row's few queries (a decode step, a short verify) over enough keys share the phases of one
// task out over the helper threads of cpu_pool.h (AttendShared); other large calls (a batch, a
// prefill chunk) split their (row, query block, kv head) tasks over them (AttendTasks). Built
// with cpu_rows_matmul.cc by dflash_jax/kernels/cpu_ffi.py and called through XLA's FFI as
// "dflash_cache_attention".
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
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

// Keys and values as stored: float, or float16 bits (uint16_t, XLA's F16), read as float32.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t x) { return _cvtsh_ss(x); }

template <typename E>
float Dot(const float* a, const E* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), Load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), Load8(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), Load8(b + i), acc0);
  float s = HorizontalSum(_mm256_add_ps(acc0, acc1));
  for (; i < d; ++i) s += a[i] * ToFloat(b[i]);
  return s;
}

template <typename E>
void Axpy(float a, const E* x, float* y, int64_t d) {  // y += a * x
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, Load8(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < d; ++i) y[i] += a * ToFloat(x[i]);
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
  // f(lo, hi) for each run of consecutive visible keys, in the order of the keys: [s0, e0), then
  // the keys of [s1, e1) below s0, then those from e0 on.
  template <typename F>
  void ForEachRun(F f) const {
    f(s0, e0);
    f(s1, std::min(e1, s0));
    f(std::max(s1, e0), e1);
  }
};

// The rows of one query's visible keys (K or V, one kv head), key i of the visible list first to
// last, as at most 6 runs of consecutive rows (3 per source): `Rows` lists them (the vectorised
// path reads the list: finding each row from the runs as it goes was slower over a cold cache),
// `Row` finds one (the generic path). E: the stored element (float or float16 bits).
template <typename E>
struct KeyRows {
  static constexpr int kMaxRuns = 6;
  int runs = 0;
  int64_t n = 0, stride = 0;  // stride: elements from one row of a source to the next (Hkv x D)
  int64_t start[kMaxRuns], end[kMaxRuns];  // run r holds visible keys [start[r], end[r])
  const E* first[kMaxRuns];                 // the row of key start[r]

  void Add(const E* row0, int64_t lo, int64_t hi) {  // rows lo .. hi - 1 of a source at row0
    if (hi <= lo) return;
    start[runs] = n;
    first[runs] = row0 + lo * stride;
    n += hi - lo;
    end[runs++] = n;
  }
  void Rows(std::vector<const E*>& rows) const {  // the row of every key, in order
    rows.resize(n);
    for (int r = 0; r < runs; ++r)
      for (int64_t i = start[r]; i < end[r]; ++i) rows[i] = first[r] + (i - start[r]) * stride;
  }
  const E* Row(int64_t i) const {  // i in [0, n)
    int r = 0;
    while (i >= end[r]) ++r;
    return first[r] + (i - start[r]) * stride;
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
  __m256 most = _mm256_set1_ps(scores[0]);  // the maximum, 8 lanes at a time (std::max_element is scalar)
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(scores + j));
  float lanes[8];
  _mm256_storeu_ps(lanes, most);
  float top = *std::max_element(lanes, lanes + 8);
  for (; j < n; ++j) top = std::max(top, scores[j]);
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

// Scores of H query heads (rows q + h * D) against visible keys [i0, i1) of n (rows k[i] of DV x 8
// floats, D = 8 * DV), KK keys at a time (i0, i1 multiples of 8; the tail repeats the last
// key, whose extra scores ExpInPlace drops), times scale, into scores[h * stride + i]. Each
// (head, key) pair is one 8-lane FMA chain over d, summed by one pairwise tree (in either half of
// the lanes (0 + 1) + (2 + 3), then half + half; Sum8's tree), so a score is the same whatever H,
// KK and the key's place; the H heads share each key row's loads.
template <int H, int KK, int DV, typename E>
void ScoreKeys(const float* q, int64_t D, const E* const* k, int64_t n, int64_t i0, int64_t i1, float scale,
               float* scores, int64_t stride) {
  static_assert(KK == 4 || KK == 8, "keys per step: 4 or 8");
  for (int64_t i = i0; i < i1; i += KK) {
    const E* kr[KK];
    for (int j = 0; j < KK; ++j) kr[j] = k[std::min(i + j, n - 1)];
    __m256 acc[H][KK];
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const __m256 qd = _mm256_loadu_ps(q + h * D);
#pragma GCC unroll 8
      for (int j = 0; j < KK; ++j) acc[h][j] = _mm256_mul_ps(qd, Load8(kr[j]));
    }
#pragma GCC unroll 16
    for (int d = 1; d < DV; ++d) {
      __m256 qd[H];
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) qd[h] = _mm256_loadu_ps(q + h * D + 8 * d);
#pragma GCC unroll 8
      for (int j = 0; j < KK; ++j) {
        const __m256 kv = Load8(kr[j] + 8 * d);
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h) acc[h][j] = _mm256_fmadd_ps(qd[h], kv, acc[h][j]);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      if constexpr (KK == 8) {
        _mm256_storeu_ps(scores + h * stride + i,
                         _mm256_mul_ps(Sum8(acc[h][0], acc[h][1], acc[h][2], acc[h][3], acc[h][4], acc[h][5],
                                            acc[h][6], acc[h][7]), _mm256_set1_ps(scale)));
      } else {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3]));
        const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
        _mm_storeu_ps(scores + h * stride + i, _mm_mul_ps(sum, _mm_set1_ps(scale)));
      }
    }
  }
}

// For H heads: acc[h] [DV x 8] += sum over keys [i0, i1) of weights[h * stride + i] * v[i], for
// vectors [d_begin, d_end) of the DV (multiples of DH), DH at a time; the heads share each value
// row's loads. Every output element is one chain of FMAs over the keys in order, whatever H and DH.
template <int H, int DH, int DV, typename E>
void WeightValues(const float* weights, int64_t stride, const E* const* v, int64_t i0, int64_t i1, float* acc,
                  int64_t D, int d_begin, int d_end) {
  static_assert(DV % DH == 0, "DH divides DV");
  for (int d0 = d_begin; d0 < d_end; d0 += DH) {
    __m256 a[H][DH];
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
      for (int d = 0; d < DH; ++d) a[h][d] = _mm256_loadu_ps(acc + h * D + 8 * (d0 + d));
    for (int64_t i = i0; i < i1; ++i) {
      __m256 w[H];
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) w[h] = _mm256_set1_ps(weights[h * stride + i]);
      const E* vi = v[i] + 8 * d0;
#pragma GCC unroll 16
      for (int d = 0; d < DH; ++d) {
        const __m256 vv = Load8(vi + 8 * d);
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h) a[h][d] = _mm256_fmadd_ps(w[h], vv, a[h][d]);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
      for (int d = 0; d < DH; ++d) _mm256_storeu_ps(acc + h * D + 8 * (d0 + d), a[h][d]);
  }
}

// f(g, integral_constant<int, H>) over the G query heads of a kv head: grouped, in groups of 3 or
// 2 (one left over: 1), as many threes as leave no single head (G = 4: 2 + 2; 7: 3 + 2 + 2; H
// heads x 4 keys (scores) or x 4 vectors of d (values) are 8-12 accumulators in the 16 AVX2
// registers); else one head at a time (see kMinQueriesToGroupHeads).
template <typename F>
inline void ForHeadGroups(int64_t G, bool grouped, F f) {
  int64_t g = 0;
  if (!grouped) {
    for (; g < G; ++g) f(g, std::integral_constant<int, 1>{});
    return;
  }
  for (; G - g >= 3 && G - g != 4; g += 3) f(g, std::integral_constant<int, 3>{});
  for (; G - g >= 2; g += 2) f(g, std::integral_constant<int, 2>{});
  if (g < G) f(g, std::integral_constant<int, 1>{});
}

constexpr int64_t kKeyBlock = 64;   // keys per block: 16 kB of K (or V) rows at D = 64, kept in L1 while read
constexpr int64_t kQueryBlock = 16;  // at most this many queries of one row and kv head read each key block in turn

// One query's G heads (the query heads that share a kv head) and its n visible keys (rows k[i],
// v[i]), with room for its scores [G, n rounded up to 8], sums [G, D] and 1 / softmax sums [G].
template <typename E>
struct QueryWork {
  const float* q;
  float* out;
  int64_t n = 0, padded = 0;
  std::vector<const E*> k, v;  // the rows of visible key i
  std::vector<float> scores, acc, inv;
};

// The queries of `work` (each with n > 0) over their keys, D = 8 * DV. Keys go in blocks of
// kKeyBlock, each read by every query and head of the block before the next: one kv head's K and
// V rows over a long cache outgrow L2, and read once per query head they streamed from L3.
// SmolLM2, a 3000-token prompt through `Target.prefill` (256-token chunks), both kernels compiled
// in one process and run alternately (one-off script): 14.7 s one query head at a time, 11.9 s in
// blocks (kKeyBlock 64, kQueryBlock 16; 32-256 keys by 8-64 queries, timed in separate processes,
// came out within this machine's noise of it); a 16-token verify over 1,900 slots 137 -> 91 ms,
// 1-2 tokens 4-9% faster. Each head's scores, softmax and weighted sum are still computed key by
// key in the same order as for that head alone, so a query's result depends only on the query
// and its keys, not on the block.
// Where a key block serves several queries (kMinQueriesToGroupHeads), the G heads of a query go
// through ScoreKeys / WeightValues 2-3 at a time, sharing each K and V row's loads, and the row
// lists are filled from the runs (KeyRows) rather than key by key: in a C++ harness timing both
// forms alternately (SmolLM2's shapes, 9 heads over 3 kv heads, median of 41 calls) a 256-query
// prefill chunk over 2,744 slots 37.3 -> 27.2 ms, over 500 8.3 -> 5.8, a 16-token verify over
// 1,000 0.94 -> 0.61 ms; outputs bit-identical. In a trace of a 3000-token prefill the attention
// calls took 4.75 s against 5.58-6.07 s before.
// A query's heads go through the scores and values 2-3 at a time (ForHeadGroups) only where a
// block's key rows serve at least this many queries: there the first query brings them in and the
// others find them in L1. With fewer (a decode step, a short verify), the rows come from memory
// (the weights streamed past them since the last step) and one head at a time, eight keys per
// step, keeps more of them in flight: in a C++ harness over 30 layers of a cold cache (SmolLM2's
// shapes, median of 31), 1 query over 300 and 1,000 slots 2.65 / 9.1 ms one head at a time, 3.9 /
// 12.8 ms grouped (and 2.9 / 9.6 ms for the kernel before either change).
constexpr int64_t kMinQueriesToGroupHeads = 4;
// One row with at most this many queries is attended as one task whose phases are shared out
// (AttendShared) when its scores take at least kMinMultiplyAddsToShareKeys multiply-adds: the
// same harness, against the task split before it, 1 query over 300 / 450 / 1,000 slots 0.70 /
// 0.70 / 0.76x the time, 2 queries over 150 / 300 / 1,000 0.86 / 0.77 / 0.71x, 4 over 300 0.68-0.72x;
// below the threshold (1 query over 150 slots) one thread. More queries go through the task
// split (their own blocks of the keys: 16 queries over 300 slots 1.75x slower shared).
constexpr int64_t kMaxQueriesToShareKeys = 4;

// AttendBlock in three phases, each shared out as part `part` of `parts` so that the threads of a
// call with few queries and many keys (a decode step or a short verify over a long cache) can take
// a share each: the scores by blocks of keys, the softmax by (query, head), the weighted values by
// vectors of d. Every number is computed as by one thread (the same chains, in the same order),
// so the results do not depend on `parts`; each phase needs the previous one finished.
template <int DV, typename E>
void ScorePhase(int64_t G, bool grouped, QueryWork<E>* work, int count, float scale, int part, int parts) {
  constexpr int64_t D = 8 * DV;
  int64_t most = 0;
  for (int j = 0; j < count; ++j) most = std::max(most, work[j].padded);
  const int64_t key_blocks = (most + kKeyBlock - 1) / kKeyBlock;
  for (int64_t kb = part * key_blocks / parts; kb < (part + 1) * key_blocks / parts; ++kb) {
    const int64_t i0 = kb * kKeyBlock;
    for (int j = 0; j < count; ++j) {
      QueryWork<E>& w = work[j];
      if (i0 >= w.padded) continue;
      const int64_t i1 = std::min(w.padded, i0 + kKeyBlock);
      ForHeadGroups(G, grouped, [&](int64_t g, auto heads) {
        constexpr int H = decltype(heads)::value;
        ScoreKeys<H, H == 1 ? 8 : 4, DV>(w.q + g * D, D, w.k.data(), w.n, i0, i1, scale,
                                         w.scores.data() + g * w.padded, w.padded);
      });
    }
  }
}

template <typename E>
void SoftmaxPhase(int64_t G, QueryWork<E>* work, int count, int part, int parts) {
  const int64_t pairs = count * G;
  for (int64_t pair = part * pairs / parts; pair < (part + 1) * pairs / parts; ++pair) {
    QueryWork<E>& w = work[pair / G];
    const int64_t g = pair % G;
    w.inv[g] = ExpInPlace(w.scores.data() + g * w.padded, w.n);
  }
}

template <int DV, typename E>
void ValuePhase(int64_t G, bool grouped, QueryWork<E>* work, int count, int part, int parts) {
  constexpr int64_t D = 8 * DV;
  constexpr int kStep = 4;  // vectors of d per share unit (and per WeightValues pass, DH)
  const int units = DV / kStep, d_begin = part * units / parts * kStep, d_end = (part + 1) * units / parts * kStep;
  if (d_begin == d_end) return;
  int64_t most = 0;
  for (int j = 0; j < count; ++j) {
    most = std::max(most, work[j].n);
    for (int64_t g = 0; g < G; ++g)
      std::fill(work[j].acc.data() + g * D + 8 * d_begin, work[j].acc.data() + g * D + 8 * d_end, 0.0f);
  }
  for (int64_t i0 = 0; i0 < most; i0 += kKeyBlock)
    for (int j = 0; j < count; ++j) {
      QueryWork<E>& w = work[j];
      if (i0 >= w.n) continue;
      const int64_t i1 = std::min(w.n, i0 + kKeyBlock);
      ForHeadGroups(G, grouped, [&](int64_t g, auto heads) {
        constexpr int H = decltype(heads)::value;
        float* acc = w.acc.data() + g * D;
        const float* weights = w.scores.data() + g * w.padded;
        if constexpr (H == 1) {  // one head: 8 vectors at a time where the share allows (8 chains)
          if ((d_end - d_begin) % 8 == 0)
            return WeightValues<1, 8, DV>(weights, w.padded, w.v.data(), i0, i1, acc, D, d_begin, d_end);
        }
        WeightValues<H, kStep, DV>(weights, w.padded, w.v.data(), i0, i1, acc, D, d_begin, d_end);
      });
    }
  for (int j = 0; j < count; ++j) {
    const QueryWork<E>& w = work[j];
    for (int64_t g = 0; g < G; ++g)
      for (int d = d_begin; d < d_end; ++d)
        _mm256_storeu_ps(w.out + g * D + 8 * d,
                         _mm256_mul_ps(_mm256_loadu_ps(w.acc.data() + g * D + 8 * d), _mm256_set1_ps(w.inv[g])));
  }
}

template <int DV, typename E>
void AttendBlock(int64_t G, bool grouped, QueryWork<E>* work, int count, float scale) {
  ScorePhase<DV>(G, grouped, work, count, scale, 0, 1);
  SoftmaxPhase(G, work, count, 0, 1);
  ValuePhase<DV>(G, grouped, work, count, 0, 1);
}

template <typename E>
struct Problem {
  const float* q;
  const E *ck, *cv, *nk, *nv;  // ck, cv: the layer's [B, S, Hkv, D]
  const int32_t *cache_start, *cache_end, *new_start, *new_end;
  float* out;
  int64_t B, Tq, Hq, Hkv, D, S, T;
  float scale;
  int64_t query_block;  // queries per task: kQueryBlock, fewer where that leaves too few tasks
  int64_t kv_heads;  // kv heads per task: all of them on one thread, else one
};

// Tasks part, part + parts, ... of B x ceil(Tq / query_block) x (Hkv / kv_heads): a block of up to
// query_block queries of one row and kv_heads kv heads, with the G query heads of each that share
// it (taken in turn, so the threads share out the long and the short causal rows alike). On one
// thread a task takes every query and kv head, so each block of cache slots (the heads side by
// side in a slot's row) is read once, by all of them: SmolLM2 at 300 filled slots, a 2-token step
// 23.3 / 26.0 -> 21.6 / 22.3 ms, 1 token unchanged (17.1-18.5 ms; both forms in one process, called
// alternately, median of 40, two runs; bit-identical). Prefetching the next key block in software
// on top gained nothing there.
// The queries [first, first + query_block) of row b with kv heads [h0, h0 + kv_heads): each
// (query, kv head) with visible keys goes into `work` (returns how many) for AttendBlock; one
// without any gets zeros, and so is the whole generic path (D neither 64 nor 128) computed here.
template <typename E>
int GatherTask(const Problem<E>& pr, int64_t b, int64_t first, int64_t h0, std::vector<QueryWork<E>>& work,
               std::vector<float>& scores) {
  const int64_t G = pr.Hq / pr.Hkv, D = pr.D, S = pr.S, T = pr.T, Hkv = pr.Hkv;
  const bool vectorised = D == 64 || D == 128;
  int count = 0;
  for (int64_t t = first; t < std::min(pr.Tq, first + pr.query_block); ++t) {
    const int64_t query = b * pr.Tq + t;
    const Visible cached(pr.cache_start + query * 2, pr.cache_end + query * 2, S);
    const Visible fresh(pr.new_start + query * 2, pr.new_end + query * 2, T);
    for (int64_t h = h0; h < h0 + pr.kv_heads; ++h) {
      KeyRows<E> k, v;  // cache slots first, then new keys, as the ranges list them
      k.stride = v.stride = Hkv * D;
      const int64_t cache_row = (b * S * Hkv + h) * D, new_row = (b * T * Hkv + h) * D;
      cached.ForEachRun([&](int64_t lo, int64_t hi) {
        k.Add(pr.ck + cache_row, lo, hi);
        v.Add(pr.cv + cache_row, lo, hi);
      });
      fresh.ForEachRun([&](int64_t lo, int64_t hi) {
        k.Add(pr.nk + new_row, lo, hi);
        v.Add(pr.nv + new_row, lo, hi);
      });
      const int64_t n = k.n, padded = (n + 7) & ~int64_t{7};
      const float* qh = pr.q + (query * pr.Hq + h * G) * D;
      float* oh = pr.out + (query * pr.Hq + h * G) * D;
      if (n == 0) {
        std::fill(oh, oh + G * D, 0.0f);
        continue;
      }
      if (vectorised) {
        QueryWork<E>& w = work[count++];
        w.q = qh;
        w.out = oh;
        w.n = n;
        w.padded = padded;
        k.Rows(w.k);
        v.Rows(w.v);
        w.scores.resize(G * padded);
        w.acc.resize(G * D);
        w.inv.resize(G);
        continue;
      }
      scores.assign(G * padded, 0.0f);
      std::fill(oh, oh + G * D, 0.0f);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g) scores[g * padded + i] = Dot(qh + g * D, k.Row(i), D) * pr.scale;
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * padded;
        const float inv = ExpInPlace(s, n);
        for (int64_t i = 0; i < n; ++i) Axpy(s[i] * inv, v.Row(i), oh + g * D, D);
      }
    }
  }
  return count;
}

template <typename E>
void AttendTasks(const Problem<E>& pr, int part, int parts) {
  const int64_t G = pr.Hq / pr.Hkv, groups = pr.Hkv / pr.kv_heads;
  const int64_t blocks = (pr.Tq + pr.query_block - 1) / pr.query_block, tasks = pr.B * blocks * groups;
  std::vector<QueryWork<E>> work(kQueryBlock * pr.kv_heads);
  std::vector<float> scores;  // the generic path's [G, keys]
  for (int64_t task = part; task < tasks; task += parts) {
    const int64_t h0 = task % groups * pr.kv_heads, first = (task / groups) % blocks * pr.query_block;
    const int count = GatherTask(pr, task / (groups * blocks), first, h0, work, scores);
    const bool grouped = std::min(pr.Tq - first, pr.query_block) >= kMinQueriesToGroupHeads;
    if (count > 0 && pr.D == 64) AttendBlock<8>(G, grouped, work.data(), count, pr.scale);
    if (count > 0 && pr.D == 128) AttendBlock<16>(G, grouped, work.data(), count, pr.scale);
  }
}

// The queries of one row (at most kMaxQueriesToShareKeys: a decode step, a short verify) with all
// kv heads as one task, its phases shared out over the threads (ScorePhase, SoftmaxPhase,
// ValuePhase): each key block read once, the key blocks split between the threads, then the
// vectors of d.
template <typename E>
struct SharedWork {
  int64_t G;
  bool grouped;
  QueryWork<E>* work;
  int count;
  float scale;
};

template <int DV, typename E>
void AttendShared(dflash::Pool& pool, const SharedWork<E>& shared, int parts) {
  pool.RunParts([](const void* c, int part, int parts) {
    const SharedWork<E>& s = *static_cast<const SharedWork<E>*>(c);
    ScorePhase<DV, E>(s.G, s.grouped, s.work, s.count, s.scale, part, parts);
  }, &shared, parts);
  pool.RunParts([](const void* c, int part, int parts) {
    const SharedWork<E>& s = *static_cast<const SharedWork<E>*>(c);
    SoftmaxPhase(s.G, s.work, s.count, part, parts);
  }, &shared, parts);
  pool.RunParts([](const void* c, int part, int parts) {
    const SharedWork<E>& s = *static_cast<const SharedWork<E>*>(c);
    ValuePhase<DV, E>(s.G, s.grouped, s.work, s.count, part, parts);
  }, &shared, parts);
}

constexpr int64_t kMinMultiplyAddsToSplit = int64_t{1} << 21;  // less: one thread, no helper wakes
constexpr int64_t kMinMultiplyAddsToShareKeys = int64_t{1} << 17;  // one row's few queries: less, one thread

// Attention for the whole call: how it is shared out over the threads.
template <typename E>
void Attend(Problem<E> problem) {
  const int64_t B = problem.B, Tq = problem.Tq, Hq = problem.Hq, Hkv = problem.Hkv, D = problem.D;
  const int64_t S = problem.S, T = problem.T;
  const float scale = problem.scale;
  dflash::Pool& pool = dflash::SharedPool();
  if (B == 1 && Tq <= kMaxQueriesToShareKeys && (D == 64 || D == 128)) {  // one row, few queries: one task
    problem.query_block = kQueryBlock;
    problem.kv_heads = Hkv;
    std::vector<QueryWork<E>> work(Tq * Hkv);  // one per (query, kv head)
    std::vector<float> unused;  // the generic path's scores (not taken here: D is 64 or 128)
    const int count = GatherTask(problem, 0, 0, 0, work, unused);
    const SharedWork<E> shared{Hq / Hkv, Tq >= kMinQueriesToGroupHeads, work.data(), count, scale};
    int64_t multiply_adds = 0;  // of the scores
    for (int j = 0; j < shared.count; ++j) multiply_adds += work[j].n * Hq / Hkv * D;
    const int parts = multiply_adds < kMinMultiplyAddsToShareKeys ? 1 : pool.helpers() + 1;
    if (D == 64) AttendShared<8, E>(pool, shared, parts);
    else AttendShared<16, E>(pool, shared, parts);
    return;
  }
  // at least 4 tasks per thread where the queries allow (a 16-token verify: blocks of 4 queries)
  int64_t query_block = kQueryBlock;
  auto tasks_of = [&](int64_t block) { return B * ((Tq + block - 1) / block) * Hkv; };
  while (query_block > 1 && tasks_of(query_block) < 4 * (pool.helpers() + 1)) query_block = (query_block + 1) / 2;
  problem.query_block = query_block;
  problem.kv_heads = 1;
  const int64_t tasks = tasks_of(query_block);
  const int64_t work = B * Tq * Hq * (S + T) * D;  // an upper bound of the multiply-adds of the scores
  const int parts = work < kMinMultiplyAddsToSplit ? 1 : static_cast<int>(std::min<int64_t>(pool.helpers() + 1, tasks));
  if (parts == 1) {  // one task of every query and kv head: each key block read once, by all of them
    problem.query_block = kQueryBlock;
    problem.kv_heads = Hkv;
  }
  pool.RunParts([](const void* context, int part, int parts) {
    AttendTasks(*static_cast<const Problem<E>*>(context), part, parts);
  }, &problem, parts);
}

// KV: the dtype of the cache and the new keys/values (F32 or F16); q and the output are F32.
template <ffi::DataType KV>
ffi::Error CacheAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<KV> cache_k, ffi::Buffer<KV> cache_v,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> cache_start,
                              ffi::Buffer<ffi::S32> cache_end, ffi::Buffer<KV> new_k, ffi::Buffer<KV> new_v,
                              ffi::Buffer<ffi::S32> new_start, ffi::Buffer<ffi::S32> new_end, float scale,
                              ffi::ResultBuffer<ffi::F32> out) {
  using E = ffi::NativeType<KV>;
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
  Problem<E> problem{q.typed_data(), cache_k.typed_data() + l * layer_size, cache_v.typed_data() + l * layer_size,
                  new_k.typed_data(), new_v.typed_data(), cache_start.typed_data(), cache_end.typed_data(),
                  new_start.typed_data(), new_end.typed_data(), out->typed_data(), B, Tq, Hq, Hkv, D, S, T,
                  scale};
  Attend(problem);
  return ffi::Error::Success();
}

}  // namespace

#define DFLASH_CACHE_ATTENTION_HANDLER(symbol, KV)                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, CacheAttentionImpl<KV>,           \
                                ffi::Ffi::Bind()                          \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* q */ \
                                    .Arg<ffi::Buffer<KV>>() /* cache_k */ \
                                    .Arg<ffi::Buffer<KV>>() /* cache_v */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* cache_start */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* cache_end */ \
                                    .Arg<ffi::Buffer<KV>>() /* new_k */ \
                                    .Arg<ffi::Buffer<KV>>() /* new_v */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* new_start */ \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* new_end */ \
                                    .Attr<float>("scale")                 \
                                    .Ret<ffi::Buffer<ffi::F32>>())

DFLASH_CACHE_ATTENTION_HANDLER(DflashCacheAttention, ffi::F32);
DFLASH_CACHE_ATTENTION_HANDLER(DflashCacheAttentionF16, ffi::F16);
