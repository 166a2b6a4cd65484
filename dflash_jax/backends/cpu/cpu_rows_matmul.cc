// y [M, N] = x [M, K] . W [K, N] in float32, made for a few rows M (1-16): the weight products of a
// decode step or a short verify on a CPU, where XLA's GEMM kernels read the weights more than once
// for 2-16 rows (SmolLM2's LM head: 1 row 6 ms, 2 rows 16 ms, 16 rows 50 ms).
//
// W is stored in panels of 16 columns, w [P, K, 16] with P = N / 16 (`cpu_matmul.pack_kernel`):
// each panel is one contiguous stream, read from memory once. A tile of R rows of x and one to
// four panels keeps R x 2 x panels AVX2 accumulators (8-12) and, per k, broadcasts one x value
// per row against the panel's two vectors of 8 columns (the BLIS micro-kernel form; no horizontal
// sums). Rows run in near-equal groups of at most 6 over the same few panels, which are still in
// L2 (16 rows: 3 groups; a batch-8 verify's 128: 22).
// Every output is one chain of FMAs over k = 0 .. K-1 from zero, whatever the tile: a row gets
// bit-identical results in a product of 1 row or of 16.
//
// The output columns of a large enough product are split, panel-wise, between the calling thread
// and a helper thread per further core (cpu_pool.h).
//
// A second entry point, "dflash_rows_matmul_narrow", reads narrow panels: bfloat16
// (`cpu_matmul.pack_kernel`, where every weight is a bfloat16 value), widened to float32 as it
// multiplies, with the same FMA chains (bit-identical to the float32 panels, from half of the
// bytes), or a GGUF file's Q4_1 or Q8_0 blocks (`cpu_matmul.pack_quantized`), multiplied in
// factored form, d (x . q) + m (sum of x) per block (FactoredTile: the same weights' products to
// float rounding, from a sixth (Q4_1) of the bytes, and a row's result still independent of the
// rows beside it).
//
// A third, "dflash_rows_matmul_int8", multiplies Q4_1 panels typed int8 with activations rounded
// to int8 per block of 32, as llama.cpp does (Int8Tile; opt-in, a slightly different product).
//
// Built by dflash_jax/kernels/cpu_ffi.py with the C++ compiler of the machine (-mavx2 -mfma
// -ffp-contract=off) and called through XLA's FFI as the custom calls "dflash_rows_matmul",
// "dflash_rows_matmul_narrow" and "dflash_rows_matmul_int8".
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <cstdint>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace dflash {

Pool& SharedPool() {
  static Pool* pool = [] {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    return new Pool(std::clamp(cores - 1, 0, 7));  // never destroyed: helpers run until exit
  }();
  return *pool;
}

}  // namespace dflash

namespace {

constexpr int64_t kPanel = 16;      // columns per panel: two AVX2 vectors
constexpr int64_t kGroup = 4;       // panels that all row groups visit before the next ones (L2)

// The accumulators of a tile of R rows x P panels: every output one chain of FMAs over k from
// zero, whatever feeds it the weights (float32 panels or narrow ones).
template <int R, int P>
struct TileSums {
  __m256 acc[R][P][2];

  TileSums() {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  }

  // acc += x[:, k] * (row k of the P panels, w[p][0..1])
  inline void Add(const float* x, int64_t K, int64_t k, const __m256 (&w)[P][2]) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        acc[r][p][0] = _mm256_fmadd_ps(xr, w[p][0], acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(xr, w[p][1], acc[r][p][1]);
      }
    }
  }

  inline void Store(float* y, int64_t ldy) const {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        _mm256_storeu_ps(y + r * ldy + p * kPanel, acc[r][p][0]);
        _mm256_storeu_ps(y + r * ldy + p * kPanel + 8, acc[r][p][1]);
      }
  }
};

// Rows [0, R) of x (row stride K) times panels [0, P) at `panels` -> y (row stride ldy). With
// Prefetch, every `every`-th k asks for one line of each of the P panels at `pf` (into L2), the
// next line each time: the row groups of a panel group share out the lines of the panels kGroup
// further on, so the weight stream runs while they compute, not only while the first one does.
template <int R, int P, bool Prefetch>
inline void Tile(const float* x, int64_t K, const float* panels, float* y, int64_t ldy, const float* pf, int every) {
  TileSums<R, P> sums;
  int count = every;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[P][2];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const float* wk = panels + p * K * kPanel + k * kPanel;
      w[p][0] = _mm256_loadu_ps(wk);
      w[p][1] = _mm256_loadu_ps(wk + 8);
    }
    if (Prefetch && --count == 0) {
      count = every;
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) _mm_prefetch(reinterpret_cast<const char*>(pf + p * K * kPanel), _MM_HINT_T1);
      pf += kPanel;
    }
    sums.Add(x, K, k, w);
  }
  sums.Store(y, ldy);
}

