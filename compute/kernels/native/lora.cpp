// pdserve::lora_add -- every adapter of a step in one call per fused linear (a segmented shrink/expand, as
// Punica's SGMV): y[rows of g] += (x[rows of g] @ A_g^T) @ B_g^T for each group g of rows sharing an adapter.
//
// Arguments (compute/modeling/lora.py builds them):
//   y [T, N]  fp32 or bf16, written in place (the base linear's output; row stride taken, columns contiguous)
//   x [T, K]  fp32 or bf16 (same row layout)
//   groups    flat [row_start, row_stop, a_index, part_start, part_stop] per group (rows of one adapter)
//   a         per group's adapter: A [R, K] contiguous, fp32 or bf16 (every pair of a call one dtype) (the fused linear's targets' A stacked)
//   parts     flat [col_start, h_start, b_index] per target: B^T [r, n] adds h[:, h_start:h_start+r] @ B^T into
//             y[:, col_start:col_start+n]
//   b         B^T [r, n] contiguous, the pairs' dtype (scaling folded in); bf16 pairs widened in registers
//
// Work: tasks of (group, block of up to MB = 4 rows), dealt to the threads by cost (longest first); a task reads its adapter's pairs once for its rows: h as
// dot products over K (a row of A in vectors), the update in register tiles of B^T's columns (lora_body.inc). Each row's sums run the same loops
// in the same order whatever the other rows, the block or the thread: a row's update is bitwise the same alone
// and in any batch (tests/compute/kernels/test_native_lora.py checks it). The update is summed in fp32 and added
// to y once (bf16 y: rounded once), as ``y.add_(h @ B^T)`` does.
//
// ISA: the same body compiled three times (SSE2, AVX2 + FMA, AVX-512F) with GCC vector types; chosen by the
// level ``pdserve::int8_isa`` set (torch's dispatch level).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdserve_native {
int current_isa();  // int8_linear.cpp
}

namespace {

constexpr int64_t kMB = 4;  // rows per task: a pair's row is loaded once for all of them

// a pair's element as fp32: fp32 itself, or bf16 (its 16 bits shifted up: exact)
inline float wide(float v) { return v; }
inline float wide(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

struct Group {
  int64_t r0, r1, a, p0, p1;
};

struct Part {
  int64_t col, h, b;
};

// The body once per ISA (lora_body.inc): GCC vector types of 4 (SSE2, any x86-64), 8 (AVX2 + FMA) and 16
// (AVX-512F) lanes.
namespace sse {
#define VL 4
#include "lora_body.inc"
#undef VL
}  // namespace sse

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#define VL 8
#include "lora_body.inc"
#undef VL
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
#define VL 16
#include "lora_body.inc"
#undef VL
}  // namespace avx512
#pragma GCC pop_options

template <typename T, typename W>
void run(at::Tensor& y, const at::Tensor& x, const std::vector<Group>& groups, const std::vector<Part>& parts,
         const std::vector<const void*>& as_, const std::vector<int64_t>& a_rank, const std::vector<const void*>& bs_,
         const std::vector<int64_t>& b_rank, const std::vector<int64_t>& b_width) {
  const int64_t K = x.size(1), ldx = x.stride(0), ldy = y.stride(0);
  std::vector<const W*> as, bs;
  for (const void* p : as_) as.push_back(static_cast<const W*>(p));
  for (const void* p : bs_) bs.push_back(static_cast<const W*>(p));
  T* yp = y.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  int64_t n_max = 1, r_max = 1;
  for (int64_t w : b_width) n_max = std::max(n_max, w);
  for (int64_t r : a_rank) r_max = std::max(r_max, r);
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, first row)
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t r = groups[g].r0; r < groups[g].r1; r += kMB) tasks.emplace_back(static_cast<int64_t>(g), r);
  // threads get equal work, not equal task counts: a rank-64 adapter's task costs 8 of a rank-8 one's (and the
  // runner orders groups by adapter, not by cost): longest first, each to the least loaded thread
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<std::pair<double, int64_t>> by_cost;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const Group& g = groups[tasks[t].first];
    double cost = static_cast<double>(a_rank[g.a]) * K;
    for (int64_t p = g.p0; p < g.p1; ++p) cost += static_cast<double>(b_rank[parts[p].b]) * b_width[parts[p].b];
    by_cost.emplace_back(-cost * std::min(kMB, g.r1 - tasks[t].second), static_cast<int64_t>(t));
  }
  std::sort(by_cost.begin(), by_cost.end());
  std::vector<double> load(nt, 0.0);
  std::vector<std::vector<int64_t>> mine(nt);
  for (const auto& [neg, t] : by_cost) {
    const int64_t i = std::min_element(load.begin(), load.end()) - load.begin();
    load[i] -= neg;
    mine[i].push_back(t);
  }
  const int isa = pdserve_native::current_isa();
  at::parallel_for(0, nt, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> xs(kMB * K), h(kMB * r_max), acc(kMB * n_max);
    std::vector<const W*> pb;
    std::vector<int64_t> pr, pw, ph, pc;
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t t : mine[i]) {
      const Group& g = groups[tasks[t].first];
      const int64_t r0 = tasks[t].second, m = std::min(kMB, g.r1 - r0), R = a_rank[g.a];
      for (int64_t r = 0; r < m; ++r)
        for (int64_t k = 0; k < K; ++k) xs[r * K + k] = static_cast<float>(xp[(r0 + r) * ldx + k]);
      pb.clear(), pr.clear(), pw.clear(), ph.clear(), pc.clear();
      for (int64_t p = g.p0; p < g.p1; ++p) {
        pb.push_back(bs[parts[p].b]), pr.push_back(b_rank[parts[p].b]), pw.push_back(b_width[parts[p].b]);
        ph.push_back(parts[p].h), pc.push_back(parts[p].col);
      }
      auto out = [&](int64_t r, int64_t col, const float* v, int64_t n) {
        T* yr = yp + (r0 + r) * ldy + col;
        for (int64_t c = 0; c < n; ++c) yr[c] = static_cast<T>(static_cast<float>(yr[c]) + v[c]);
      };
      const int64_t np = g.p1 - g.p0;
      auto body = isa == 2 ? avx512::rows_any<W, decltype(out)>
                  : isa == 1 ? avx2::rows_any<W, decltype(out)> : sse::rows_any<W, decltype(out)>;
      body(m, xs.data(), K, as[g.a], R, h.data(), acc.data(), np, pb.data(), pr.data(), pw.data(), ph.data(),
           pc.data(), out);
      }
    }
  });
}

