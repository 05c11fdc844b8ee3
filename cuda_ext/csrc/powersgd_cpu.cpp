// PowerSGD's two passes over a matrix on the CPU, each fused into one sweep of its rows
// (bagua_algos/compression/powersgd.py calls them where this module is loaded):
//
//   form_a_and_p_(e, g, qt, p, decay):   A = G + decay * E, written into E,  P = A Q
//   apply_update_(e, g, p, qt):          U = P Q^T,  G <- U,  E <- E - U
//
// E and G are n x m, P is n x r, Q is given transposed (qt: r x m, contiguous), r >= 1.
// In torch each line is one or two passes over n x m values from memory (A formed,
// then read again by the product; U written to G, then E read and written again). Here
// a row of A (or U) is made and used while it is in the L1 cache, so the gradients'
// size crosses the memory bus as often as the formula needs: forming reads G and E and
// writes E; the update reads E and writes E and G. The step is memory-bound on one
// thread (issue 27 in docs/benchmarks.md), so fewer passes are the speed-up.
//
// A sum over k runs in 8 (float) or 4 (double) vector lanes, the lanes added at the end
// of the row; a sum over the columns j runs in order. So results match torch's products
// up to rounding, not bit for bit. Rows are spread over ATen's threads.
//
// Measured (one thread, ResNet-18's 21 matrices, docs/benchmarks.md issue 27): forming
// is faster than torch's add + product at r <= 2 only (at r = 8 its r dot products per
// row cost more than MKL's), so powersgd.py takes it there; the update is faster at every
// rank measured (1, 2, 4, 8).
#include "powersgd_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>

// a * b + c as one fused multiply-add where the instruction set has one (ISO C++ modes
// turn contraction off by default): one rounding instead of two, and half the work.
#pragma GCC optimize("fp-contract=fast")

