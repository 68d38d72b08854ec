// A bf16 matmul for XLA's CPU backend, as an XLA FFI custom call, reading one layer of a stacked
// weight in place.
//
// Why: XLA's CPU backend copies each layer's weights out of a `lax.scan`'s stacked [L, ...]
// arrays (a dot's operand must be a buffer at a static offset) and its GEMM reaches about half of
// what these cores do with AVX512-BF16 dot products on decode-sized batches (experiments/
// JOURNAL.md section 38). This reads the layer where it lies, streams it from memory once per
// call (prefetching the next rows), and multiplies it with the CPU's fastest bf16 dot product.
// The Python wrapper, its pure-jnp reference and the build live in matmul.py beside this file.
//
//   x       bf16 [M, K]
//   w       bf16 [L, N, K]         weights stored [out, in] (PyTorch's nn.Linear layout)
//   layer   i32[]                  the layer of w to read
//   -> y    [M, N] bf16 | f32      y[m, n] = sum_k x[m, k] * w[layer, n, k], accumulated in f32
//
// Every output is computed the same way whatever M and whatever the other rows: 16 f32 lanes,
// lane j accumulating the k pairs (32 i + 2 j, 32 i + 2 j + 1) in increasing i, then one fixed
// reduction of the lanes. So a row's result never depends on the batch (batch invariance), and
// a decode step gives a row the bits a prefill chunk would.
//
// Work: tiles of (64 rows of x) x (a chunk of columns), claimed from an atomic counter by the
// calling thread and by tasks on XLA's intra-op thread pool, as in paged_decode_attention.cc.
// Three loops compute those same lane sums, whichever the build's -march allows
// (JaxserveMatmulPath): VDPBF16PS with AVX512-BF16; 8-lane FMAs on bf16 widened by bit operations
// with AVX2 (Zen 3, Haswell and later); plain C++ elsewhere. The AVX2 and portable loops give
// the same bits (tested); VDPBF16PS follows that order as Intel's manual defines it (it also
// flushes denormals), which the tests check to f32 rounding only, not bit for bit.

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Which loop this build runs (JaxserveMatmulPath): 2 AVX512-BF16, 1 AVX2 + FMA, 0 portable.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
constexpr int kPath = 2;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kPath = 1;
#else
constexpr int kPath = 0;
#endif

constexpr int kMr = 4;          // rows of x per register block
constexpr int kNr = 4;          // rows of w (output columns) per register block
// register blocks of w prefetched ahead, into L2 (_MM_HINT_T1): prefetching into L1 capped a core
// at about 11 GB/s on the Zen 4 VM (the L1's few outstanding misses), and evicted x's rows there;
// into L2, an 8-row decode matmul streams w at 26-28 GB/s (experiments/JOURNAL.md 49c)
constexpr int kPrefetch = 2;
constexpr int64_t kMTile = 64;  // rows of x per work tile (kept in L2 while w streams past)

inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The fixed reduction of 16 lanes: halves added pairwise (8, 4, 2, 1).
inline float SumLanes(const float* a) {
  float b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

struct Problem {
  const uint16_t* x;
  const uint16_t* w;  // the layer's [N, K]
  void* y;
  bool y_f32;
  int64_t m, n, k;
  int64_t chunk;    // output columns per work tile (a multiple of kNr, except the last)
  int64_t nchunks;  // column chunks
};

inline void Store(const Problem& p, int64_t row, int64_t col, float v) {
  if (p.y_f32) {
    static_cast<float*>(p.y)[row * p.n + col] = v;
  } else {
    static_cast<uint16_t*>(p.y)[row * p.n + col] = F32ToBf16(v);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
inline float SumLanes(__m512 v) {  // the same order as SumLanes(const float*) above
  const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  // c0 + c2, c1 + c3
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// A 4 x 4 block of accumulators -> one vector of their lane sums, each summed in SumLanes'
// order: lane 4 i + j holds acc[i][j]'s (the tree below transposes; it takes the accumulators
// column by column, a(t) = acc[t % 4][t / 4], so that the sums come out row by row).
inline __m512 SumLanes16(const __m512 (&acc)[4][4]) {
  __m512 s[8], u[4], r[2];
  for (int t = 0; t < 8; ++t) {  // lanes i + i+8
    const __m512 a0 = acc[(2 * t) & 3][(2 * t) >> 2], a1 = acc[(2 * t + 1) & 3][(2 * t + 1) >> 2];
    s[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  }
  for (int t = 0; t < 4; ++t) {  // then i + i+4
    u[t] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * t], s[2 * t + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * t], s[2 * t + 1], 0xDD));
  }
  for (int t = 0; t < 2; ++t) {  // then c0 + c2, c1 + c3
    r[t] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * t], u[2 * t + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * t], u[2 * t + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
}

// Rows [m, m + MR) of y, columns [n, n + NR); `pf` (or null): npf rows of w to prefetch meanwhile.
template <int MR, int NR>
inline void Block(const Problem& p, const int64_t m, const int64_t n, const uint16_t* pf,
                  const int npf) {
  const int64_t k = p.k;
  const uint16_t* __restrict x = p.x + m * k;
  const uint16_t* __restrict w = p.w + n * k;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * k + kk);
    for (int j = 0; j < npf; ++j) _mm_prefetch((const char*)(pf + j * k + kk), _MM_HINT_T1);
    for (int i = 0; i < MR; ++i) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * k + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (kk < k) {  // the last k % 32 elements, the rest of the vector zero
    const __mmask32 mask = static_cast<__mmask32>((1ull << (k - kk)) - 1);
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * k + kk);
    for (int i = 0; i < MR; ++i) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * k + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if constexpr (MR == 4 && NR == 4) {
    const __m512 v = SumLanes16(acc);  // lane 4 i + j: row m + i, column n + j
    if (p.y_f32) {
      float* y = static_cast<float*>(p.y) + m * p.n + n;
      _mm_storeu_ps(y, _mm512_castps512_ps128(v));
      _mm_storeu_ps(y + p.n, _mm512_extractf32x4_ps(v, 1));
      _mm_storeu_ps(y + 2 * p.n, _mm512_extractf32x4_ps(v, 2));
      _mm_storeu_ps(y + 3 * p.n, _mm512_extractf32x4_ps(v, 3));
    } else {
      alignas(32) uint64_t h[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(h), (__m256i)_mm512_cvtneps_pbh(v));
      uint16_t* y = static_cast<uint16_t*>(p.y) + m * p.n + n;
      for (int i = 0; i < 4; ++i) std::memcpy(y + i * p.n, &h[i], sizeof h[i]);
    }
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) Store(p, m + i, n + j, SumLanes(acc[i][j]));
  }
}

template <int NR>
void Rows(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n_end) {
  // prefetch kPrefetch blocks ahead, while the first row block reads this one
  const int64_t ahead = n0 + kPrefetch * kNr;
  const int npf = ahead + NR <= n_end ? NR : 0;
  const uint16_t* pf = npf ? p.w + ahead * p.k : nullptr;
  int64_t m = m0;
  for (; m + kMr <= m1; m += kMr, pf = nullptr) Block<kMr, NR>(p, m, n0, pf, pf ? npf : 0);
  switch (m1 - m) {
    case 3: Block<3, NR>(p, m, n0, pf, pf ? npf : 0); break;
    case 2: Block<2, NR>(p, m, n0, pf, pf ? npf : 0); break;
    case 1: Block<1, NR>(p, m, n0, pf, pf ? npf : 0); break;
    default: break;
  }
}

void Tile(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kNr <= n1; n += kNr) Rows<kNr>(p, m0, m1, n, p.n);
  for (; n < n1; ++n) Rows<1>(p, m0, m1, n, p.n);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (no bf16 instructions): the same 16 lanes as two 8-lane halves, lo (lanes 0-7, a
// 32-element block's first 16 elements) and hi (lanes 8-15). A bf16 pair is widened exactly by
// bit operations on its dword: the odd element is the high half (dword & 0xffff0000), the even
// one the low half shifted up (dword << 16). Each lane adds the odd product, then the even one,
// as VDPBF16PS is defined to (a product of two bf16 is exact in f32, so the FMA rounds once, as
// the add does): the portable loop's bits. x is widened once per work tile into a thread-local
// buffer; w is widened in registers as it streams past.

constexpr int kMr2 = 4;  // rows of x per register block
constexpr int kNr2 = 2;  // columns per register block: 8 accumulators, 4 w registers

// 16 bf16 at `s` (8 pairs) -> their odd and their even elements as f32, exactly.
inline void Widen16(const uint16_t* s, __m256& odd, __m256& even) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Row `src` (k elements) widened into `xs` floats: the lo halves of its 32-element blocks first
// (block b's lo odd, lo even at 16 b: 8 floats each), then the hi halves (at xs / 2 + 16 b), so
// that a pass over one half touches only that half's cache lines; a last partial block is padded
// with zeros.
inline void Widen(const uint16_t* src, int64_t k, int64_t xs, float* dst) {
  auto block = [xs](const uint16_t* s, float* d) {
    for (int h = 0; h < 2; ++h) {
      __m256 odd, even;
      Widen16(s + 16 * h, odd, even);
      _mm256_storeu_ps(d + h * (xs / 2), odd);
      _mm256_storeu_ps(d + h * (xs / 2) + 8, even);
    }
  };
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) block(src + kk, dst + kk / 2);
  if (kk < k) {
    uint16_t tail[32] = {};
    std::memcpy(tail, src + kk, (k - kk) * sizeof(uint16_t));
    block(tail, dst + kk / 2);
  }
}

inline float SumLanes(__m256 lo, __m256 hi) {  // SumLanes(const float*)'s order
  const __m256 b = _mm256_add_ps(lo, hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  // c0 + c2, c1 + c3
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// One half (h = 0: lanes 0-7, h = 1: lanes 8-15) of rows [0, MR) x columns [0, NR) of a block:
// acc[i][j] over all of k. The halves are independent sums, so a block runs one after the other
// (the second reads w from L1), and MR x NR accumulators fit in the 16 registers beside NR
// widened w pairs. `w` has `npf` rows prefetched meanwhile from `pf`.
template <int MR, int NR>
inline void Half(const float* xw, int64_t xs, const uint16_t* const (&w)[NR], int64_t k, int h,
                 const uint16_t* pf, int npf, __m256 (&acc)[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  auto step = [&](int64_t kk, const uint16_t* const (&wr)[NR]) {
    __m256 wo[NR], we[NR];
    for (int j = 0; j < NR; ++j) Widen16(wr[j] + 16 * h, wo[j], we[j]);
    for (int i = 0; i < MR; ++i) {
      const float* xi = xw + i * xs + h * (xs / 2) + kk / 2;
      const __m256 xo = _mm256_loadu_ps(xi), xe = _mm256_loadu_ps(xi + 8);
      for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm256_fmadd_ps(xo, wo[j], acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(xe, we[j], acc[i][j]);
      }
    }
  };
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) {
    const uint16_t* wr[NR];
    for (int j = 0; j < NR; ++j) wr[j] = w[j] + kk;
    for (int j = 0; j < npf; ++j) _mm_prefetch((const char*)(pf + j * k + kk), _MM_HINT_T1);
    step(kk, wr);
  }
  if (kk < k) {  // the last k % 32 elements, the rest zero (x's widened tail is zero already)
    uint16_t tail[NR][32] = {};
    const uint16_t* wr[NR];
    for (int j = 0; j < NR; ++j) {
      std::memcpy(tail[j], w[j] + kk, (k - kk) * sizeof(uint16_t));
      wr[j] = tail[j];
    }
    step(kk, wr);
  }
}

// Rows [m, m + MR) of y (their widened x at xw, `xs` floats apart), columns [n, n + NR); `pf`
// (or null): npf rows of w to prefetch meanwhile.
template <int MR, int NR>
inline void Block(const Problem& p, const float* xw, int64_t xs, const int64_t m, const int64_t n,
                  const uint16_t* pf, const int npf) {
  const uint16_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = p.w + (n + j) * p.k;
  __m256 lo[MR][NR], hi[MR][NR];
  Half<MR, NR>(xw, xs, w, p.k, 0, pf, npf, lo);
  Half<MR, NR>(xw, xs, w, p.k, 1, nullptr, 0, hi);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) Store(p, m + i, n + j, SumLanes(lo[i][j], hi[i][j]));
}

template <int NR>
void Rows(const Problem& p, const float* xw, int64_t xs, int64_t rows, int64_t m0, int64_t n0,
          int64_t n_end) {
  const int64_t ahead = n0 + kPrefetch * kNr2;
  const int npf = ahead + NR <= n_end ? NR : 0;
  const uint16_t* pf = npf ? p.w + ahead * p.k : nullptr;
  int64_t r = 0;
  for (; r + kMr2 <= rows; r += kMr2, pf = nullptr)
    Block<kMr2, NR>(p, xw + r * xs, xs, m0 + r, n0, pf, pf ? npf : 0);
  const int npf_rest = pf ? npf : 0;
  switch (rows - r) {
    case 3: Block<3, NR>(p, xw + r * xs, xs, m0 + r, n0, pf, npf_rest); break;
    case 2: Block<2, NR>(p, xw + r * xs, xs, m0 + r, n0, pf, npf_rest); break;
    case 1: Block<1, NR>(p, xw + r * xs, xs, m0 + r, n0, pf, npf_rest); break;
    default: break;
  }
}

void Tile(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t xs = (p.k + 31) / 32 * 32;  // widened floats per row
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>((m1 - m0) * xs));
  for (int64_t m = m0; m < m1; ++m) Widen(p.x + m * p.k, p.k, xs, widened.data() + (m - m0) * xs);
  // Rows in groups whose widened x stays in L1 (about 24 KB) while the tile's columns pass.
  const int64_t group = std::max<int64_t>(kMr2, (24576 / (4 * xs)) / kMr2 * kMr2);
  for (int64_t g = m0; g < m1; g += group) {
    const int64_t rows = std::min(group, m1 - g);
    const float* xg = widened.data() + (g - m0) * xs;
    int64_t n = n0;
    for (; n + kNr2 <= n1; n += kNr2) Rows<kNr2>(p, xg, xs, rows, g, n, p.n);
    for (; n < n1; ++n) Rows<1>(p, xg, xs, rows, g, n, p.n);
  }
}
#else
// Portable: the same lanes and reduction in plain f32 arithmetic.
void Tile(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t k = p.k;
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* x = p.x + m * k;
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* w = p.w + n * k;
      float acc[16] = {};
      for (int64_t k0 = 0; k0 < k; k0 += 32) {
        for (int j = 0; j < 16; ++j) {
          const int64_t e = k0 + 2 * j;
          if (e + 1 < k) acc[j] += Bf16ToF32(x[e + 1]) * Bf16ToF32(w[e + 1]);
          if (e < k) acc[j] += Bf16ToF32(x[e]) * Bf16ToF32(w[e]);
        }
      }
      Store(p, m, n, SumLanes(acc));
    }
  }
}
#endif

