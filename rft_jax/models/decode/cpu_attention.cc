// One decode step's attention on CPU: one query per row against its cache, reading only the
// slots between each row's first and last live slot (widened to multiples of 16), split over XLA's
// intra-op thread pool. Keys [B, K, H, S] or tiled, [B, K, S / T, H, T].
// Built and loaded by rft_jax/models/decode/cpu_attention.py, which documents what it computes
// and why; the arithmetic is that of rft_jax.models.decode.feature_major.attend in float32.

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

// One vector register's worth of floats: 16 lanes with AVX-512, 8 with AVX, 4 else (the build's
// target decides: x86-64-v3, 8 lanes, or x86-64-v2, 4). Wider generic vectors than the registers
// (16 lanes on an AVX2 machine) compile to spills and lane-by-lane inserts, and the kernel ran
// slower than XLA's attention (docs/results/cpu.md#register-wide-vectors). Each lane's sums run
// in the same order at any width, and softmax_live sums its normaliser by 16 lanes, so the
// results do not depend on the width (nor on FMA: the build passes -ffp-contract=off).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float fvec __attribute__((vector_size(4 * kLanes)));
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));
constexpr int kBlock = 4 * kLanes;  // four registers: the columns one pass accumulates

inline fvec load(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }

// exp(x) for x <= 0 (scores less their maximum), a register at a time: Cody-Waite range
// reduction and the Cephes polynomial (relative error about 2e-7); below -87, exp(-87); NaN
// stays NaN.
inline fvec exp_nonpositive(fvec x) {
  const fvec zero = {};
  x = x < -87.0f ? zero - 87.0f : x;
  const fvec magic = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const fvec n = (x * 1.44269504088896341f + magic) - magic;
  fvec r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  fvec p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The key layouts: [B, K, H, S] (tile 0: a key row of S slots per feature) or tiled,
// [B, K, S / T, H, T] (tile T: T slots of every feature contiguous, one tile after another).
struct Shapes {
  int64_t b, k, g, h, s, tile;

  // Keys of slot `slot` (the first of a run not crossing a tile) and the stride between features.
  const float* key_block(const float* keys, int64_t slot) const {
    if (tile == 0) return keys + slot;
    return keys + (slot / tile) * h * tile + slot % tile;
  }
  int64_t key_stride() const { return tile == 0 ? s : tile; }
};

// A live span starts and ends at a multiple of 16 slots, in both layouts (tiles are multiples
// of 16), so that a register's slots never cross a tile and the softmax normaliser adds the same
// slots in the same lanes in both.
constexpr int64_t kSpanAlign = 16;

// out0[0:kBlock] = sum_m w0[m] rows[m * stride : m * stride + kBlock] for m < count, and out1
// with w1: four registers of sums per output (eight independent chains of products), each row's
// kBlock floats read once for both. Each row's next kBlock floats are prefetched: for the scores
// (scores_two) the rows are the H key rows, a cache length apart, read a block of slots at a
// time: H streams, more than the hardware prefetcher follows. Fetching them a block ahead made a
// layer's attention faster; two or four blocks ahead gained less, and fetching the value rows
// eight slots ahead lost. (Fetching the next (row, key head) pair's rows meanwhile, as the 16-lane
// kernel did, made it no faster once the loop stopped spilling.) Tiled keys make the H rows of a
// block one stretch of memory instead, which the hardware prefetcher follows: faster again.
// Figures: docs/results/cpu.md#prefetching-the-key-rows-a-block-ahead and #tiled-keys.
void two_weighted_sums(const float* rows, int64_t stride, int64_t count, const float* w0,
                       const float* w1, float* out0, float* out1) {
  fvec a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  for (int64_t m = 0; m < count; ++m, rows += stride) {
    __builtin_prefetch(rows + kBlock);  // the next block's first two lines (at 8 lanes: all)
    __builtin_prefetch(rows + kBlock + 16);
    const fvec r0 = load(rows), r1 = load(rows + kLanes), r2 = load(rows + 2 * kLanes),
               r3 = load(rows + 3 * kLanes);
    const float x = w0[m], y = w1[m];
    a0 += x * r0;
    a1 += x * r1;
    a2 += x * r2;
    a3 += x * r3;
    b0 += y * r0;
    b1 += y * r1;
    b2 += y * r2;
    b3 += y * r3;
  }
  store(out0, a0);
  store(out0 + kLanes, a1);
  store(out0 + 2 * kLanes, a2);
  store(out0 + 3 * kLanes, a3);
  store(out1, b0);
  store(out1 + kLanes, b1);
  store(out1 + 2 * kLanes, b2);
  store(out1 + 3 * kLanes, b3);
}

// two_weighted_sums over one register's columns.
void two_weighted_sums_1(const float* rows, int64_t stride, int64_t count, const float* w0,
                         const float* w1, float* out0, float* out1) {
  fvec a = {}, b = {};
  for (int64_t m = 0; m < count; ++m, rows += stride) {
    const fvec r = load(rows);
    a += w0[m] * r;
    b += w1[m] * r;
  }
  store(out0, a);
  store(out1, b);
}

// scores[j, t] = sum_i q[j, i] keys[i, lo + t] for two queries j (into out0, out1), t < n
// (lo a multiple of kSpanAlign): kBlock slots at a time over all H features of keys where they
// lie in one tile, else one register's worth, then (only where S is not a multiple of 16) one
// slot at a time. Each slot's sum runs over the features in order whichever pass takes it.
void scores_two(const Shapes& d, const float* q0, const float* q1, const float* keys,
                int64_t lo, int64_t n, float* out0, float* out1) {
  const int64_t stride = d.key_stride();
  int64_t t = 0;
  while (t + kLanes <= n) {
    const int64_t slot = lo + t;
    if (t + kBlock <= n && (d.tile == 0 || slot % d.tile + kBlock <= d.tile)) {
      two_weighted_sums(d.key_block(keys, slot), stride, d.h, q0, q1, out0 + t, out1 + t);
      t += kBlock;
    } else {
      two_weighted_sums_1(d.key_block(keys, slot), stride, d.h, q0, q1, out0 + t, out1 + t);
      t += kLanes;
    }
  }
  for (; t < n; ++t) {
    const float* k = d.key_block(keys, lo + t);
    float a = 0.0f, b = 0.0f;
    for (int64_t i = 0; i < d.h; ++i) {
      a += q0[i] * k[i * stride];
      b += q1[i] * k[i * stride];
    }
    out0[t] = a;
    out1[t] = b;
  }
}

// The largest of a register's lanes.
inline float lanes_max(fvec v) {
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, v[l]);
  return m;
}