namespace bagua_householder {
namespace {

// 256-bit vectors through GCC's vector extensions: one register in the AVX2 + FMA
// variant (below), two SSE registers in the baseline one. Loads and stores by memcpy
// (unaligned).
template <typename T>
struct VectorOf;
template <>
struct VectorOf<float> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VectorOf<double> {
  typedef double type __attribute__((vector_size(32)));
};
template <typename T>
using Vec = typename VectorOf<T>::type;
template <typename T>
constexpr int64_t kLanes = 32 / sizeof(T);
constexpr int64_t kMaxColumns = 8;  // columns of P handled per sweep (R accumulators)

template <typename T>
__attribute__((always_inline)) inline Vec<T> load(const T* p) {
  Vec<T> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
__attribute__((always_inline)) inline void store(T* p, Vec<T> v) {
  __builtin_memcpy(p, &v, sizeof(v));
}
template <typename T>
__attribute__((always_inline)) inline T lane_sum(Vec<T> v) {
  T sum = 0;
  for (int64_t l = 0; l < kLanes<T>; ++l) sum += v[l];
  return sum;
}

// One row, R columns of P: p_j = sum_k a_k qt_jk, where a = g + decay e is formed here
// and stored in e (`form`), or read from e (it was formed by an earlier sweep, r > 8).
template <typename T, int R>
__attribute__((always_inline)) inline void form_row(T* __restrict e, const T* __restrict g, const T* __restrict qt,
                                                    int64_t m, T decay, bool form, T* sums) {
  Vec<T> acc[R] = {};
  int64_t k = 0;
  for (; k + kLanes<T> <= m; k += kLanes<T>) {
    Vec<T> a = load<T>(e + k);
    if (form) {
      a = load<T>(g + k) + decay * a;
      store<T>(e + k, a);
    }
    for (int j = 0; j < R; ++j) acc[j] += a * load<T>(qt + j * m + k);
  }
  for (int j = 0; j < R; ++j) sums[j] = lane_sum<T>(acc[j]);
  for (; k < m; ++k) {
    T a = e[k];
    if (form) {
      a = g[k] + decay * a;
      e[k] = a;
    }
    for (int j = 0; j < R; ++j) sums[j] += a * qt[j * m + k];
  }
}

// One row, R columns of P: u = sum_j p_j qt_j (+ g, what earlier sweeps summed, when
// `add`), written to g; with `last`, also e <- e - u.
template <typename T, int R>
__attribute__((always_inline)) inline void update_row(T* __restrict e, T* __restrict g, const T* p,
                                                      const T* __restrict qt, int64_t m, bool add, bool last) {
  int64_t k = 0;
  for (; k + kLanes<T> <= m; k += kLanes<T>) {
    Vec<T> u = p[0] * load<T>(qt + k);
    for (int j = 1; j < R; ++j) u += p[j] * load<T>(qt + j * m + k);
    if (add) u += load<T>(g + k);
    store<T>(g + k, u);
    if (last) store<T>(e + k, load<T>(e + k) - u);
  }
  for (; k < m; ++k) {
    T u = p[0] * qt[k];
    for (int j = 1; j < R; ++j) u += p[j] * qt[j * m + k];
    if (add) u += g[k];
    g[k] = u;
    if (last) e[k] -= u;
  }
}

// Rows per task: enough values (about 64k) that waking a thread pays off.
int64_t grain(int64_t m) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(m, 1)); }

// Rows [begin, end): the columns of P in sweeps of up to kMaxColumns, the first sweep forming A.
template <typename T>
__attribute__((always_inline)) inline void form_rows(T* e, const T* g, const T* qt, T* p, int64_t p_row, int64_t p_col,
                                                     int64_t begin, int64_t end, int64_t m, int64_t r, T decay) {
  T sums[kMaxColumns];
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t j0 = 0; j0 < r; j0 += kMaxColumns) {
      T* ei = e + i * m;
      const T* gi = g + i * m;
      const T* q = qt + j0 * m;
      const bool form = j0 == 0;
      const int64_t columns = std::min(kMaxColumns, r - j0);
      switch (columns) {
        case 1: form_row<T, 1>(ei, gi, q, m, decay, form, sums); break;
        case 2: form_row<T, 2>(ei, gi, q, m, decay, form, sums); break;
        case 3: form_row<T, 3>(ei, gi, q, m, decay, form, sums); break;
        case 4: form_row<T, 4>(ei, gi, q, m, decay, form, sums); break;
        case 5: form_row<T, 5>(ei, gi, q, m, decay, form, sums); break;
        case 6: form_row<T, 6>(ei, gi, q, m, decay, form, sums); break;
        case 7: form_row<T, 7>(ei, gi, q, m, decay, form, sums); break;
        default: form_row<T, 8>(ei, gi, q, m, decay, form, sums); break;
      }
      for (int64_t j = 0; j < columns; ++j) p[i * p_row + (j0 + j) * p_col] = sums[j];
    }
  }
}

template <typename T>
__attribute__((always_inline)) inline void update_rows(T* e, T* g, const T* p, int64_t p_row, int64_t p_col,
                                                       const T* qt, int64_t begin, int64_t end, int64_t m,
                                                       int64_t r) {
  T coefficients[kMaxColumns];
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t j0 = 0; j0 < r; j0 += kMaxColumns) {
      T* ei = e + i * m;
      T* gi = g + i * m;
      const T* q = qt + j0 * m;
      const int64_t columns = std::min(kMaxColumns, r - j0);
      const bool add = j0 > 0, last = j0 + columns == r;
      for (int64_t j = 0; j < columns; ++j) coefficients[j] = p[i * p_row + (j0 + j) * p_col];
      switch (columns) {
        case 1: update_row<T, 1>(ei, gi, coefficients, q, m, add, last); break;
        case 2: update_row<T, 2>(ei, gi, coefficients, q, m, add, last); break;
        case 3: update_row<T, 3>(ei, gi, coefficients, q, m, add, last); break;
        case 4: update_row<T, 4>(ei, gi, coefficients, q, m, add, last); break;
        case 5: update_row<T, 5>(ei, gi, coefficients, q, m, add, last); break;
        case 6: update_row<T, 6>(ei, gi, coefficients, q, m, add, last); break;
        case 7: update_row<T, 7>(ei, gi, coefficients, q, m, add, last); break;
        default: update_row<T, 8>(ei, gi, coefficients, q, m, add, last); break;
      }
    }
  }
}