struct Counter {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// One call's problems (weights sharing x) as one space of work tiles, problem after problem.
struct Work {
  std::vector<Problem> ps;
  std::vector<int64_t> first;  // first[i]: problem i's first tile; first.back(): all tiles
};

void Drain(const Work& w, Counter& c) {
  const int64_t tiles = w.first.back();
  for (int64_t t; (t = c.next.fetch_add(1, std::memory_order_relaxed)) < tiles;) {
    size_t i = 0;
    while (t >= w.first[i + 1]) ++i;
    const Problem& p = w.ps[i];
    const int64_t u = t - w.first[i], mt = u / p.nchunks, nc = u % p.nchunks;
    const int64_t m0 = mt * kMTile, n0 = nc * p.chunk;
    Tile(p, m0, std::min(p.m, m0 + kMTile), n0, std::min(p.n, n0 + p.chunk));
    c.done.fetch_add(1, std::memory_order_release);
  }
}

// Splits the problems' columns into chunks of one width (about four per thread over all of
// them, for balance; one chunk each when the call is too small to share: little arithmetic,
// and weights small enough that one core streams them as fast as two), then runs the tiles on
// the calling thread and on XLA's intra-op thread pool.
void Run(ffi::ThreadPool& pool, Work& w) {
  int64_t flops = 0, weights = 0, cols = 0;
  for (const Problem& p : w.ps) flops += p.m * p.n * p.k, weights += p.n * p.k, cols += p.n;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const bool small = flops < (int64_t{1} << 21) && weights < (int64_t{1} << 18);
  const int64_t want = small ? 1 : 4 * workers;
  w.first.assign(1, 0);
  for (Problem& p : w.ps) {
    p.chunk = small ? p.n : std::max<int64_t>(kNr, (cols + want - 1) / want);
    p.chunk = (p.chunk + kNr - 1) / kNr * kNr;
    p.nchunks = (p.n + p.chunk - 1) / p.chunk;
    w.first.push_back(w.first.back() + p.nchunks * ((p.m + kMTile - 1) / kMTile));
  }
  const int64_t tiles = w.first.back();
  if (tiles == 0) return;
  auto work = std::make_shared<const Work>(w);
  auto counter = std::make_shared<Counter>();
  const int64_t helpers = std::min<int64_t>(workers, tiles) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work, counter] { Drain(*work, *counter); });
  }
  Drain(*work, *counter);
  while (counter->done.load(std::memory_order_acquire) < tiles) std::this_thread::yield();
}