void lora_add(at::Tensor y, const at::Tensor& x, at::IntArrayRef groups_flat, at::TensorList a,
              at::IntArrayRef parts_flat, at::TensorList b) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "lora_add: y [T, N] and x [T, K], got ",
              y.sizes(), " and ", x.sizes());
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "lora_add: rows of y and x must be contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "lora_add: x and y both fp32 or both bf16");
  TORCH_CHECK(groups_flat.size() % 5 == 0 && parts_flat.size() % 3 == 0, "lora_add: groups by 5, parts by 3");
  const int64_t T = y.size(0), N = y.size(1), K = x.size(1);
  std::vector<const void*> as, bs;
  std::vector<int64_t> a_rank, b_rank, b_width;
  const at::ScalarType w = a.empty() ? at::kFloat : a[0].scalar_type();
  TORCH_CHECK(w == at::kFloat || w == at::kBFloat16, "lora_add: pairs fp32 or bf16");
  for (const at::Tensor& t : a) {
    TORCH_CHECK(t.scalar_type() == w && t.is_contiguous() && t.dim() == 2 && t.size(1) == K,
                "lora_add: A must be contiguous [R, K] of the pairs' one dtype, got ", t.sizes());
    as.push_back(t.data_ptr()), a_rank.push_back(t.size(0));
  }
  for (const at::Tensor& t : b) {
    TORCH_CHECK(t.scalar_type() == w && t.is_contiguous() && t.dim() == 2,
                "lora_add: B^T must be contiguous [r, n] of the pairs' one dtype");
    bs.push_back(t.data_ptr()), b_rank.push_back(t.size(0)), b_width.push_back(t.size(1));
  }
  std::vector<Part> parts;
  for (size_t i = 0; i < parts_flat.size(); i += 3) {
    Part p{parts_flat[i], parts_flat[i + 1], parts_flat[i + 2]};
    TORCH_CHECK(p.b >= 0 && p.b < static_cast<int64_t>(bs.size()) && p.col >= 0 && p.col + b_width[p.b] <= N,
                "lora_add: a part's columns fall outside y");
    parts.push_back(p);
  }
  std::vector<Group> groups;
  for (size_t i = 0; i < groups_flat.size(); i += 5) {
    Group g{groups_flat[i], groups_flat[i + 1], groups_flat[i + 2], groups_flat[i + 3], groups_flat[i + 4]};
    TORCH_CHECK(0 <= g.r0 && g.r0 <= g.r1 && g.r1 <= T, "lora_add: a group's rows fall outside y");
    TORCH_CHECK(g.a >= 0 && g.a < static_cast<int64_t>(as.size()), "lora_add: a group names no A");
    TORCH_CHECK(0 <= g.p0 && g.p0 <= g.p1 && g.p1 <= static_cast<int64_t>(parts.size()),
                "lora_add: a group's parts fall outside the list");
    for (int64_t p = g.p0; p < g.p1; ++p)
      TORCH_CHECK(parts[p].h >= 0 && parts[p].h + b_rank[parts[p].b] <= a_rank[g.a],
                  "lora_add: a part's rank falls outside its A");
    groups.push_back(g);
  }
  if (groups.empty() || T == 0) return;
  const bool f32 = y.scalar_type() == at::kFloat;
  if (w == at::kFloat) {
    if (f32) run<float, float>(y, x, groups, parts, as, a_rank, bs, b_rank, b_width);
    else run<c10::BFloat16, float>(y, x, groups, parts, as, a_rank, bs, b_rank, b_width);
  } else {
    if (f32) run<float, uint16_t>(y, x, groups, parts, as, a_rank, bs, b_rank, b_width);
    else run<c10::BFloat16, uint16_t>(y, x, groups, parts, as, a_rank, bs, b_rank, b_width);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, int[] groups, Tensor[] a, int[] parts, Tensor[] b) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("lora_add", &lora_add); }
