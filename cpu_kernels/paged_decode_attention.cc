// Paged decode attention for XLA's CPU backend, as an XLA FFI custom call.
//
// One query token per row reads its row's pages of the stacked pool in place: no gather, no f32
// copy of the live K/V, no per-page batched dots (what the XLA 'ragged' path spends its time on,
// experiments/RESULTS.md section 37). The Python wrapper, its pure-jnp reference and the build
// live in paged_decode_attention.py beside this file.
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

struct Problem {
  int64_t b, h, kvh, g, d, num_layers, num_pages, ps, w;
  const uint8_t *q, *k, *v;
  const float *k_scale, *v_scale;  // null for unquantized pools
  const int32_t *kv_lens, *page_table;
  int32_t layer, window;
  float scale, softcap;
  ffi::DataType q_dt, kv_dt;
  size_t q_bytes, kv_bytes;
  uint8_t* out;
};

// 16 f32 lanes (GCC lowers this to one zmm register with AVX-512, two ymm with AVX2).
typedef float F16v __attribute__((vector_size(64), aligned(4)));

inline F16v LoadV(const float* p) {
  F16v x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void StoreV(float* p, F16v x) { std::memcpy(p, &x, sizeof x); }

typedef float F8v __attribute__((vector_size(32), aligned(4)));
typedef float F4v __attribute__((vector_size(16), aligned(4)));

// A fixed pairwise tree in registers (the same order on every machine).
inline float HorizontalSum(F16v x) {
  F8v a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  F4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float Dot(const float* a, const float* b, int64_t d) {
  int64_t e = 0;
  F16v acc = {};
  for (; e + 16 <= d; e += 16) acc += LoadV(a + e) * LoadV(b + e);
  float s = HorizontalSum(acc);
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
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// One (row, KV head): the online softmax over the row's visible pages, a page at a time.
void Item(const Problem& p, int64_t item, std::vector<float>& buf) {
  const int64_t row = item / p.kvh, head = item % p.kvh;
  const int64_t g = p.g, d = p.d, ps = p.ps;
  buf.resize(g * d * 2 + 2 * ps * d + 2 * g * ps + 2 * g);
  float* qf = buf.data();      // [G, D]
  float* acc = qf + g * d;     // [G, D]
  float* kf = acc + g * d;     // [ps, D]
  float* vf = kf + ps * d;     // [ps, D]
  float* s = vf + ps * d;      // [G, ps] logits
  float* pr = s + g * ps;      // [G, ps] probabilities (unnormalized)
  float* m = pr + g * ps;      // [G] running max
  float* l = m + g;            // [G] running sum

  const int64_t q_off = (row * p.h + head * g) * d;
  ToF32(p.q_dt, p.q + q_off * p.q_bytes, g * d, qf);
  std::fill(acc, acc + g * d, 0.0f);
  std::fill(m, m + g, -INFINITY);
  std::fill(l, l + g, 0.0f);

  const int64_t kv_len = std::clamp<int64_t>(p.kv_lens[row], 0, p.w * ps);
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, kv_len - p.window) : 0;
  const int64_t pool_base = (static_cast<int64_t>(p.layer) * p.kvh + head) * p.num_pages;
  for (int64_t j = first / ps; j * ps < kv_len; ++j) {
    const int64_t page = std::clamp<int64_t>(p.page_table[row * p.w + j], 0, p.num_pages - 1);
    const int64_t t0 = std::max(first, j * ps) - j * ps;
    const int64_t t1 = std::min(kv_len, j * ps + ps) - j * ps;
    const int64_t block = (pool_base + page) * ps;  // the page's first token
    if ((j + 1) * ps < kv_len) {  // the next page: pages are scattered, so no hardware prefetch
      const int64_t next = std::clamp<int64_t>(p.page_table[row * p.w + j + 1], 0, p.num_pages - 1);
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
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t gi = 0; gi < g; ++gi) {
        float x = Dot(qf + gi * d, kf + t * d, d) * p.scale;
        if (p.softcap > 0.0f) x = p.softcap * std::tanh(x / p.softcap);
        s[gi * ps + t] = x;
      }
    }
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
      float* ag = acc + gi * d;
      int64_t e = 0;
      for (; e + 16 <= d; e += 16) {
        F16v a = LoadV(ag + e) * alpha;
        for (int64_t t = t0; t < t1; ++t) a += pg[t] * LoadV(vf + t * d + e);
        StoreV(ag + e, a);
      }
      for (; e < d; ++e) {
        float a = ag[e] * alpha;
        for (int64_t t = t0; t < t1; ++t) a += pg[t] * vf[t * d + e];
        ag[e] = a;
      }
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    const float inv = l[gi] > 0.0f ? 1.0f / l[gi] : 0.0f;
    float* ag = acc + gi * d;
    for (int64_t e = 0; e < d; ++e) ag[e] = l[gi] > 0.0f ? ag[e] * inv : 0.0f;
  }
  FromF32(p.q_dt, acc, g * d, p.out + q_off * p.q_bytes);
}

struct Counter {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void Drain(const Problem& p, int64_t items, Counter& c) {
  std::vector<float> buf;
  for (int64_t i; (i = c.next.fetch_add(1, std::memory_order_relaxed)) < items;) {
    Item(p, i, buf);
    c.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                ffi::Result<ffi::AnyBuffer> out, float scale, float softcap) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument("expected q [B, H, D], pools [L, KVH, P, ps, D], "
                                       "page_table [B, W]");
  }
  Problem p;
  p.b = qd[0], p.h = qd[1], p.d = qd[2];
  p.num_layers = kd[0], p.kvh = kd[1], p.num_pages = kd[2], p.ps = kd[3], p.w = td[1];
  if (kd[4] != p.d || p.kvh <= 0 || p.h % p.kvh != 0 || td[0] != p.b ||
      v.dimensions().size() != 5 || v.element_type() != k.element_type()) {
    return ffi::Error::InvalidArgument("q, pools and page_table shapes or dtypes disagree");
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
  p.kv_lens = kv_lens.typed_data(), p.page_table = page_table.typed_data();
  p.scale = scale, p.softcap = softcap;
  p.out = static_cast<uint8_t*>(out->untyped_data());

  const int64_t items = p.b * p.kvh;
  auto counter = std::make_shared<Counter>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([p, items, counter] { Drain(p, items, *counter); });
  }
  Drain(p, items, *counter);
  while (counter->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
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
