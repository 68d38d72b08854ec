// Paged decode attention for XLA's CPU backend, as an XLA FFI custom call.
//
// One query token per row reads its row's pages of the stacked pool in place: no gather, no f32
// copy of the live K/V, no per-page batched dots (what the XLA 'ragged' path spends its time on,
// experiments/JOURNAL.md section 37). A second handler, below the decode one, runs prefill chunks
// (T query tokens per row, blocks of them sharing each K/V load). The Python wrappers, their
// pure-jnp references and the build live in paged_decode_attention.py beside this file.
//
//   q            [B, H, D]                 f32 | bf16 | f16
//   k, v pools   [L, KVH, P, ps, D]        f32 | bf16 | f16 | s8 | f8e4m3fn
//   k/v scales   [L, KVH, P, ps] f32       (int8 / fp8 pools; an empty f32[0] otherwise)
//   kv_lens      i32[B]                    keys visible to row b's query (at kv_len - 1); 0 = none
//   page_table   i32[B, W]
//   layer        i32[]                     the pool's layer to read
//   window       i32[]                     > 0: only keys kv_len - window .. kv_len - 1
//   attrs        scale (f32; logits * scale), softcap (f32; 0 = off, else cap * tanh(s / cap))
//   -> out       [B, H, D] in q's dtype
//
// Work item = (row, KV head): its G = H / KVH query heads share every K/V row read. Each item
// runs the online softmax page by page in f32, in a fixed order, so a row's result never
// depends on the other rows (batch invariance). Items are claimed from an atomic counter by the
// calling thread and by tasks on XLA's intra-op thread pool; the caller waits only for items
// already claimed, so a task the pool starts late finds nothing to do.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff NaN.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      int sign = i >> 7, exp = (i >> 3) & 15, man = i & 7;
      float x;
      if (exp == 15 && man == 7) {
        x = NAN;
      } else if (exp == 0) {
        x = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
      } else {
        x = std::ldexp(1.0f + man / 8.0f, exp - 7);
      }
      v[i] = sign ? -x : x;
    }
  }
};
const Fp8Table kFp8;

// n elements of dtype `dt` at src -> f32 at dst.
bool ToF32(ffi::DataType dt, const void* src, int64_t n, float* dst) {
  switch (dt) {
    case ffi::DataType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return true;
    case ffi::DataType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(s[i]);
      return true;
    }
    case ffi::DataType::F16: {
      const _Float16* s = static_cast<const _Float16*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return true;
    }
    case ffi::DataType::S8: {
      const int8_t* s = static_cast<const int8_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return true;
    }
    case ffi::DataType::F8E4M3FN: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = kFp8.v[s[i]];
      return true;
    }
    default:
      return false;
  }
}

// f32 at src -> n elements of dtype `dt` at dst (round to nearest even for bf16).
void FromF32(ffi::DataType dt, const float* src, int64_t n, void* dst) {
  switch (dt) {
    case ffi::DataType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case ffi::DataType::BF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, &src[i], sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
          d[i] = static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
        } else {
          d[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
      }
      break;
    }
    case ffi::DataType::F16: {
      _Float16* d = static_cast<_Float16*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<_Float16>(src[i]);
      break;
    }
    default:
      break;
  }
}

size_t KernelBytes(ffi::DataType dt) {
  switch (dt) {
    case ffi::DataType::F32:
      return 4;
    case ffi::DataType::BF16:
    case ffi::DataType::F16:
      return 2;
    case ffi::DataType::S8:
    case ffi::DataType::F8E4M3FN:
      return 1;
    default:
      return 0;
  }
}

// What both handlers read the same way: q's heads, the pools, the layer, the logits' options.
struct Common {
  int64_t h, kvh, g, d, num_layers, num_pages, ps;
  const uint8_t *q, *k, *v;
  const float *k_scale, *v_scale;  // null for unquantized pools
  int32_t layer, window;
  float scale, softcap;
  ffi::DataType q_dt, kv_dt;
  size_t q_bytes, kv_bytes;
  uint8_t* out;
};