// R rows, row group g of `groups`, against panels [p0, p1): `P` panels per tile (8-12
// accumulators), single panels at the end. Every tile whose panels have a successor kGroup on
// before `end` prefetches lines [g K / groups, (g + 1) K / groups) of it, one every `groups` k.
// Not for one group of 1-3 rows, where the tile's own loads keep ahead of memory and the prefetch
// only competes with them: one row through the LM head on one thread 6.6 -> 7.5 ms with it; 2 and
// 3 rows through SmolLM2's 211 products, 42.0 -> 38.6 and 42.2 -> 39.1 ms without it (variants
// built side by side and called alternately in one process, median of 40). 4 rows and more keep
// it (4 rows without it: 41.3 -> 43.6 ms in one such run, equal in another).
template <int R, int P>
void RowGroup(const float* x, const float* w, float* y, int64_t K, int64_t ldy, int64_t p0, int64_t p1,
              int64_t g, int64_t groups, int64_t end) {
  const int64_t first = g * K / groups;
  const int every = static_cast<int>(groups);
  auto tile = [&](auto panels, int64_t p) {
    constexpr int kP = decltype(panels)::value;
    const float* wp = w + p * K * kPanel;
    if ((groups > 1 || R > 3) && p + kP + kGroup <= end)
      Tile<R, kP, true>(x, K, wp, y + p * kPanel, ldy, wp + kGroup * K * kPanel + first * kPanel, every);
    else Tile<R, kP, false>(x, K, wp, y + p * kPanel, ldy, nullptr, 1);
  };
  int64_t p = p0;
  for (; p + P <= p1; p += P) tile(std::integral_constant<int, P>{}, p);
  for (; p < p1; ++p) tile(std::integral_constant<int, 1>{}, p);
}

void Rows(int rows, const float* x, const float* w, float* y, int64_t K, int64_t ldy, int64_t p0, int64_t p1,
          int64_t g, int64_t groups, int64_t end) {
  switch (rows) {  // panels per tile: enough accumulators to hide the FMA latency, few enough to stay in registers
    case 1: return RowGroup<1, 4>(x, w, y, K, ldy, p0, p1, g, groups, end);
    case 2: return RowGroup<2, 2>(x, w, y, K, ldy, p0, p1, g, groups, end);
    case 3: return RowGroup<3, 2>(x, w, y, K, ldy, p0, p1, g, groups, end);
    case 4: return RowGroup<4, 1>(x, w, y, K, ldy, p0, p1, g, groups, end);
    case 5: return RowGroup<5, 1>(x, w, y, K, ldy, p0, p1, g, groups, end);
    default: return RowGroup<6, 1>(x, w, y, K, ldy, p0, p1, g, groups, end);
  }
}

// Panels [p0, p1) of y [M, P * 16] = x [M, K] . w [P, K, 16]. Rows go in near-equal groups of
// at most 6, each group over kGroup panels at a time so that the later groups find them in L2,
// while all groups together prefetch the next kGroup panels. (Prefetching them from one group
// alone, the second, left memory idle while the others computed: SmolLM2's 211 weight products
// at 16 rows, 2 threads, 59 ms; shared out, 43 ms, in a C++ harness, the median of 25.)
void RowsMatmulPanels(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t ldy,
                      int64_t p0, int64_t p1) {
  const int64_t groups = (M + 5) / 6;
  for (int64_t g0 = p0; g0 < p1; g0 += kGroup) {
    const int64_t g1 = std::min(p1, g0 + kGroup);
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t rows = (M - m) / (groups - g);  // near-equal: 16 rows -> 5, 5, 6
      Rows(static_cast<int>(rows), x + m * K, w, y + m * ldy, K, ldy, g0, g1, g, groups, p1);
      m += rows;
    }
  }
}

// Narrow panels: weights kept in fewer bytes than float32, in blocks of 32 k of one panel:
// `cpu_matmul.pack_quantized`'s (a GGUF file's Q4_1 or Q8_0 blocks), multiplied in factored form
// below (FactoredTile), and `cpu_matmul.pack_kernel`'s bfloat16 ones (BF16Tile) (where every weight is a
// bfloat16 value), widened exactly to their float32 values as the tiles reach them, so that their
// products are bit for bit those of the float32 panels, from half of the bytes.
constexpr int64_t kNarrowBlock = 32;  // k per block (GGML's QK4_1 and QK8_0)

enum class Format { kF32, kQ4_1, kQ8_0, kBF16, kQ4_1I8 };

// Bytes per block of 32 k x 16 columns. Q4_1: scales d[16] and offsets m[16] (float16, as the file
// stores them), then per k 8 bytes, byte j holding column j's 4 bits (low) and column j + 8's
// (high). Q8_0: d[16] (float32), then per k the 16 columns' int8. BF16: per k the 16 columns'
// bfloat16. Q4_1I8 (Q4_1 for int8 activations, Int8Tile; its own FFI target, the panels' dtype
// int8): d[16] and m[16] as float16, then the 4-bit values in quads of k (see there).
constexpr int64_t BlockBytes(Format format) {
  return format == Format::kQ4_1 || format == Format::kQ4_1I8 ? 320 : format == Format::kQ8_0 ? 576
         : format == Format::kBF16 ? 1024 : 0;
}