// p[t] <- softmax over the live t of p[t] * scale, 0 where not live; p and live padded to a
// multiple of 16 (padding not live). The normaliser sums 16 lanes (one per slot modulo 16), then
// the lanes in order, whatever the register width, so it does not depend on the build's CPU.
void softmax_live(float* p, const float* live, int64_t padded, float scale) {
  constexpr float kNone = -3.0e38f;  // below any score: a slot that is not live
  constexpr int kRegs = 16 / kLanes;  // registers per 16 slots
  const fvec none = kNone - fvec{};
  fvec m = none;
  for (int64_t t = 0; t < padded; t += kLanes) {
    const fvec x = load(p + t) * scale;
    const fvec x_live = load(live + t) > 0.0f ? x : none;
    store(p + t, x_live);
    m = m > x_live ? m : x_live;
  }
  const float top = lanes_max(m);
  fvec total[kRegs] = {};
  for (int64_t t = 0; t < padded; t += 16) {
    for (int r = 0; r < kRegs; ++r) {
      fvec e = exp_nonpositive(load(p + t + r * kLanes) - top);
      e = load(live + t + r * kLanes) > 0.0f ? e : fvec{};
      store(p + t + r * kLanes, e);
      total[r] += e;
    }
  }
  float sum = 0.0f;
  for (int r = 0; r < kRegs; ++r)
    for (int l = 0; l < kLanes; ++l) sum += total[r][l];
  const float inv = 1.0f / sum;
  for (int64_t t = 0; t < padded; t += kLanes) store(p + t, load(p + t) * inv);
}

