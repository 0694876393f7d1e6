// A decode step's weight products at a few rows on CPU: out [O, B] = W [O, I] x h [I, B] for
// B of 1 to 16, reading each weight once, split over XLA's intra-op thread pool. Built with the
// attention kernel into one library and loaded by rft_jax/models/cpu_matmul.py, which documents
// what it computes and why.
//
// W comes packed in panels of 8 rows, [O / 8, I, 8] (panel p, column i holds W[8p : 8p + 8, i]),
// so that a panel is one contiguous stream. Each output is one chain of fused multiply-adds over
// i = 0, 1, ..., I - 1 from zero, whatever B, the chunking of B and the threads: the same bits at
// any batch size, on any CPU with FMA. Only built where the target has AVX2 and FMA
// (x86-64-v3); elsewhere the library has no such handler and the products stay XLA's.

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 8;         // rows of W per panel: one 8-lane register
constexpr int kMaxColumns = 12;   // accumulators per pass (12 of the 16 registers)
constexpr int64_t kPanelsPerTask = 8;
constexpr int64_t kAhead = 32;  // columns of a panel fetched ahead (1 KiB)

// out[r * ldo + b] = sum_i panel[i * 8 + r] h[i * ldh + b] for r < 8, b < NB: NB accumulators,
// one register each, a pass over the panel's I columns.
template <int NB>
void panel_columns(const float* panel, const float* h, int64_t ldh, int64_t in, float* out,
                   int64_t ldo) {
  __m256 acc[NB];
#pragma GCC unroll 12
  for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (i + kAhead) * kPanel), _MM_HINT_T0);
    const __m256 w = _mm256_loadu_ps(panel + i * kPanel);
    const float* hi = h + i * ldh;
#pragma GCC unroll 12
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(hi + b), acc[b]);
  }
  alignas(32) float lanes[NB][kPanel];
#pragma GCC unroll 12
  for (int b = 0; b < NB; ++b) _mm256_store_ps(lanes[b], acc[b]);
  for (int r = 0; r < kPanel; ++r)
    for (int b = 0; b < NB; ++b) out[r * ldo + b] = lanes[b][r];
}

using PanelColumns = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t);

constexpr PanelColumns kPasses[kMaxColumns] = {
    panel_columns<1>, panel_columns<2>, panel_columns<3>,  panel_columns<4>,
    panel_columns<5>, panel_columns<6>, panel_columns<7>,  panel_columns<8>,
    panel_columns<9>, panel_columns<10>, panel_columns<11>, panel_columns<12>};

// The panels are claimed kPanelsPerTask at a time from a shared counter by the calling thread
// and by the pool's tasks; the caller waits only for panels already claimed (as the attention
// kernel's rows).
struct Work {
  const float *w, *h;
  float* out;
  int64_t panels, in, columns;
  std::atomic<int64_t> next{0}, finished{0};

  void run() {
    const int64_t passes = (columns + kMaxColumns - 1) / kMaxColumns;
    const int64_t width = (columns + passes - 1) / passes;  // columns per pass, at most 12
    for (int64_t p0 = next.fetch_add(kPanelsPerTask); p0 < panels;
         p0 = next.fetch_add(kPanelsPerTask)) {
      const int64_t p1 = std::min(panels, p0 + kPanelsPerTask);
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t b = 0; b < columns; b += width) {
          const int64_t nb = std::min(width, columns - b);
          kPasses[nb - 1](w + p * in * kPanel, h + b, columns, in,
                          out + p * kPanel * columns + b, columns);
        }
      finished.fetch_add(p1 - p0, std::memory_order_release);
    }
  }
};

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> h,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto wd = w.dimensions(), hd = h.dimensions(), od = out->dimensions();
  if (wd.size() != 3 || hd.size() != 2 || od.size() != 2 || wd[2] != kPanel || hd[0] != wd[1] ||
      od[0] != wd[0] * kPanel || od[1] != hd[1])
    return ffi::Error::InvalidArgument(
        "panel matmul: want w [O / 8, I, 8], h [I, B], out [O, B]");
  auto work = std::make_shared<Work>();
  work->w = w.typed_data();
  work->h = h.typed_data();
  work->out = out->typed_data();
  work->panels = wd[0];
  work->in = wd[1];
  work->columns = hd[1];
  const int64_t tasks = (work->panels + kPanelsPerTask - 1) / kPanelsPerTask;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->finished.load(std::memory_order_acquire) < work->panels) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RftPanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#endif  // __AVX2__ && __FMA__