// The 16 bfloat16 weights of row k (0-31) of a panel block, as two vectors of float32: each half
// of the row with its own load widened in one instruction (vpmovzxwd from memory), not one load
// split by a shuffle (the products are instruction-bound: in a C++ harness, both forms alternately,
// median of 41, the shipped drafter's bfloat16 products 9-14% less).
inline void WidenBF16Row(const uint8_t* block, int k, __m256* w) {
  const __m128i* v = reinterpret_cast<const __m128i*>(block + 2 * kPanel * k);
  w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(v)), 16));
  w[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(v + 1)), 16));
}

// A whole bfloat16 panel [K / 32 blocks] -> float32 [K, 16].
void WidenBF16Panel(const uint8_t* panel, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kNarrowBlock; ++b)
    for (int k = 0; k < kNarrowBlock; ++k) {
      __m256 w[2];
      WidenBF16Row(panel + b * BlockBytes(Format::kBF16), k, w);
      _mm256_storeu_ps(out + (b * kNarrowBlock + k) * kPanel, w[0]);
      _mm256_storeu_ps(out + (b * kNarrowBlock + k) * kPanel + 8, w[1]);
    }
}

// Tile's twin for bfloat16 panels (panel p's blocks at panels + p * stride): each weight is
// widened in registers as the tile reaches it and used by all R rows; the same FMA chains.
template <int R, int P>
inline void BF16Tile(const float* x, int64_t K, const uint8_t* panels, int64_t stride, float* y, int64_t ldy) {
  TileSums<R, P> sums;
  for (int64_t b = 0; b < K / kNarrowBlock; ++b) {
    const uint8_t* block = panels + b * BlockBytes(Format::kBF16);
    for (int kk = 0; kk < kNarrowBlock; ++kk) {
      __m256 w[P][2];
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) WidenBF16Row(block + p * stride, kk, w[p]);
      sums.Add(x, K, b * kNarrowBlock + kk, w);
    }
  }
  sums.Store(y, ldy);
}

// R rows (one group) against bfloat16 panels [p0, p1), P at a time, single panels at the end.
template <int R, int P>
void BF16RowGroup(const float* x, const uint8_t* w, float* y, int64_t K, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t stride = K / kNarrowBlock * BlockBytes(Format::kBF16);
  int64_t p = p0;
  for (; p + P <= p1; p += P) BF16Tile<R, P>(x, K, w + p * stride, stride, y + p * kPanel, ldy);
  for (; p < p1; ++p) BF16Tile<R, 1>(x, K, w + p * stride, stride, y + p * kPanel, ldy);
}

// Panels [p0, p1) of y = x . w for bfloat16 panels w [P, K / 32, 1024]. One row group (1-6 rows):
// widened in registers as the tiles reach them, as Rows tiles them. More: each group of kGroup
// panels widened once into a per-thread buffer that stays in L2, then RowsMatmulPanels over it.
void BF16RowsMatmulPanels(const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t ldy,
                          int64_t p0, int64_t p1) {
  switch (M) {
    case 1: return BF16RowGroup<1, 4>(x, w, y, K, ldy, p0, p1);
    case 2: return BF16RowGroup<2, 2>(x, w, y, K, ldy, p0, p1);
    case 3: return BF16RowGroup<3, 2>(x, w, y, K, ldy, p0, p1);
    case 4: return BF16RowGroup<4, 1>(x, w, y, K, ldy, p0, p1);
    case 5: return BF16RowGroup<5, 1>(x, w, y, K, ldy, p0, p1);
    case 6: return BF16RowGroup<6, 1>(x, w, y, K, ldy, p0, p1);
  }
  const int64_t stride = K / kNarrowBlock * BlockBytes(Format::kBF16);
  thread_local std::vector<float> scratch;
  scratch.resize(kGroup * K * kPanel);
  for (int64_t g0 = p0; g0 < p1; g0 += kGroup) {
    const int64_t g1 = std::min(p1, g0 + kGroup);
    for (int64_t p = g0; p < g1; ++p) WidenBF16Panel(w + p * stride, K, scratch.data() + (p - g0) * K * kPanel);
    RowsMatmulPanels(x, scratch.data(), y + g0 * kPanel, M, K, ldy, 0, g1 - g0);
  }
}