// Checks and reads the Common part of a call; q's last two dimensions are [H, D].
ffi::Error ReadCommon(Common& p, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                      ffi::Result<ffi::AnyBuffer>& out, float scale, float softcap) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (kd.size() != 5 || qd.size() < 2) {
    return ffi::Error::InvalidArgument("expected pools [L, KVH, P, ps, D] and q [..., H, D]");
  }
  p.h = qd[qd.size() - 2], p.d = qd[qd.size() - 1];
  p.num_layers = kd[0], p.kvh = kd[1], p.num_pages = kd[2], p.ps = kd[3];
  if (kd[4] != p.d || p.kvh <= 0 || p.h % p.kvh != 0 || v.dimensions().size() != 5 ||
      v.element_type() != k.element_type()) {
    return ffi::Error::InvalidArgument("q and pools shapes or dtypes disagree");
  }
  p.g = p.h / p.kvh;
  p.q_dt = q.element_type(), p.kv_dt = k.element_type();
  p.q_bytes = KernelBytes(p.q_dt), p.kv_bytes = KernelBytes(p.kv_dt);
  if (p.q_dt != ffi::DataType::F32 && p.q_dt != ffi::DataType::BF16 &&
      p.q_dt != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("q must be f32, bf16 or f16");
  }
  if (p.kv_bytes == 0) return ffi::Error::InvalidArgument("unsupported KV pool dtype");
  const bool quantized = k_scale.element_count() > 0;
  if (quantized != (p.kv_dt == ffi::DataType::S8 || p.kv_dt == ffi::DataType::F8E4M3FN)) {
    return ffi::Error::InvalidArgument("int8 / fp8 pools need scales, other pools none");
  }
  p.layer = layer.typed_data()[0], p.window = window.typed_data()[0];
  if (p.layer < 0 || p.layer >= p.num_layers) {
    return ffi::Error::InvalidArgument("layer out of range");
  }
  p.q = static_cast<const uint8_t*>(q.untyped_data());
  p.k = static_cast<const uint8_t*>(k.untyped_data());
  p.v = static_cast<const uint8_t*>(v.untyped_data());
  p.k_scale = quantized ? k_scale.typed_data() : nullptr;
  p.v_scale = quantized ? v_scale.typed_data() : nullptr;
  p.scale = scale, p.softcap = softcap;
  p.out = static_cast<uint8_t*>(out->untyped_data());
  return ffi::Error::Success();
}

struct Problem : Common {
  int64_t b, w;
  const int32_t *kv_lens, *page_table;
};

// 16 f32 lanes (GCC lowers this to one zmm register with AVX-512, two ymm with AVX2). Loads and
// stores go through the may_alias, 4-byte-aligned forms (one unaligned vector move each): a memcpy
// into a vector variable made GCC stage AVX2 loads through the stack, in 16-byte halves read back
// as 32, a store-forwarding stall on every load (JOURNAL.md section 42).
typedef float F16v __attribute__((vector_size(64), aligned(4)));
typedef float F16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef float F8v __attribute__((vector_size(32), aligned(4)));
typedef float F8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef float F4v __attribute__((vector_size(16), aligned(4)));

inline F16v LoadV(const float* p) { return *reinterpret_cast<const F16u*>(p); }
inline void StoreV(float* p, F16v x) { *reinterpret_cast<F16u*>(p) = x; }
inline F8v Load8(const float* p) { return *reinterpret_cast<const F8u*>(p); }
inline void Store8(float* p, F8v x) { *reinterpret_cast<F8u*>(p) = x; }

// A fixed pairwise tree in registers (the same order on every machine).
// SumHalves(lo, hi) sums 16 lanes held as two 8-lane halves in that same order.
inline float SumHalves(F8v lo, F8v hi) {
  const F8v a = lo + hi;
  const F4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float HorizontalSum(F16v x) {
  return SumHalves(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7),
                   __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
}

// 16 lanes kept as two 8-lane halves (a 16-lane accumulator stays in memory on AVX2; see the PV
// loop in Item), summed as HorizontalSum sums a 16-lane vector: the same bits.
inline float Dot(const float* a, const float* b, int64_t d) {
  int64_t e = 0;
  F8v lo = {}, hi = {};
  for (; e + 16 <= d; e += 16) {
    lo += Load8(a + e) * Load8(b + e);
    hi += Load8(a + e + 8) * Load8(b + e + 8);
  }
  float s = SumHalves(lo, hi);
  for (; e < d; ++e) s += a[e] * b[e];
  return s;
}

// exp(x) for x <= 0 (Cephes' expf: Cody-Waite reduction, degree-5 polynomial; ~1-2 ulp);
// written without branches or library calls so that loops over it vectorize.
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);  // 2^n (not memcpy: this loop must vectorize)
}

// Defined with the prefill handler below; decode items use them when d is a multiple of 16.
void Scores(const float* qf, int64_t m, const float* kf, int64_t n, int64_t dp, float* s,
            int64_t lds);
void PvGroup(float* const* acc, const float* const* p, const float* alpha, int64_t rows,
             const float* vf, int64_t dp, int64_t j0, int64_t j1);
constexpr int64_t kMaxPvHeads = 64;  // query heads per KV head that take that path

