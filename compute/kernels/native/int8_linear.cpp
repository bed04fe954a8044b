// pdserve::int8_linear -- y[M, N] = x[M, K] (fp32) @ (q[N, K] int8 * scale[N])^T, fp32 accumulation.
//
// Weight-only int8 at small M (decode): every weight byte is read once per call and widened to fp32 in
// registers (cvtepi8 -> cvtepi32_ps -> fma), so the call runs at the memory bandwidth instead of at
// ATen's per-tile int8 -> fp32 conversion (``_weight_int8pack_mm`` on AVX2: 15-25% of it).
//
// Layout of the work: output rows in blocks of NB (a task of at::parallel_for), activation rows in
// blocks of MB; a tile holds NB x MB vector accumulators over K. Each (m, n) sum runs the same K loop
// in the same order whatever M, the tile or the thread: a row's output is bitwise the same alone and
// in any batch (row-invariant by construction; tests/compute/kernels/test_native.py checks it).
//
// ISA: one body per level (avx512f | avx2+fma | scalar), chosen at runtime by ``pdserve::int8_isa`` (the
// caller passes torch's dispatch level, so ATEN_CPU_CAPABILITY lowers both alike). No -march flag: the
// library loads on any x86-64 CPU, the wide bodies are compiled with target attributes.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

std::atomic<int> g_isa{0};  // 0 scalar, 1 avx2+fma, 2 avx512f

int supported_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

// ---- scalar (also the K tail of the vector bodies: added after the vector sum, in order) ----
inline float dot_tail(const float* x, const int8_t* w, int64_t k0, int64_t k) {
  float s = 0.f;
  for (int64_t i = k0; i < k; ++i) s += x[i] * static_cast<float>(w[i]);
  return s;
}

void rows_scalar(const float* x, const int8_t* q, const float* scale, float* y, int64_t m, int64_t n0,
                 int64_t n1, int64_t k, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < m; ++r) y[r * ldy + n] = dot_tail(x + r * k, q + n * k, 0, k) * scale[n];
}

// A body for MB activation rows; ``rows_by_four`` runs the rows four at a time, then the 1-3 left
using RowsBody = void (*)(const float*, const int8_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

void rows_by_four(const RowsBody* bodies, const float* x, const int8_t* q, const float* scale, float* y, int64_t m,
                  int64_t n0, int64_t n1, int64_t k, int64_t ldy) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) bodies[4](x + r * k, q, scale, y + r * ldy, n0, n1, k, ldy);
  if (m > r) bodies[m - r](x + r * k, q, scale, y + r * ldy, n0, n1, k, ldy);
}

// ---- AVX2 + FMA: 8 lanes; tile NB = 2 output rows x MB = 4 activation rows (8 accumulators) ----
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

__attribute__((target("avx2,fma"))) inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int MB>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, const int8_t* q, const float* scale, float* y,
                                                    int64_t n, int64_t k, int64_t ldy) {
  // rows n, n + 1 of q; MB rows of x
  constexpr int NB = 2;
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < MB; ++r) acc[j][r] = _mm256_setzero_ps();
  const int64_t kv = k & ~int64_t(7);
  for (int64_t i = 0; i < kv; i += 8) {
    __m256 w0 = widen8(q + n * k + i), w1 = widen8(q + (n + 1) * k + i);
    for (int r = 0; r < MB; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * k + i);
      acc[0][r] = _mm256_fmadd_ps(xv, w0, acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(xv, w1, acc[1][r]);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < MB; ++r)
      y[r * ldy + n + j] = (hsum8(acc[j][r]) + dot_tail(x + r * k, q + (n + j) * k, kv, k)) * scale[n + j];
}

template <int MB>
__attribute__((target("avx2,fma"))) void tile1_avx2(const float* x, const int8_t* q, const float* scale, float* y,
                                                     int64_t n, int64_t k, int64_t ldy) {
  // one row n (the odd last row of a block): the same per-(m, n) sum as in tile_avx2
  __m256 acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t kv = k & ~int64_t(7);
  for (int64_t i = 0; i < kv; i += 8) {
    __m256 w0 = widen8(q + n * k + i);
    for (int r = 0; r < MB; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), w0, acc[r]);
  }
  for (int r = 0; r < MB; ++r) y[r * ldy + n] = (hsum8(acc[r]) + dot_tail(x + r * k, q + n * k, kv, k)) * scale[n];
}

template <int MB>
__attribute__((target("avx2,fma"))) void rows_avx2_mb(const float* x, const int8_t* q, const float* scale, float* y,
                                                       int64_t n0, int64_t n1, int64_t k, int64_t ldy) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) tile_avx2<MB>(x, q, scale, y, n, k, ldy);
  if (n < n1) tile1_avx2<MB>(x, q, scale, y, n, k, ldy);
}

