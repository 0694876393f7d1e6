// One decode step's attention on CPU: one query per row against its cache, reading only the
// slots between each row's first and last live slot, split over XLA's intra-op thread pool.
// Built and loaded by rft_jax/models/cpu_attention.py, which documents what it computes
// and why; the arithmetic is that of rft_jax.models.feature_major.attend in float32.

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

typedef float f32x16 __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// exp(x) for x <= 0 (scores less their maximum), 16 at a time: Cody-Waite range reduction and
// the Cephes polynomial (relative error about 2e-7); below -87, exp(-87); NaN stays NaN.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 zero = {};
  x = x < -87.0f ? zero - 87.0f : x;
  const f32x16 magic = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504088896341f + magic) - magic;
  f32x16 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  f32x16 p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Shapes {
  int64_t b, k, g, h, s;
};

// out0[0:64] = sum_m w0[m] rows[m * stride : m * stride + 64] for m < count, and out1 with w1:
// eight registers of sums (eight independent chains of products), each 64-float row read once
// for both; the same rows of ``ahead`` are fetched into the L2 cache meanwhile (the next pair's:
// read from memory only when needed, the keys and values keep the core waiting;
// benchmarks/cpu_attention.py times a layer's call).
void two_weighted_sums_64(const float* rows, const float* ahead, int64_t stride, int64_t count,
                          const float* w0, const float* w1, float* out0, float* out1) {
  f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  for (int64_t m = 0; m < count; ++m, rows += stride, ahead += stride) {
    for (int c = 0; c < 64; c += 16) __builtin_prefetch(ahead + c, 0, 1);
    const f32x16 r0 = load16(rows), r1 = load16(rows + 16), r2 = load16(rows + 32),
                 r3 = load16(rows + 48);
    a0 += w0[m] * r0;
    a1 += w0[m] * r1;
    a2 += w0[m] * r2;
    a3 += w0[m] * r3;
    b0 += w1[m] * r0;
    b1 += w1[m] * r1;
    b2 += w1[m] * r2;
    b3 += w1[m] * r3;
  }
  store16(out0, a0);
  store16(out0 + 16, a1);
  store16(out0 + 32, a2);
  store16(out0 + 48, a3);
  store16(out1, b0);
  store16(out1 + 16, b1);
  store16(out1 + 32, b2);
  store16(out1 + 48, b3);
}

// scores[j, t] = sum_i q[j, i] keys[i, lo + t] for two queries j (into out0, out1), t < n:
// 64 slots at a time over all H rows of keys (``ahead``: the next pair's keys), then 16, then
// one by one.
void scores_two(const Shapes& d, const float* q0, const float* q1, const float* keys,
                const float* ahead, int64_t lo, int64_t n, float* out0, float* out1) {
  int64_t t = 0;
  for (; t + 64 <= n; t += 64)
    two_weighted_sums_64(keys + lo + t, ahead + lo + t, d.s, d.h, q0, q1, out0 + t, out1 + t);
  for (; t + 16 <= n; t += 16) {
    f32x16 a = {}, b = {};
    const float* column = keys + lo + t;
    const float* fetch = ahead + lo + t;
    for (int64_t i = 0; i < d.h; ++i, column += d.s, fetch += d.s) {
      __builtin_prefetch(fetch, 0, 1);
      const f32x16 k = load16(column);
      a += q0[i] * k;
      b += q1[i] * k;
    }
    store16(out0 + t, a);
    store16(out1 + t, b);
  }
  for (; t < n; ++t) {
    float a = 0.0f, b = 0.0f;
    for (int64_t i = 0; i < d.h; ++i) {
      a += q0[i] * keys[i * d.s + lo + t];
      b += q1[i] * keys[i * d.s + lo + t];
    }
    out0[t] = a;
    out1[t] = b;
  }
}

// The largest of 16 lanes, and their sum.
inline float lanes_max(f32x16 v) {
  float m = v[0];
  for (int l = 1; l < 16; ++l) m = std::max(m, v[l]);
  return m;
}

inline float lanes_sum(f32x16 v) {
  float s = 0.0f;
  for (int l = 0; l < 16; ++l) s += v[l];
  return s;
}

// p[t] <- softmax over the live t of p[t] * scale, 0 where not live; p and live padded to a
// multiple of 16 (padding not live).
void softmax_live(float* p, const float* live, int64_t padded, float scale) {
  constexpr float kNone = -3.0e38f;  // below any score: a slot that is not live
  f32x16 m = kNone - f32x16{};
  for (int64_t t = 0; t < padded; t += 16) {
    const f32x16 x = load16(p + t) * scale;
    const f32x16 x_live = load16(live + t) > 0.0f ? x : kNone - f32x16{};
    store16(p + t, x_live);
    m = m > x_live ? m : x_live;
  }
  const float top = lanes_max(m);
  f32x16 total = {};
  for (int64_t t = 0; t < padded; t += 16) {
    f32x16 e = exp_nonpositive(load16(p + t) - top);
    e = load16(live + t) > 0.0f ? e : f32x16{};
    store16(p + t, e);
    total += e;
  }
  const float inv = 1.0f / lanes_sum(total);
  for (int64_t t = 0; t < padded; t += 16) store16(p + t, load16(p + t) * inv);
}