// Quantized panels (Q4_1, Q8_0) multiply in factored form. A block of 32 k of one column holds
// w_k = d q_k + m (Q8_0: d q_k), so its share of x . w is d (x . q) + m (x_0 + ... + x_31): the
// 4- or 8-bit values q go into the products as they are (widened, not scaled), d and m are applied
// once per block, and the block sums of x are formed once per call (`BlockSums`). Against widening
// every weight to d q + m first (until 2026-12, the float32 panels' products bit for bit), this
// drops a multiply and an add per weight, and a tile of a few rows reads ONE panel, a single
// stream the hardware prefetcher follows (the tiles of 2-4 panels before read as many interleaved
// streams): in a C++ harness over SmolLM2's 30 layers of Q4_1 products from memory (one thread,
// both forms alternately, median of 21) 1 row 10.9-11.0 -> 6.9 ms, 2 rows 16.2-16.3 -> 9.6.
// SmolLM2's greedy decode (Q4_1 target, 2 cores; one process, both kernels called alternately,
// 6 MT-Bench questions x 96 tokens, three runs over the kernel's drafts): 9.2-9.6 -> 6.6-7.0 ms
// per autoregressive step, 13.5-14.0 -> 10.7-11.1 ms per speculative cycle of block 2, the same
// tokens.
// The results are the same weights' products to float rounding, no longer bit for bit those of
// the dequantised floats (SmolLM2's logits over a 41-token prompt through all 30 layers: within
// 1.5e-4, 4e-6 of the largest logit, of the float32 panels', the same argmax at every position).
// What stays exact is that a row's result does not depend on the rows that share the call, so a
// verify and a decode step agree and greedy speculative decoding still reproduces plain decoding
// token for token: every row, in any tile, sums each block in two chains from zero (even k, odd
// k), then acc += d * even, acc += d * odd (Q4_1: acc += m * xs), block by block from zero.
// A 16-token verify (`infer.profile_cycle --fill 300 --block 16`, old and new kernels in
// alternating runs) costs about what it did, 4.5-4.7 steps of the old kernel against 5.7-6.3 of
// the new, 1.3x faster one: many rows gain nothing from the factored form and pay for its
// per-block totals.

// xs [M, K / 32]: each block of 32 of a row of x [M, K] summed in order (Q4_1's offsets multiply it).
void BlockSums(const float* x, int64_t M, int64_t K, float* xs) {
  for (int64_t i = 0; i < M * (K / kNarrowBlock); ++i) {
    float s = 0.0f;
    for (int64_t k = 0; k < kNarrowBlock; ++k) s += x[i * kNarrowBlock + k];
    xs[i] = s;
  }
}

// The 16 values q of row k of a block, widened to float32 (not scaled).
template <Format F>
inline void BlockValues(const uint8_t* block, int k, __m256* q) {
  if constexpr (F == Format::kQ4_1) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 64 + 8 * k)));
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    q[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  } else {
    const uint8_t* v = block + 64 + kPanel * k;
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8))));
  }
}

// Row k of block b's values: from the block, or from `widened` (WidenValues's buffer of the panel).
template <Format F, bool kWidened>
inline void RowValues(const uint8_t* block, const float* widened, int64_t b, int k, __m256* q) {
  if constexpr (kWidened) {
    q[0] = _mm256_loadu_ps(widened + (b * kNarrowBlock + k) * kPanel);
    q[1] = _mm256_loadu_ps(widened + (b * kNarrowBlock + k) * kPanel + 8);
  } else {
    BlockValues<F>(block, k, q);
  }
}

// Eight float16 values at p, widened (exactly) to float32.
inline __m256 LoadHalf8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// A block's scales d of columns 8c .. 8c + 7: Q4_1's float16, Q8_0's float32.
template <Format F>
inline __m256 Scales(const uint8_t* block, int c) {
  if constexpr (F == Format::kQ4_1) return LoadHalf8(block + 16 * c);
  else return _mm256_loadu_ps(reinterpret_cast<const float*>(block) + 8 * c);
}

// A tile's totals over block b: acc[r] += d * s[r] (one half of the block's k).
template <Format F, int R>
inline void AddScaled(const uint8_t* block, const __m256 (&s)[R][2], __m256 (&acc)[R][2]) {
  const __m256 d[2] = {Scales<F>(block, 0), Scales<F>(block, 1)};
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) acc[r][c] = _mm256_fmadd_ps(d[c], s[r][c], acc[r][c]);
}

// Q4_1's offsets of block b: acc[r] += m * (row r's sum of x over the block).
template <Format F, int R>
inline void AddOffsets(const uint8_t* block, const float* xs, int64_t blocks, int64_t b, __m256 (&acc)[R][2]) {
  if constexpr (F == Format::kQ4_1) {
    const __m256 m[2] = {LoadHalf8(block + 32), LoadHalf8(block + 48)};
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) acc[r][c] = _mm256_fmadd_ps(m[c], _mm256_broadcast_ss(xs + r * blocks + b), acc[r][c]);
  }
}

template <int R>
inline void StoreRows(const __m256 (&acc)[R][2], float* y, int64_t ldy) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
  }
}

// A product of one group of rows (a decode step, a short verify) reads every weight once, and a
// step streams tens of MB of them through the caches, which pushed out what it reads again: the
// KV cache's layers (the attention of the next step), the drafter. Such a product asks for the
// blocks kStreamAhead on as non-temporal (prefetchnta), which keeps them out of the outer caches.
// SmolLM2's greedy decode (10 MT-Bench questions x 96 tokens, distances 0 / 4 / 8 / 16 / 32 / 64
// blocks in turn in one process, two rounds, the same tokens; one-off script): autoregressive step
// 4.38 -> 4.15 ms at 16 (4.28 -> 4.17 in a second run, where 32 gave 4.26 and 64 4.61), speculative
// cycle (block 2, lookup 3, gated drafts) 6.18 -> 6.03 (6.03 -> 5.84); 4 prompts of 18 questions
// (1-2k prompt tokens): step 9.35 -> 9.16 ms, cycle 12.83 -> 12.08. Products of several row groups
// (a 16-token verify, a prefill) read each panel once per group from L2 and do not stream.
constexpr int64_t kStreamAhead = 16;  // blocks (Q4_1: 6 kB)