// One (row, KV head): the online softmax over the row's visible pages, a page at a time.
void Item(const Problem& p, int64_t item, std::vector<float>& buf) {
  const int64_t row = item / p.kvh, head = item % p.kvh;
  const int64_t g = p.g, d = p.d, ps = p.ps;
  const int64_t rows = ps + 16;  // kf, vf: a page, and room for Scores' last 16-key block
  buf.resize(g * d * 2 + 2 * rows * d + 2 * g * ps + 2 * g);
  float* qf = buf.data();      // [G, D]
  float* acc = qf + g * d;     // [G, D]
  float* kf = acc + g * d;     // [ps, D]
  float* vf = kf + rows * d;   // [ps, D]
  float* s = vf + rows * d;    // [G, ps] logits
  float* pr = s + g * ps;      // [G, ps] probabilities (unnormalized)
  float* m = pr + g * ps;      // [G] running max
  float* l = m + g;            // [G] running sum

  const int64_t q_off = (row * p.h + head * g) * d;
  ToF32(p.q_dt, p.q + q_off * p.q_bytes, g * d, qf);
  std::fill(acc, acc + g * d, 0.0f);
  std::fill(m, m + g, -INFINITY);
  std::fill(l, l + g, 0.0f);

  // With d a multiple of 16 (and G small enough for the stack arrays), the scores and value rows
  // run through the prefill handler's Scores and PvRows, which give these loops' bits faster.
  const bool lanes = d % 16 == 0 && g <= kMaxPvHeads;
  float alphas[kMaxPvHeads];
  const int64_t kv_len = std::clamp<int64_t>(p.kv_lens[row], 0, p.w * ps);
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, kv_len - p.window) : 0;
  const int64_t pool_base = (static_cast<int64_t>(p.layer) * p.kvh + head) * p.num_pages;
  const int32_t* table = p.page_table + row * p.w;
  for (int64_t j = first / ps; j * ps < kv_len; ++j) {
    const int64_t page = std::clamp<int64_t>(table[j], 0, p.num_pages - 1);
    const int64_t t0 = std::max(first, j * ps) - j * ps;
    const int64_t t1 = std::min(kv_len, j * ps + ps) - j * ps;
    const int64_t block = (pool_base + page) * ps;  // the page's first token
    if ((j + 1) * ps < kv_len) {  // the next page: pages are scattered, so no hardware prefetch
      const int64_t next = std::clamp<int64_t>(table[j + 1], 0, p.num_pages - 1);
      const int64_t bytes = ps * d * p.kv_bytes, at = (pool_base + next) * bytes;
      for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(p.k + at + o);
        __builtin_prefetch(p.v + at + o);
      }
    }
    ToF32(p.kv_dt, p.k + (block + t0) * d * p.kv_bytes, (t1 - t0) * d, kf + t0 * d);
    ToF32(p.kv_dt, p.v + (block + t0) * d * p.kv_bytes, (t1 - t0) * d, vf + t0 * d);
    if (p.k_scale != nullptr) {
      for (int64_t t = t0; t < t1; ++t) {
        const float ks = p.k_scale[block + t], vs = p.v_scale[block + t];
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) {
          kf[t * d + e] *= ks;
          vf[t * d + e] *= vs;
        }
      }
    }
    if (lanes) {  // Scores computes each dot as Dot does (d a multiple of its 16 lanes)
      Scores(qf, g, kf + t0 * d, t1 - t0, d, s + t0, ps);
      for (int64_t gi = 0; gi < g; ++gi) {
        for (int64_t t = t0; t < t1; ++t) {
          float x = s[gi * ps + t] * p.scale;
          if (p.softcap > 0.0f) x = p.softcap * std::tanh(x / p.softcap);
          s[gi * ps + t] = x;
        }
      }
    } else {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t gi = 0; gi < g; ++gi) {
          float x = Dot(qf + gi * d, kf + t * d, d) * p.scale;
          if (p.softcap > 0.0f) x = p.softcap * std::tanh(x / p.softcap);
          s[gi * ps + t] = x;
        }
      }
    }
    int64_t live[kMaxPvHeads], nlive = 0;  // heads with a finite logit so far (d % 16 == 0)
    for (int64_t gi = 0; gi < g; ++gi) {
      const float* sg = s + gi * ps;
      float* pg = pr + gi * ps;
      float page_max = -INFINITY;
      for (int64_t t = t0; t < t1; ++t) page_max = std::max(page_max, sg[t]);
      const float new_m = std::max(m[gi], page_max);
      if (new_m == -INFINITY) continue;  // no finite logit yet
      const float alpha = m[gi] == -INFINITY ? 0.0f : ExpNonPositive(m[gi] - new_m);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = t0; t < t1; ++t) {
        pg[t] = ExpNonPositive(sg[t] - new_m);
        sum += pg[t];
      }
      l[gi] = l[gi] * alpha + sum;
      m[gi] = new_m;
      if (lanes) {  // the value rows below, for all such heads at once
        alphas[nlive] = alpha, live[nlive++] = gi;
        continue;
      }
      float* ag = acc + gi * d;
      int64_t e = 0;
      // Two 8-lane halves, not one 16-lane vector: on AVX2 GCC keeps a 16-lane accumulator in
      // memory, moving it through general registers on every step of this loop (JOURNAL.md 42).
      // Each element gets the same operations in the same order either way.
      for (; e + 16 <= d; e += 16) {
        F8v a0 = Load8(ag + e) * alpha, a1 = Load8(ag + e + 8) * alpha;
        for (int64_t t = t0; t < t1; ++t) {
          const float pt = pg[t];
          a0 += pt * Load8(vf + t * d + e);
          a1 += pt * Load8(vf + t * d + e + 8);
        }
        Store8(ag + e, a0);
        Store8(ag + e + 8, a1);
      }
      for (; e < d; ++e) {
        float a = ag[e] * alpha;
        for (int64_t t = t0; t < t1; ++t) a += pg[t] * vf[t * d + e];
        ag[e] = a;
      }
    }
    for (int64_t h0 = 0; h0 < nlive; h0 += 4) {  // PvGroup: the same operations as the loop above
      float* ar[4];
      const float* pp[4];
      const int64_t n = std::min<int64_t>(4, nlive - h0);
      for (int64_t x = 0; x < n; ++x) ar[x] = acc + live[h0 + x] * d, pp[x] = pr + live[h0 + x] * ps;
      PvGroup(ar, pp, alphas + h0, n, vf, d, t0, t1);
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    const float inv = l[gi] > 0.0f ? 1.0f / l[gi] : 0.0f;
    float* ag = acc + gi * d;
    for (int64_t e = 0; e < d; ++e) ag[e] = l[gi] > 0.0f ? ag[e] * inv : 0.0f;
  }
  FromF32(p.q_dt, acc, g * d, p.out + q_off * p.q_bytes);
}