void rows_avx2(const float* x, const int8_t* q, const float* scale, float* y, int64_t m, int64_t n0, int64_t n1,
               int64_t k, int64_t ldy) {
  static constexpr RowsBody kBodies[5] = {nullptr, rows_avx2_mb<1>, rows_avx2_mb<2>, rows_avx2_mb<3>,
                                          rows_avx2_mb<4>};
  rows_by_four(kBodies, x, q, scale, y, m, n0, n1, k, ldy);
}

// ---- AVX-512F: 16 lanes; tile NB = 4 output rows x MB = 4 activation rows (16 accumulators) ----
__attribute__((target("avx512f,avx512bw"))) inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int NB, int MB>
__attribute__((target("avx512f,avx512bw"))) void tile_avx512(const float* x, const int8_t* q, const float* scale,
                                                              float* y, int64_t n, int64_t k, int64_t ldy) {
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < MB; ++r) acc[j][r] = _mm512_setzero_ps();
  const int64_t kv = k & ~int64_t(15);
  for (int64_t i = 0; i < kv; i += 16) {
    __m512 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = widen16(q + (n + j) * k + i);
    for (int r = 0; r < MB; ++r) {
      __m512 xv = _mm512_loadu_ps(x + r * k + i);
      for (int j = 0; j < NB; ++j) acc[j][r] = _mm512_fmadd_ps(xv, w[j], acc[j][r]);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < MB; ++r)
      y[r * ldy + n + j] =
          (_mm512_reduce_add_ps(acc[j][r]) + dot_tail(x + r * k, q + (n + j) * k, kv, k)) * scale[n + j];
}

template <int MB>
__attribute__((target("avx512f,avx512bw"))) void rows_avx512_mb(const float* x, const int8_t* q, const float* scale,
                                                                  float* y, int64_t n0, int64_t n1, int64_t k,
                                                                  int64_t ldy) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile_avx512<4, MB>(x, q, scale, y, n, k, ldy);
  for (; n < n1; ++n) tile_avx512<1, MB>(x, q, scale, y, n, k, ldy);
}

void rows_avx512(const float* x, const int8_t* q, const float* scale, float* y, int64_t m, int64_t n0, int64_t n1,
                 int64_t k, int64_t ldy) {
  static constexpr RowsBody kBodies[5] = {nullptr, rows_avx512_mb<1>, rows_avx512_mb<2>, rows_avx512_mb<3>,
                                          rows_avx512_mb<4>};
  rows_by_four(kBodies, x, q, scale, y, m, n0, n1, k, ldy);
}

constexpr int64_t kRowBlock = 16;  // output rows per parallel task (a multiple of every tile's NB)
constexpr int64_t kMBlock = 16;    // activation rows per call of a body

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale_in) {
  TORCH_CHECK(x_in.dim() == 2 && q.dim() == 2, "int8_linear: x [M, K] and q [N, K], got ", x_in.sizes(), " and ",
              q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "int8_linear: q must be contiguous int8");
  TORCH_CHECK(x_in.size(1) == q.size(1), "int8_linear: K differs: x ", x_in.sizes(), " q ", q.sizes());
  TORCH_CHECK(scale_in.numel() == q.size(0), "int8_linear: one scale per output row");
  TORCH_CHECK(x_in.device().is_cpu() && q.device().is_cpu(), "int8_linear: CPU tensors only");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor scale = scale_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int isa = g_isa.load(std::memory_order_relaxed);
  auto rows = isa == 2 ? rows_avx512 : isa == 1 ? rows_avx2 : rows_scalar;
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  // grain: at least ~64 KiB of weights per task, so a small linear is not split into wake-ups
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, kRowBlock * k));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kRowBlock, n1 = std::min(n, b1 * kRowBlock);
    for (int64_t nb = n0; nb < n1; nb += kRowBlock)  // a block of weights stays in cache over every row of x
      for (int64_t r = 0; r < m; r += kMBlock)
        rows(xp + r * k, qp, sp, yp + r * n, std::min(kMBlock, m - r), nb, std::min(n1, nb + kRowBlock), k, n);
  });
  return y;
}

int64_t int8_isa(int64_t wanted) {
  // -> the level in use: min(wanted, what this CPU supports); wanted < 0 asks without changing it
  if (wanted >= 0) g_isa.store(static_cast<int>(std::min<int64_t>(wanted, supported_isa())));
  return g_isa.load();
}

}  // namespace

namespace pdserve_native {
int current_isa() { return g_isa.load(std::memory_order_relaxed); }  // lora.cpp's bodies follow the same level
}  // namespace pdserve_native

TORCH_LIBRARY(pdserve, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int8_isa(int wanted) -> int");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("int8_linear", &int8_linear); }

TORCH_LIBRARY_IMPL(pdserve, CompositeExplicitAutograd, m) { m.impl("int8_isa", &int8_isa); }