// Rows [0, R) of x (stride K; block sums xs, stride K / 32) times one quantized panel -> y (stride
// ldy); `widened`: the panel's values as float32 [K, 16] (WidenValues), read instead of the blocks;
// `stream`: the blocks kStreamAhead on are fetched as non-temporal as the tile goes.
// Each block's k are summed in two chains per row and column vector, even k and odd k, both from
// zero; up to 3 rows keep both chains in registers side by side, 4-6 rows (whose 2 x R x 2 sums
// would not fit the 16 AVX2 registers) run them one after the other: the same arithmetic.
template <Format F, int R, bool kWidened>
inline void FactoredTile(const float* x, const float* xs, int64_t K, const uint8_t* panel, const float* widened,
                         float* y, int64_t ldy, bool stream) {
  constexpr int kTogether = R <= 3 ? 2 : 1;  // chains summed side by side
  const int64_t blocks = K / kNarrowBlock;
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * BlockBytes(F);
    const float* xb = x + b * kNarrowBlock;
    if (stream)  // past the panel's end: the next panel's blocks (panels lie end to end)
      for (int64_t c = 0; c < BlockBytes(F); c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + kStreamAhead * BlockBytes(F) + c), _MM_HINT_NTA);
#pragma GCC unroll 2
    for (int h0 = 0; h0 < 2; h0 += kTogether) {
      __m256 s[kTogether][R][2];  // [chain][row][columns 0-7 / 8-15]
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int t = 0; t < kTogether; ++t) s[t][r][0] = s[t][r][1] = _mm256_setzero_ps();
      for (int k = 0; k < kNarrowBlock; k += 2) {
#pragma GCC unroll 2
        for (int t = 0; t < kTogether; ++t) {
          __m256 q[2];
          RowValues<F, kWidened>(block, widened, b, k + h0 + t, q);
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) {
            const __m256 xr = _mm256_broadcast_ss(xb + r * K + k + h0 + t);
            s[t][r][0] = _mm256_fmadd_ps(xr, q[0], s[t][r][0]);
            s[t][r][1] = _mm256_fmadd_ps(xr, q[1], s[t][r][1]);
          }
        }
      }
#pragma GCC unroll 2
      for (int t = 0; t < kTogether; ++t) AddScaled<F, R>(block, s[t], acc);
    }
    AddOffsets<F, R>(block, xs, blocks, b, acc);
  }
  StoreRows<R>(acc, y, ldy);
}

// `widened`: the panel's values q as float32 [K, 16] (WidenValues), read instead of the blocks, or null.
template <Format F, bool kWidened>
inline void FactoredRows(int64_t rows, const float* x, const float* xs, int64_t K, const uint8_t* panel,
                         const float* widened, float* y, int64_t ldy, bool stream) {
  switch (rows) {
    case 1: return FactoredTile<F, 1, kWidened>(x, xs, K, panel, widened, y, ldy, stream);
    case 2: return FactoredTile<F, 2, kWidened>(x, xs, K, panel, widened, y, ldy, stream);
    case 3: return FactoredTile<F, 3, kWidened>(x, xs, K, panel, widened, y, ldy, stream);
    case 4: return FactoredTile<F, 4, kWidened>(x, xs, K, panel, widened, y, ldy, stream);
    case 5: return FactoredTile<F, 5, kWidened>(x, xs, K, panel, widened, y, ldy, stream);
    default: return FactoredTile<F, 6, kWidened>(x, xs, K, panel, widened, y, ldy, stream);
  }
}

// A quantized panel's values q, widened to float32 [K, 16] (not scaled: small integers, exact).
template <Format F>
void WidenValues(const uint8_t* panel, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kNarrowBlock; ++b)
    for (int k = 0; k < kNarrowBlock; ++k) {
      __m256 q[2];
      BlockValues<F>(panel + b * BlockBytes(F), k, q);
      _mm256_storeu_ps(out + (b * kNarrowBlock + k) * kPanel, q[0]);
      _mm256_storeu_ps(out + (b * kNarrowBlock + k) * kPanel + 8, q[1]);
    }
}