// Runs item(p, i, buf) for i < items on the calling thread and on XLA's intra-op pool: items are
// claimed from an atomic counter, and the caller waits only for items already claimed, so a task
// the pool starts late finds nothing to do.
template <class P, class F>
void RunItems(ffi::ThreadPool& pool, const P& p, int64_t items, F item) {
  struct Counter {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counter = std::make_shared<Counter>();
  auto drain = [p, items, counter, item] {
    std::vector<float> buf;
    for (int64_t i; (i = counter->next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      item(p, i, buf);
      counter->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(drain)(drain));  // a copy each
  drain();
  while (counter->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                ffi::Result<ffi::AnyBuffer> out, float scale, float softcap) {
  auto qd = q.dimensions(), td = page_table.dimensions();
  if (qd.size() != 3 || td.size() != 2) {
    return ffi::Error::InvalidArgument("expected q [B, H, D] and page_table [B, W]");
  }
  Problem p;
  ffi::Error err = ReadCommon(p, q, k, v, k_scale, v_scale, layer, window, out, scale, softcap);
  if (err.failure()) return err;
  p.b = qd[0], p.w = td[1];
  if (td[0] != p.b) return ffi::Error::InvalidArgument("q and page_table rows disagree");
  p.kv_lens = kv_lens.typed_data(), p.page_table = page_table.typed_data();
  RunItems(pool, p, p.b * p.kvh, Item);
  return ffi::Error::Success();
}


// ---- Prefill: a chunk's T query tokens per row, blocks of them sharing each K/V load ----------
//
// Work item = (row, KV head, block of kQueryBlock query tokens). The block's keys are read a tile
// at a time (tiles at absolute key positions, kKeyTile keys), converted to f32 once for all of
// its G * tokens query vectors, the scores computed by Scores (each dot in Dot's and
// HorizontalSum's order, so a score has the same bits in a block or alone), then every query runs
// the online softmax over its own visible keys of the tile: keys s with max(0, p + 1 - window)
// <= s <= p for a query at position p (every s <= p for a global layer). Everything a query's
// result depends on is fixed by its position, its keys and the tile grid: not by its block, its
// chunk, the other rows or the page-table width. Tokens at positions outside [0, seq_len) are
// padding and get zeros.

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kKeyTile = 128;

struct PrefillProblem : Common {
  int64_t b, t, w, dp, qblocks;  // dp: d rounded up to 16 lanes
  const int32_t *positions, *seq_lens, *page_table;
};

typedef int32_t I16v __attribute__((vector_size(64), aligned(4)));

// ExpNonPositive on 16 lanes, in vector arithmetic (GCC does not vectorize the scalar loop).
inline F16v ExpNonPositive16(F16v x) {
  x = x < -87.0f ? F16v{} - 87.0f : x;
  const F16v t = x * 1.44269504088896341f + 0.5f;
  I16v ni = __builtin_convertvector(t, I16v);  // truncation, then floor
  ni += (__builtin_convertvector(ni, F16v) > t);  // -1 where truncation rounded up
  const F16v n = __builtin_convertvector(ni, F16v);
  const F16v r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F16v q = r * 1.9875691500e-4f + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  q = q * r * r + r + 1.0f;
  return q * (F16v)((ni + 127) << 23);
}

// x[j] = exp(x[j] - m) for j < n (x[j] <= m), every element by the same vector code.
inline void ExpShifted(float* x, int64_t n, float m) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) StoreV(x + j, ExpNonPositive16(LoadV(x + j) - m));
  if (j < n) {
    F16v v = {};
    std::memcpy(&v, x + j, (n - j) * sizeof(float));
    v = ExpNonPositive16(v - m);
    std::memcpy(x + j, &v, (n - j) * sizeof(float));
  }
}

#if defined(__AVX512F__)
// The lane sums of 16 accumulators as one vector (lane j: acc[j]'s), each summed in
// HorizontalSum's order: a transposing tree adds lanes i + i+8, then i + i+4, then c0 + c2 and
// c1 + c3, then those two, for all 16 at once (15 adds and 30 shuffles for 16 sums).
inline F16v SumLanes16(const F16v (&a)[16]) {
  F16v s[8], u[4], r[2];
  for (int t = 0; t < 8; ++t) {  // lanes 0-7: a[2t]'s i + i+8; lanes 8-15: a[2t+1]'s
    s[t] = __builtin_shufflevector(a[2 * t], a[2 * t + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * t], a[2 * t + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                   27, 28, 29, 30, 31);
  }
  for (int t = 0; t < 4; ++t) {  // quarter q: a[4t + q]'s i + i+4
    u[t] = __builtin_shufflevector(s[2 * t], s[2 * t + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                   24, 25, 26, 27) +
           __builtin_shufflevector(s[2 * t], s[2 * t + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  }
  for (int t = 0; t < 2; ++t) {  // lane pair q: a[8t + q]'s c0 + c2, c1 + c3
    r[t] = __builtin_shufflevector(u[2 * t], u[2 * t + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21,
                                   24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * t], u[2 * t + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(r[0], r[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                 30) +
         __builtin_shufflevector(r[0], r[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
}
#endif

// s[r * lds + j] = q_r . k_j for rows r < m of qf and keys j < n of kf (both [*, dp]), each in
// Dot's order. With AVX-512: a row against 16 keys at a time, 16 accumulators summed by
// SumLanes16 (kf must have rows up to n rounded up to 16: the extra rows' sums are dropped).
// Otherwise blocks of 4 rows x 2 keys; the low 8 lanes of all 16 lanes are summed in one pass
// and the high 8 in a second, so each pass's 8 accumulators stay in AVX2's 16 registers.
void Scores(const float* qf, int64_t m, const float* kf, int64_t n, int64_t dp, float* s,
            int64_t lds) {
#if defined(__AVX512F__)
  for (int64_t r = 0; r < m; ++r) {
    const float* q = qf + r * dp;
    for (int64_t j = 0; j < n; j += 16) {
      F16v acc[16];
      for (int x = 0; x < 16; ++x) acc[x] = F16v{};
      for (int64_t e = 0; e < dp; e += 16) {
        const F16v qv = LoadV(q + e);
        for (int x = 0; x < 16; ++x) acc[x] += qv * LoadV(kf + (j + x) * dp + e);
      }
      const F16v sums = SumLanes16(acc);
      const int64_t valid = std::min<int64_t>(16, n - j);
      if (valid == 16) {
        StoreV(s + r * lds + j, sums);
      } else {
        for (int64_t x = 0; x < valid; ++x) s[r * lds + j + x] = sums[x];
      }
    }
  }
#else
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) {
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      F8v half[2][8];  // [lo / hi][2 i + jj]
      for (int h = 0; h < 2; ++h) {
        F8v acc[8] = {};
        for (int64_t e = 8 * h; e < dp; e += 16) {
          const F8v k0 = Load8(kf + j * dp + e), k1 = Load8(kf + (j + 1) * dp + e);
          for (int i = 0; i < 4; ++i) {
            const F8v qv = Load8(qf + (r + i) * dp + e);
            acc[2 * i] += qv * k0;
            acc[2 * i + 1] += qv * k1;
          }
        }
        for (int x = 0; x < 8; ++x) half[h][x] = acc[x];
      }
      for (int i = 0; i < 4; ++i) {
        for (int jj = 0; jj < 2; ++jj) {
          s[(r + i) * lds + j + jj] = SumHalves(half[0][2 * i + jj], half[1][2 * i + jj]);
        }
      }
    }
    for (; j < n; ++j) {
      for (int i = 0; i < 4; ++i) s[(r + i) * lds + j] = Dot(qf + (r + i) * dp, kf + j * dp, dp);
    }
  }
  for (; r < m; ++r) {
    for (int64_t j = 0; j < n; ++j) s[r * lds + j] = Dot(qf + r * dp, kf + j * dp, dp);
  }
#endif
}

// acc[i][e0 .. e0 + 16 NE) = acc[i][..] * alpha[i] + sum over keys j in [j0, j1) of p[i][j] *
// vf[j][e0 ..], for R rows, keys in increasing order. With AVX-512 NE vectors of 16 lanes per
// row stay in registers (R * NE <= 16), so each key's probability is broadcast once per row;
// otherwise NE = 1 and 16 lanes are two 8-lane halves, so the 2R accumulators stay in AVX2's
// registers. Each element gets the same operations in the same order either way.
#if defined(__AVX512F__)
template <int R, int NE>
void PvBlock(float* const* acc, const float* const* p, const float* alpha, const float* vf,
             int64_t dp, int64_t e0, int64_t j0, int64_t j1) {
  F16v a[R][NE];
  for (int i = 0; i < R; ++i)
    for (int x = 0; x < NE; ++x) a[i][x] = LoadV(acc[i] + e0 + 16 * x) * alpha[i];
  for (int64_t j = j0; j < j1; ++j) {
    F16v v[NE];
    for (int x = 0; x < NE; ++x) v[x] = LoadV(vf + j * dp + e0 + 16 * x);
    for (int i = 0; i < R; ++i) {
      const float pj = p[i][j];
      for (int x = 0; x < NE; ++x) a[i][x] += pj * v[x];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int x = 0; x < NE; ++x) StoreV(acc[i] + e0 + 16 * x, a[i][x]);
}

template <int R>
void PvRows(float* const* acc, const float* const* p, const float* alpha, const float* vf,
            int64_t dp, int64_t j0, int64_t j1) {
  for (int64_t e0 = 0; e0 < dp;) {
    switch (std::min<int64_t>(4, (dp - e0) / 16)) {
      case 1: PvBlock<R, 1>(acc, p, alpha, vf, dp, e0, j0, j1), e0 += 16; break;
      case 2: PvBlock<R, 2>(acc, p, alpha, vf, dp, e0, j0, j1), e0 += 32; break;
      case 3: PvBlock<R, 3>(acc, p, alpha, vf, dp, e0, j0, j1), e0 += 48; break;
      default: PvBlock<R, 4>(acc, p, alpha, vf, dp, e0, j0, j1), e0 += 64; break;
    }
  }
}
#else
template <int R>
void PvBlock(float* const* acc, const float* const* p, const float* alpha, const float* vf,
             int64_t dp, int64_t e0, int64_t j0, int64_t j1) {
  F8v lo[R], hi[R];
  for (int i = 0; i < R; ++i) {
    lo[i] = Load8(acc[i] + e0) * alpha[i];
    hi[i] = Load8(acc[i] + e0 + 8) * alpha[i];
  }
  for (int64_t j = j0; j < j1; ++j) {
    const F8v vl = Load8(vf + j * dp + e0), vh = Load8(vf + j * dp + e0 + 8);
    for (int i = 0; i < R; ++i) {
      const float pj = p[i][j];
      lo[i] += pj * vl;
      hi[i] += pj * vh;
    }
  }
  for (int i = 0; i < R; ++i) {
    Store8(acc[i] + e0, lo[i]);
    Store8(acc[i] + e0 + 8, hi[i]);
  }
}

template <int R>
void PvRows(float* const* acc, const float* const* p, const float* alpha, const float* vf,
            int64_t dp, int64_t j0, int64_t j1) {
  for (int64_t e0 = 0; e0 < dp; e0 += 16) PvBlock<R>(acc, p, alpha, vf, dp, e0, j0, j1);
}
#endif

// PvRows for `rows` (1 to 4) rows.
void PvGroup(float* const* acc, const float* const* p, const float* alpha, int64_t rows,
             const float* vf, int64_t dp, int64_t j0, int64_t j1) {
  switch (rows) {
    case 1: PvRows<1>(acc, p, alpha, vf, dp, j0, j1); break;
    case 2: PvRows<2>(acc, p, alpha, vf, dp, j0, j1); break;
    case 3: PvRows<3>(acc, p, alpha, vf, dp, j0, j1); break;
    default: PvRows<4>(acc, p, alpha, vf, dp, j0, j1); break;
  }
}

void PrefillItem(const PrefillProblem& p, int64_t item, std::vector<float>& buf) {
  const int64_t qb = item % p.qblocks, head = item / p.qblocks % p.kvh;
  const int64_t row = item / (p.qblocks * p.kvh);
  const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, p.t - t0);
  const int64_t g = p.g, d = p.d, dp = p.dp, m = nq * g, ps = p.ps;
  int64_t lo[kQueryBlock], hi[kQueryBlock];  // the visible keys [lo, hi) of each query
  int64_t kmin = INT64_MAX, kmax = 0;
  const int64_t seq_len = p.seq_lens[row], cap = p.w * ps;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t pos = p.positions[row * p.t + t0 + i];
    int64_t h = pos >= 0 && pos < seq_len ? std::min(pos + 1, cap) : 0;
    int64_t l = p.window > 0 ? std::max<int64_t>(0, h - p.window) : 0;
    if (l >= h) l = h = 0;
    lo[i] = l, hi[i] = h;
    if (h > l) kmin = std::min(kmin, l), kmax = std::max(kmax, h);
  }
  buf.resize(2 * m * dp + 2 * m + 2 * kKeyTile * dp + m * kKeyTile + m);
  float* qf = buf.data();           // [m, dp] the block's query vectors, row i * g + gi
  float* acc = qf + m * dp;         // [m, dp]
  float* mx = acc + m * dp;         // [m] running max
  float* l = mx + m;                // [m] running sum
  float* kf = l + m;                // [kKeyTile, dp]
  float* vf = kf + kKeyTile * dp;   // [kKeyTile, dp]
  float* s = vf + kKeyTile * dp;    // [m, kKeyTile] scores, then probabilities
  float* alpha = s + m * kKeyTile;  // [m]
  std::fill(buf.begin(), buf.begin() + 2 * m * dp, 0.0f);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t off = ((row * p.t + t0 + i) * p.h + head * g + gi) * d;
      ToF32(p.q_dt, p.q + off * p.q_bytes, d, qf + (i * g + gi) * dp);
    }
  }
  std::fill(mx, mx + m, -INFINITY);
  std::fill(l, l + m, 0.0f);
  const int64_t pool_base = (static_cast<int64_t>(p.layer) * p.kvh + head) * p.num_pages;
  const int32_t* table = p.page_table + row * p.w;
  for (int64_t ts = kmax > 0 ? kmin / kKeyTile * kKeyTile : 0; ts < kmax; ts += kKeyTile) {
    const int64_t a = std::max(ts, kmin), e = std::min(ts + kKeyTile, kmax), n = e - a;
    for (int64_t key = a; key < e;) {  // the tile's keys [a, e) -> kf, vf rows key - a
      const int64_t j = key / ps, off = key - j * ps, run = std::min(e - key, ps - off);
      const int64_t page = std::clamp<int64_t>(table[j], 0, p.num_pages - 1);
      const int64_t tok = (pool_base + page) * ps + off;
      if (d == dp) {  // the run's rows are contiguous in the pool and in kf / vf: one call each
        ToF32(p.kv_dt, p.k + tok * d * p.kv_bytes, run * d, kf + (key - a) * dp);
        ToF32(p.kv_dt, p.v + tok * d * p.kv_bytes, run * d, vf + (key - a) * dp);
      }
      for (int64_t x = 0; x < run; ++x) {
        float* kr = kf + (key - a + x) * dp;
        float* vr = vf + (key - a + x) * dp;
        if (d != dp) {
          ToF32(p.kv_dt, p.k + (tok + x) * d * p.kv_bytes, d, kr);
          ToF32(p.kv_dt, p.v + (tok + x) * d * p.kv_bytes, d, vr);
          std::fill(kr + d, kr + dp, 0.0f);
          std::fill(vr + d, vr + dp, 0.0f);
        }
        if (p.k_scale != nullptr) {
          const float ks = p.k_scale[tok + x], vs = p.v_scale[tok + x];
          for (int64_t c = 0; c < d; ++c) kr[c] *= ks, vr[c] *= vs;
        }
      }
      key += run;
    }
    Scores(qf, m, kf, n, dp, s, kKeyTile);
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t j0 = std::max(lo[i], a) - a, j1 = std::min(hi[i], e) - a;  // tile-relative
      if (j1 <= j0) continue;
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t r = i * g + gi;
        float* sr = s + r * kKeyTile;
        const float scale = p.scale, cap = p.softcap;
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) sr[j] *= scale;
        if (cap > 0.0f) {
          for (int64_t j = j0; j < j1; ++j) sr[j] = cap * std::tanh(sr[j] / cap);
        }
        F16v lane_max = {};  // a max: the same whatever the order
        lane_max -= INFINITY;
        int64_t j = j0;
        for (; j + 16 <= j1; j += 16) {
          const F16v x = LoadV(sr + j);
          lane_max = x > lane_max ? x : lane_max;
        }
        float tile_max = -INFINITY;
        for (int c = 0; c < 16; ++c) tile_max = std::max(tile_max, lane_max[c]);
        for (; j < j1; ++j) tile_max = std::max(tile_max, sr[j]);
        const float new_m = std::max(mx[r], tile_max);
        if (new_m == -INFINITY) {  // no finite logit yet: nothing to add
          alpha[r] = 1.0f;
          std::fill(sr + j0, sr + j1, 0.0f);
          continue;
        }
        alpha[r] = mx[r] == -INFINITY ? 0.0f : ExpNonPositive(mx[r] - new_m);
        ExpShifted(sr + j0, j1 - j0, new_m);
        F16v lanes = {};  // the sum of the probabilities, lanes of 16 from j0
        for (j = j0; j + 16 <= j1; j += 16) lanes += LoadV(sr + j);
        float sum = HorizontalSum(lanes);
        for (; j < j1; ++j) sum += sr[j];
        l[r] = l[r] * alpha[r] + sum;
        mx[r] = new_m;
      }
      for (int64_t g0 = 0; g0 < g; g0 += 4) {  // the query's heads, 4 at a time
        const int64_t rows = std::min<int64_t>(4, g - g0);
        float* ar[4];
        const float* pr[4];
        for (int64_t x = 0; x < rows; ++x) {
          ar[x] = acc + (i * g + g0 + x) * dp;
          pr[x] = s + (i * g + g0 + x) * kKeyTile;
        }
        PvGroup(ar, pr, alpha + i * g + g0, rows, vf, dp, j0, j1);
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    float* ar = acc + r * dp;
    for (int64_t c = 0; c < d; ++c) ar[c] = l[r] > 0.0f ? ar[c] * inv : 0.0f;
  }
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t off = ((row * p.t + t0 + i) * p.h + head * g + gi) * d;
      FromF32(p.q_dt, acc + (i * g + gi) * dp, d, p.out + off * p.q_bytes);
    }
  }
}

ffi::Error PrefillImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                       ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> seq_lens,
                       ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> window, ffi::Result<ffi::AnyBuffer> out, float scale,
                       float softcap) {
  auto qd = q.dimensions(), td = page_table.dimensions();
  auto pd = positions.dimensions(), sd = seq_lens.dimensions();
  if (qd.size() != 4 || td.size() != 2 || pd.size() != 2 || sd.size() != 1) {
    return ffi::Error::InvalidArgument("expected q [B, T, H, D], positions [B, T], seq_lens [B], "
                                       "page_table [B, W]");
  }
  PrefillProblem p;
  ffi::Error err = ReadCommon(p, q, k, v, k_scale, v_scale, layer, window, out, scale, softcap);
  if (err.failure()) return err;
  p.b = qd[0], p.t = qd[1], p.w = td[1], p.dp = (p.d + 15) / 16 * 16;
  if (td[0] != p.b || pd[0] != p.b || pd[1] != p.t || sd[0] != p.b) {
    return ffi::Error::InvalidArgument("q, positions, seq_lens and page_table shapes disagree");
  }
  p.positions = positions.typed_data(), p.seq_lens = seq_lens.typed_data();
  p.page_table = page_table.typed_data();
  p.qblocks = (p.t + kQueryBlock - 1) / kQueryBlock;
  RunItems(pool, p, p.b * p.kvh * p.qblocks, PrefillItem);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecodeAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()      // q
                                  .Arg<ffi::AnyBuffer>()      // k pool
                                  .Arg<ffi::AnyBuffer>()      // v pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::AnyBuffer>()      // out
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedPrefillAttention, PrefillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k pool
                                  .Arg<ffi::AnyBuffer>()         // v pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