// Each kernel twice on x86-64: for AVX2 with FMA (256-bit fused multiply-adds), taken
// where the CPU has them, and for the baseline instruction set; once elsewhere.
template <typename T>
void form_rows_baseline(T* e, const T* g, const T* qt, T* p, int64_t p_row, int64_t p_col, int64_t begin,
                        int64_t end, int64_t m, int64_t r, T decay) {
  form_rows<T>(e, g, qt, p, p_row, p_col, begin, end, m, r, decay);
}
template <typename T>
void update_rows_baseline(T* e, T* g, const T* p, int64_t p_row, int64_t p_col, const T* qt, int64_t begin,
                          int64_t end, int64_t m, int64_t r) {
  update_rows<T>(e, g, p, p_row, p_col, qt, begin, end, m, r);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename T>
__attribute__((target("avx2,fma"))) void form_rows_fma(T* e, const T* g, const T* qt, T* p, int64_t p_row,
                                                       int64_t p_col, int64_t begin, int64_t end, int64_t m,
                                                       int64_t r, T decay) {
  form_rows<T>(e, g, qt, p, p_row, p_col, begin, end, m, r, decay);
}
template <typename T>
__attribute__((target("avx2,fma"))) void update_rows_fma(T* e, T* g, const T* p, int64_t p_row, int64_t p_col,
                                                         const T* qt, int64_t begin, int64_t end, int64_t m,
                                                         int64_t r) {
  update_rows<T>(e, g, p, p_row, p_col, qt, begin, end, m, r);
}
bool has_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

template <typename T>
void form_typed(const at::Tensor& e, const at::Tensor& g, const at::Tensor& qt, const at::Tensor& p, double decay,
                int64_t begin, int64_t end) {
  const int64_t m = e.size(1), r = qt.size(0);
  auto* kernel = &form_rows_baseline<T>;
#if defined(__x86_64__) && defined(__GNUC__)
  if (has_fma()) kernel = &form_rows_fma<T>;
#endif
  kernel(e.data_ptr<T>(), g.data_ptr<T>(), qt.data_ptr<T>(), p.data_ptr<T>(), p.stride(0), p.stride(1), begin, end, m,
         r, static_cast<T>(decay));
}

template <typename T>
void update_typed(const at::Tensor& e, const at::Tensor& g, const at::Tensor& p, const at::Tensor& qt, int64_t begin,
                  int64_t end) {
  const int64_t m = e.size(1), r = qt.size(0);
  auto* kernel = &update_rows_baseline<T>;
#if defined(__x86_64__) && defined(__GNUC__)
  if (has_fma()) kernel = &update_rows_fma<T>;
#endif
  kernel(e.data_ptr<T>(), g.data_ptr<T>(), p.data_ptr<T>(), p.stride(0), p.stride(1), qt.data_ptr<T>(), begin, end, m,
         r);
}

}  // namespace

void powersgd_form_a_and_p_cpu(const at::Tensor& e, const at::Tensor& g, const at::Tensor& qt, const at::Tensor& p,
                               double decay) {
  at::parallel_for(0, e.size(0), grain(e.size(1)),
                   [&](int64_t begin, int64_t end) {
                     if (e.scalar_type() == at::kFloat) {
                       form_typed<float>(e, g, qt, p, decay, begin, end);
                     } else {
                       form_typed<double>(e, g, qt, p, decay, begin, end);
                     }
                   });
}

void powersgd_apply_update_cpu(const at::Tensor& e, const at::Tensor& g, const at::Tensor& p, const at::Tensor& qt) {
  at::parallel_for(0, e.size(0), grain(e.size(1)),
                   [&](int64_t begin, int64_t end) {
                     if (e.scalar_type() == at::kFloat) {
                       update_typed<float>(e, g, p, qt, begin, end);
                     } else {
                       update_typed<double>(e, g, p, qt, begin, end);
                     }
                   });
}

}  // namespace bagua_householder