// Panels [p0, p1) of y = x . w, w quantized panels [P, K / 32, block bytes]. Rows go in near-equal
// groups of at most 6 over kGroup panels at a time (still in L1/L2 for the next group). With more
// than 5 groups (31 rows and more: a prefill chunk) those panels' values are widened once into a
// per-thread buffer rather than unpacked again by every group (with 8-16 rows unpacking in every
// group took 0.82-0.96x the time, with 128 rows 1.01-1.06x; one-off script). The arithmetic is the
// same either way. Many rows are compute-bound, and there the per-block totals cost: 128-256 rows
// 1.1-1.3x the time of the float32 panels' tiles (one-off script, SmolLM2's shapes), but a
// 2,048-token prefill (`infer.profile_cycle --prefill 2048 --prefill-only`) 4.57 s against 4.49,
// its attention weighing more.
template <Format F>
void FactoredRowsMatmulPanels(const float* x, const float* xs, const uint8_t* w, float* y, int64_t M, int64_t K,
                              int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t stride = K / kNarrowBlock * BlockBytes(F), blocks = K / kNarrowBlock;
  const int64_t groups = (M + 5) / 6;
  const bool widen = groups > 5;
  thread_local std::vector<float> scratch;
  if (widen) scratch.resize(kGroup * K * kPanel);
  for (int64_t g0 = p0; g0 < p1; g0 += kGroup) {
    const int64_t g1 = std::min(p1, g0 + kGroup);
    if (widen)
      for (int64_t p = g0; p < g1; ++p) WidenValues<F>(w + p * stride, K, scratch.data() + (p - g0) * K * kPanel);
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t rows = (M - m) / (groups - g);  // near-equal: 16 rows -> 5, 5, 6
      const float* xsg = F == Format::kQ4_1 ? xs + m * blocks : nullptr;
      for (int64_t p = g0; p < g1; ++p) {
        float* yp = y + m * ldy + p * kPanel;
        const uint8_t* wp = w + p * stride;
        if (widen)
          FactoredRows<F, true>(rows, x + m * K, xsg, K, wp, scratch.data() + (p - g0) * K * kPanel, yp, ldy, false);
        else FactoredRows<F, false>(rows, x + m * K, xsg, K, wp, nullptr, yp, ldy, groups == 1);
      }
      m += rows;
    }
  }
}

// Q4_1 panels for int8 activations (Format::kQ4_1I8, `cpu_matmul.pack_quantized(...,
// activations="int8")`): llama.cpp's CPU arithmetic for a Q4_1 weight. Each row of x is rounded,
// block by block of 32 k, to int8 values qx with one scale dx = max |x| / 127 (GGML's Q8_1), and
// a block's share of x . w is d dx (qx . q) + m dx (sum of qx): the dot products of the 4-bit
// values with the 8-bit ones are integers, summed exactly 32 at a time by vpmaddubsw (two products
// per 16-bit lane, eight quads added in 16 bits: |sum| <= 8 x 2 x 15 x 127 = 30,480, no
// saturation). A block holds d[16] and m[16] as GGUF's float16 (64 bytes), then 8 quads of 4 k:
// 32 bytes, lane h (k 4j + 2h and 4j + 2h + 1) byte 2c + t holding column c's value at k 4j + 2h + t
// (low 4 bits) and column c + 8's (high), so one load gives the pairs vpmaddubsw multiplies against
// x's (qx[4j + 2h], qx[4j + 2h + 1]) in lane h, for 8 columns in the low bits and 8 in the high.
// The result is the product of the block-rounded x with the weights (to float rounding), no
// longer the float x's: a different model by the rounding of its activations, as llama.cpp's is.
// A row's result still depends on that row alone (its own rounding, integer sums, then a fixed
// order of float operations), so a verify of many rows and a step of one agree bit for bit.
constexpr int64_t kQuads = kNarrowBlock / 4;
constexpr int kInt8Rows = 6;  // rows per tile: 2 x 6 16-bit sums in registers

// x [M, K] -> qx [M, K] int8, and per row and block of 32: dx and dx * (sum of the block's qx)
// (what Q4_1's offsets multiply), [M, K / 32] each.
void QuantizeRows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx) {
  for (int64_t i = 0; i < M * (K / kNarrowBlock); ++i) {
    const float* xb = x + i * kNarrowBlock;
    float amax = 0.0f;
    for (int k = 0; k < kNarrowBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int k = 0; k < kNarrowBlock; ++k) {
      const int q = static_cast<int>(std::nearbyint(xb[k] * inv));
      qx[i * kNarrowBlock + k] = static_cast<int8_t>(q);
      sum += q;
    }
    dx[i] = d;
    sx[i] = d * static_cast<float>(sum);
  }
}

// Rows [0, R) (qx, dx, sx of QuantizeRows; strides K, K / 32, K / 32) times one Q4_1I8 panel -> y
// (stride ldy); `stream` as FactoredTile's. Quad j of a row's block: its 4 int8 broadcast, then
// shuffled into (qx[4j], qx[4j + 1]) x 8 | (qx[4j + 2], qx[4j + 3]) x 8.
template <int R>
inline void Int8Tile(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* panel,
                     float* y, int64_t ldy, bool stream) {
  constexpr int64_t kBytes = BlockBytes(Format::kQ4_1I8);
  const int64_t blocks = K / kNarrowBlock;
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  float acc[R][kPanel] = {};  // the float sums, touched once per block: in L1, the registers hold the 16-bit ones
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * kBytes;
    if (stream)
      for (int64_t c = 0; c < kBytes; c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + kStreamAhead * kBytes + c), _MM_HINT_NTA);
    __m256i sums[R][2];  // [row][columns 0-7 / 8-15], 16-bit, lanes: k pairs 0-1 / 2-3 of each quad
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < kQuads; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 + 32 * j));
      const __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, qx + r * K + b * kNarrowBlock + 4 * j, 4);
        const __m256i p = _mm256_shuffle_epi8(_mm256_set1_epi32(quad), pairs);
        sums[r][0] = _mm256_add_epi16(sums[r][0], _mm256_maddubs_epi16(lo, p));
        sums[r][1] = _mm256_add_epi16(sums[r][1], _mm256_maddubs_epi16(hi, p));
      }
    }
    const __m256 d[2] = {LoadHalf8(block), LoadHalf8(block + 16)}, m[2] = {LoadHalf8(block + 32), LoadHalf8(block + 48)};
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 dr = _mm256_broadcast_ss(dx + r * blocks + b), sr = _mm256_broadcast_ss(sx + r * blocks + b);
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        const __m256i s = sums[r][c];
        const __m256i total = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)),
                                               _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)));
        __m256 a = _mm256_loadu_ps(acc[r] + 8 * c);
        a = _mm256_fmadd_ps(_mm256_mul_ps(d[c], dr), _mm256_cvtepi32_ps(total), a);
        _mm256_storeu_ps(acc[r] + 8 * c, _mm256_fmadd_ps(m[c], sr, a));
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(acc[r]));
}