// The problem y = x @ w[layer].T, or an error naming what does not fit.
ffi::ErrorOr<Problem> MakeProblem(const ffi::Buffer<ffi::BF16>& x, const ffi::Buffer<ffi::BF16>& w,
                                  int64_t layer, ffi::AnyBuffer& y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("expected x [M, K], w [L, N, K], y [M, N]");
  }
  Problem p;
  p.m = xd[0], p.k = xd[1], p.n = wd[1];
  if (wd[2] != p.k || yd[0] != p.m || yd[1] != p.n) {
    return ffi::Error::InvalidArgument("x, w and y shapes disagree");
  }
  const auto ydt = y.element_type();
  if (ydt != ffi::DataType::F32 && ydt != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("y must be f32 or bf16");
  }
  if (layer < 0 || layer >= wd[0]) return ffi::Error::InvalidArgument("layer out of range");
  p.x = reinterpret_cast<const uint16_t*>(x.untyped_data());
  p.w = reinterpret_cast<const uint16_t*>(w.untyped_data()) + layer * p.n * p.k;
  p.y = y.untyped_data();
  p.y_f32 = ydt == ffi::DataType::F32;
  return p;
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> y) {
  auto p = MakeProblem(x, w, layer.typed_data()[0], *y);
  if (p.has_error()) return p.error();
  Work work;
  if (p->m > 0 && p->n > 0) work.ps.push_back(*p);
  Run(pool, work);
  return ffi::Error::Success();
}

// x @ w_i[layer].T for several weight stacks w_i sharing x (q, k and v; gate and up): one call,
// one space of work tiles, so the threads are woken once and the small weights are shared out too.
ffi::Error ImplMany(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> layer,
                    ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  if (ws.size() != ys.size() || ws.size() == 0) {
    return ffi::Error::InvalidArgument("expected one result per weight, and a weight at least");
  }
  Work work;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::BF16>>(i);
    if (w.has_error()) return w.error();
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (y.has_error()) return y.error();
    auto p = MakeProblem(x, *w, layer.typed_data()[0], **y);
    if (p.has_error()) return p.error();
    if (p->m > 0 && p->n > 0) work.ps.push_back(*p);
  }
  Run(pool, work);
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JaxserveMatmulPath() { return kPath; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::AnyBuffer>());        // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulMany, ImplMany,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .RemainingArgs()                // w_i
                                  .RemainingRets());              // y_i