// A row's live slots: the span [lo, lo + n) from its first live slot to its last (n = 0: none),
// and a flag per slot of the span (1 live, 0 not), padded with 0 to a multiple of 16.
struct LiveSpan {
  int64_t lo = 0, n = 0, padded = 0;
  std::vector<float> flags;

  void scan(const bool* live, int64_t s) {
    lo = 0;
    while (lo < s && !live[lo]) ++lo;
    int64_t hi = s - 1;
    while (hi >= lo && !live[hi]) --hi;
    n = hi - lo + 1;
    padded = (n + 15) / 16 * 16;
    flags.assign(padded, 0.0f);
    for (int64_t t = 0; t < n; ++t) flags[t] = live[lo + t] ? 1.0f : 0.0f;
  }
};

// Attention of the g queries of one (row, key head) pair: q [g, h], keys [h, s], values [s, h],
// over its row's live span; out [g, h]. next_keys, next_values: the pair after it, fetched
// meanwhile. scratch: the scores of every query.
void attend_pair(const Shapes& d, const float* q, const float* keys, const float* values,
                 const float* next_keys, const float* next_values, const LiveSpan& span,
                 float* out, std::vector<float>& scratch) {
  std::fill(out, out + d.g * d.h, 0.0f);
  if (span.n == 0) {  // no live slot (never in decoding): every slot alike, as attend gives
    for (int64_t t = 0; t < d.s; ++t)
      for (int64_t i = 0; i < d.h; ++i) out[i] += values[t * d.h + i] / static_cast<float>(d.s);
    for (int64_t j = 1; j < d.g; ++j) std::copy(out, out + d.h, out + j * d.h);
    return;
  }
  const int64_t lo = span.lo, n = span.n, padded = span.padded;
  scratch.assign(d.g * padded, 0.0f);
  for (int64_t j = 0; j < d.g; j += 2) {  // an odd last query is paired with itself
    const int64_t j1 = std::min(j + 1, d.g - 1);
    const float *q0 = q + j * d.h, *q1 = q + j1 * d.h;
    float *s0 = scratch.data() + j * padded, *s1 = scratch.data() + j1 * padded;
    scores_two(d, q0, q1, keys, next_keys, lo, n, s0, s1);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.h));
  for (int64_t j = 0; j < d.g; ++j)
    softmax_live(scratch.data() + j * padded, span.flags.data(), padded, scale);
  for (int64_t j = 0; j < d.g; j += 2) {
    const int64_t j1 = std::min(j + 1, d.g - 1);
    const float *p0 = scratch.data() + j * padded, *p1 = scratch.data() + j1 * padded;
    float *o0 = out + j * d.h, *o1 = out + j1 * d.h;
    int64_t i = 0;
    for (; i + 64 <= d.h; i += 64)  // out[j, i:i+64] = sum_t p[j, t] values[lo + t, i:i+64]
      two_weighted_sums_64(values + lo * d.h + i, next_values + lo * d.h + i, d.h, n, p0, p1,
                           o0 + i, o1 + i);
    for (; i < d.h; ++i) {
      float a = 0.0f, b = 0.0f;
      for (int64_t t = 0; t < n; ++t) {
        a += p0[t] * values[(lo + t) * d.h + i];
        b += p1[t] * values[(lo + t) * d.h + i];
      }
      o0[i] = a;
      o1[i] = b;
    }
  }
}

// The rows (K pairs each, one live span) are claimed one at a time from a shared counter by the
// calling thread and by num_threads - 1 tasks on the pool; the caller then waits only for rows
// already claimed, which run on threads that hold them, so a late or never-run task cannot block
// it.
struct Work {
  Shapes d;
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  std::atomic<int64_t> next{0}, finished{0};

  void run() {
    thread_local std::vector<float> scratch;
    thread_local LiveSpan span;
    const int64_t pairs = d.b * d.k, kv = d.h * d.s;
    for (int64_t row = next.fetch_add(1); row < d.b; row = next.fetch_add(1)) {
      span.scan(mask + row * d.s, d.s);
      for (int64_t p = row * d.k; p < (row + 1) * d.k; ++p) {
        const int64_t ahead = std::min(p + 1, pairs - 1);
        attend_pair(d, q + p * d.g * d.h, k + p * kv, v + p * kv, k + ahead * kv,
                    v + ahead * kv, span, out + p * d.g * d.h, scratch);
      }
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                               ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  auto md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 2)
    return ffi::Error::InvalidArgument("decode attention: ranks must be q 4, k 4, v 4, mask 2");
  Shapes d{qd[0], qd[1], qd[2], qd[3], kd[3]};
  if (kd[0] != d.b || kd[1] != d.k || kd[2] != d.h || vd[0] != d.b || vd[1] != d.k ||
      vd[2] != d.s || vd[3] != d.h || md[0] != d.b || md[1] != d.s)
    return ffi::Error::InvalidArgument(
        "decode attention: want q [B,K,G,H], k [B,K,H,S], v [B,K,S,H], mask [B,S]");
  auto work = std::make_shared<Work>();
  work->d = d;
  work->q = q.typed_data();
  work->k = k_cache.typed_data();
  work->v = v_cache.typed_data();
  work->mask = mask.typed_data();
  work->out = out->typed_data();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), d.b) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->finished.load(std::memory_order_acquire) < d.b) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RftDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