// Panels [p0, p1) of y = x . w for Q4_1I8 panels, x given as QuantizeRows's qx, dx, sx. Rows in
// near-equal groups of at most kInt8Rows, each group over kGroup panels at a time (still in L1/L2
// for the next group); a single group streams its blocks (prefetchnta).
void Int8RowsMatmulPanels(const int8_t* qx, const float* dx, const float* sx, const uint8_t* w, float* y,
                          int64_t M, int64_t K, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t blocks = K / kNarrowBlock, stride = blocks * BlockBytes(Format::kQ4_1I8);
  const int64_t groups = (M + kInt8Rows - 1) / kInt8Rows;
  for (int64_t g0 = p0; g0 < p1; g0 += kGroup) {
    const int64_t g1 = std::min(p1, g0 + kGroup);
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t rows = (M - m) / (groups - g);
      const int8_t* qg = qx + m * K;
      const float *dg = dx + m * blocks, *sg = sx + m * blocks;
      for (int64_t p = g0; p < g1; ++p) {
        float* yp = y + m * ldy + p * kPanel;
        const uint8_t* wp = w + p * stride;
        const bool stream = groups == 1;
        switch (rows) {
          case 1: Int8Tile<1>(qg, dg, sg, K, wp, yp, ldy, stream); break;
          case 2: Int8Tile<2>(qg, dg, sg, K, wp, yp, ldy, stream); break;
          case 3: Int8Tile<3>(qg, dg, sg, K, wp, yp, ldy, stream); break;
          case 4: Int8Tile<4>(qg, dg, sg, K, wp, yp, ldy, stream); break;
          case 5: Int8Tile<5>(qg, dg, sg, K, wp, yp, ldy, stream); break;
          default: Int8Tile<6>(qg, dg, sg, K, wp, yp, ldy, stream); break;
        }
      }
      m += rows;
    }
  }
}

struct RowsJob {
  const float* x;
  const float* xs;  // block sums of x (Q4_1); Q4_1I8: dx * (sum of qx) per block (QuantizeRows's sx)
  const int8_t* qx;  // Q4_1I8: x rounded to int8 (QuantizeRows)
  const float* dx;  // Q4_1I8: the rounding's scale per row and block
  const void* w;
  float* y;
  int64_t M, K, ldy, P;
  Format format;
};

constexpr int64_t kMinPanelsPerPart = 4;
constexpr int64_t kMinMultiplyAddsToSplit = int64_t{1} << 18;  // smaller products: one thread, no helper wakes

// y [M, P * 16] = x [M, K] . w [P, K, 16], the panels split into near-equal parts over the pool.
void RowsMatmul(Format format, const float* x, const void* w, float* y, int64_t M, int64_t P, int64_t K) {
  dflash::Pool& pool = dflash::SharedPool();
  const int64_t ldy = P * kPanel;
  int parts = std::min<int64_t>(pool.helpers() + 1, std::max<int64_t>(P / kMinPanelsPerPart, 1));
  if (M * ldy * K < kMinMultiplyAddsToSplit) parts = 1;
  thread_local std::vector<float> sums, scales;  // Q4_1's block sums of x; Q4_1I8's dx
  thread_local std::vector<int8_t> rounded_x;  // Q4_1I8's qx
  if (format == Format::kQ4_1) {
    sums.resize(M * (K / kNarrowBlock));
    BlockSums(x, M, K, sums.data());
  } else if (format == Format::kQ4_1I8) {
    sums.resize(M * (K / kNarrowBlock));
    scales.resize(M * (K / kNarrowBlock));
    rounded_x.resize(M * K);
    QuantizeRows(x, M, K, rounded_x.data(), scales.data(), sums.data());
  }
  const bool rounded = format == Format::kQ4_1I8;
  const RowsJob job{x, format == Format::kQ4_1 || rounded ? sums.data() : nullptr, rounded ? rounded_x.data() : nullptr,
                    rounded ? scales.data() : nullptr, w, y, M, K, ldy, P, format};
  pool.RunParts([](const void* context, int part, int parts) {
    const RowsJob& j = *static_cast<const RowsJob*>(context);
    const int64_t step = (j.P + parts - 1) / parts, p0 = std::min(j.P, part * step), p1 = std::min(j.P, (part + 1) * step);
    const uint8_t* narrow = static_cast<const uint8_t*>(j.w);
    switch (j.format) {
      case Format::kF32: return RowsMatmulPanels(j.x, static_cast<const float*>(j.w), j.y, j.M, j.K, j.ldy, p0, p1);
      case Format::kQ4_1:
        return FactoredRowsMatmulPanels<Format::kQ4_1>(j.x, j.xs, narrow, j.y, j.M, j.K, j.ldy, p0, p1);
      case Format::kQ8_0:
        return FactoredRowsMatmulPanels<Format::kQ8_0>(j.x, j.xs, narrow, j.y, j.M, j.K, j.ldy, p0, p1);
      case Format::kBF16: return BF16RowsMatmulPanels(j.x, narrow, j.y, j.M, j.K, j.ldy, p0, p1);
      case Format::kQ4_1I8:
        return Int8RowsMatmulPanels(j.qx, j.dx, j.xs, narrow, j.y, j.M, j.K, j.ldy, p0, p1);
    }
  }, &job, parts);
}