// A row's live slots: the span [lo, lo + n) from its first live slot rounded down to a multiple
// of kSpanAlign to its last rounded up to one, or to S (n = 0: none), and a flag per slot of the
// span (1 live, 0 not), padded with 0 to a multiple of 16.
struct LiveSpan {
  int64_t lo = 0, n = 0, padded = 0;
  std::vector<float> flags;

  void scan(const bool* live, int64_t s) {
    int64_t first = 0;
    while (first < s && !live[first]) ++first;
    int64_t hi = s - 1;
    while (hi >= first && !live[hi]) --hi;
    if (hi < first) {
      lo = n = padded = 0;
      return;
    }
    lo = first / kSpanAlign * kSpanAlign;
    n = std::min((hi + kSpanAlign) / kSpanAlign * kSpanAlign, s) - lo;
    padded = (n + 15) / 16 * 16;
    flags.assign(padded, 0.0f);
    for (int64_t t = first - lo; t <= hi - lo; ++t) flags[t] = live[lo + t] ? 1.0f : 0.0f;
  }
};

// Attention of the g queries of one (row, key head) pair: q [g, h], keys [h, s], values [s, h],
// over its row's live span; out [g, h]. scratch: the scores of every query.
void attend_pair(const Shapes& d, const float* q, const float* keys, const float* values,
                 const LiveSpan& span, float* out, std::vector<float>& scratch) {
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
    scores_two(d, q0, q1, keys, lo, n, s0, s1);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.h));
  for (int64_t j = 0; j < d.g; ++j)
    softmax_live(scratch.data() + j * padded, span.flags.data(), padded, scale);
  for (int64_t j = 0; j < d.g; j += 2) {
    const int64_t j1 = std::min(j + 1, d.g - 1);
    const float *p0 = scratch.data() + j * padded, *p1 = scratch.data() + j1 * padded;
    float *o0 = out + j * d.h, *o1 = out + j1 * d.h;
    const float* rows = values + lo * d.h;  // out[j, i] = sum_t p[j, t] values[lo + t, i]
    int64_t i = 0;
    for (; i + kBlock <= d.h; i += kBlock)
      two_weighted_sums(rows + i, d.h, n, p0, p1, o0 + i, o1 + i);
    for (; i + kLanes <= d.h; i += kLanes)
      two_weighted_sums_1(rows + i, d.h, n, p0, p1, o0 + i, o1 + i);
    for (; i < d.h; ++i) {
      float a = 0.0f, b = 0.0f;
      for (int64_t t = 0; t < n; ++t) {
        a += p0[t] * rows[t * d.h + i];
        b += p1[t] * rows[t * d.h + i];
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
    const int64_t kv = d.h * d.s;
    for (int64_t row = next.fetch_add(1); row < d.b; row = next.fetch_add(1)) {
      span.scan(mask + row * d.s, d.s);
      for (int64_t p = row * d.k; p < (row + 1) * d.k; ++p)
        attend_pair(d, q + p * d.g * d.h, k + p * kv, v + p * kv, span, out + p * d.g * d.h,
                    scratch);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                               ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  auto md = mask.dimensions();
  if (qd.size() != 4 || (kd.size() != 4 && kd.size() != 5) || vd.size() != 4 || md.size() != 2)
    return ffi::Error::InvalidArgument(
        "decode attention: ranks must be q 4, k 4 or 5, v 4, mask 2");
  const bool tiled = kd.size() == 5;
  Shapes d{qd[0], qd[1], qd[2], qd[3], vd[2], tiled ? kd[4] : 0};
  const bool keys_fit = tiled ? (kd[3] == d.h && kd[2] * d.tile == d.s && d.tile > 0 &&
                                 d.tile % kSpanAlign == 0)
                              : (kd[2] == d.h && kd[3] == d.s);
  if (kd[0] != d.b || kd[1] != d.k || !keys_fit || vd[0] != d.b || vd[1] != d.k ||
      vd[3] != d.h || md[0] != d.b || md[1] != d.s)
    return ffi::Error::InvalidArgument(
        "decode attention: want q [B,K,G,H], k [B,K,H,S] or [B,K,S/T,H,T] (T a multiple of 16), "
        "v [B,K,S,H], mask [B,S]");
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