// w is one kernel [P, K, 16] or a stack of them [L, P, K, 16], of which `layer` picks one (read in
// place: a loop over stacked layers passes the whole stack and its index, and no slice is copied).
ffi::Error RowsMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const size_t stacked = wd.size() == 4 ? 1 : 0;
  if (xd.size() < 1 || wd.size() != 3 + stacked || wd[2 + stacked] != kPanel || xd.back() != wd[1 + stacked] ||
      layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "dflash_rows_matmul: x [..., K] and w [P, K, 16] or [L, P, K, 16] disagree, or layer is not a scalar");
  }
  const int64_t L = stacked ? wd[0] : 1, P = wd[stacked], K = wd[1 + stacked];
  const int64_t l = stacked ? layer.typed_data()[0] : 0;
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("dflash_rows_matmul: layer out of range");
  const int64_t M = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  if (static_cast<int64_t>(y->element_count()) != M * P * kPanel) {
    return ffi::Error::InvalidArgument("dflash_rows_matmul: output is not [..., P * 16]");
  }
  RowsMatmul(Format::kF32, x.typed_data(), w.typed_data() + l * P * K * kPanel, y->typed_data(), M, P, K);
  return ffi::Error::Success();
}

// y = x . w for narrow panels w [P, K / 32, B] or a stack [L, P, K / 32, B] (at `layer`) of one of
// `formats`, told apart by B (BlockBytes); `name` for the errors.
ffi::Error NarrowProduct(const char* name, std::initializer_list<Format> formats, ffi::Buffer<ffi::F32> x,
                         const uint8_t* w, ffi::Span<const int64_t> wd, ffi::Buffer<ffi::S32> layer,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const size_t stacked = wd.size() == 4 ? 1 : 0;
  const int64_t bytes = wd.size() == 0 ? 0 : wd.back();
  Format format = Format::kF32;
  for (Format f : formats)
    if (bytes == BlockBytes(f)) format = f;
  if (xd.size() < 1 || wd.size() != 3 + stacked || format == Format::kF32 ||
      xd.back() != wd[1 + stacked] * kNarrowBlock || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(name) + ": x [..., K] and w [P, K / 32, block bytes] or "
                                       "[L, P, K / 32, block bytes] disagree, or layer is not a scalar");
  }
  const int64_t L = stacked ? wd[0] : 1, P = wd[stacked], K = xd.back();
  const int64_t l = stacked ? layer.typed_data()[0] : 0;
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument(std::string(name) + ": layer out of range");
  const int64_t M = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  if (static_cast<int64_t>(y->element_count()) != M * P * kPanel) {
    return ffi::Error::InvalidArgument(std::string(name) + ": output is not [..., P * 16]");
  }
  RowsMatmul(format, x.typed_data(), w + l * P * (K / kNarrowBlock) * bytes, y->typed_data(), M, P, K);
  return ffi::Error::Success();
}

// w: narrow panels, B = 320 bytes (Q4_1), 576 (Q8_0) or 1024 (bfloat16).
ffi::Error NarrowRowsMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                               ffi::ResultBuffer<ffi::F32> y) {
  return NarrowProduct("dflash_rows_matmul_narrow", {Format::kQ4_1, Format::kQ8_0, Format::kBF16}, x,
                       w.typed_data(), w.dimensions(), layer, y);
}

// w: Q4_1 panels for int8 activations (320 bytes per block), typed int8 to tell them apart.
ffi::Error Int8RowsMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> y) {
  return NarrowProduct("dflash_rows_matmul_int8", {Format::kQ4_1I8}, x,
                       reinterpret_cast<const uint8_t*>(w.typed_data()), w.dimensions(), layer, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashRowsMatmul, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashRowsMatmulNarrow, NarrowRowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w (narrow panels)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashRowsMatmulInt8, Int8RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::S8>>()    // w (Q4_1 panels for int8 activations)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());
