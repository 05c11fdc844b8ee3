// PowerSGD's passes over a matrix on the CPU, the first two each fused into one sweep of
// its rows (bagua_algos/compression/powersgd.py calls them where this module is loaded):
//
//   form_a_and_p_(e, g, qt, p, decay):   A = G + decay * E, written into E,  P = A Q
//   apply_update_(e, g, p, qt):          U = P Q^T,  G <- U,  E <- E - U
//   transposed_product_(a, p, qt):       Q^T = P^T A   (Q = A^T P)
//
// E and G are n x m, P is n x r, Q is given transposed (qt: r x m, contiguous), r >= 1.
// In torch each line is one or two passes over n x m values from memory (A formed,
// then read again by the product; U written to G, then E read and written again). Here
// a row of A (or U) is made and used while it is in the L1 cache, so the gradients'
// size crosses the memory bus as often as the formula needs: forming reads G and E and
// writes E; the update reads E and writes E and G. The step is memory-bound on one
// thread (its time follows its passes over the gradients' size, not its arithmetic), so
// fewer passes are the speed-up.
//
// A sum over k runs in 8 (float) or 4 (double) vector lanes, the lanes added at the end
// of the row; a sum over the columns j runs in order. So results match torch's products
// up to rounding, not bit for bit. Rows are spread over ATen's threads.
//
// The product forms P in tiles of 3 rows x 4 columns: a tile loads 3 + 4 vectors for 12
// multiply-adds (12 accumulators, 3 rows and a column of Q^T fill AVX2's 16 registers),
// where one row at a time loads r + 1 vectors for r, and at r = 8 lost to MKL's GEMM.
// At r = 1 the rows go one at a time, a pure stream. The transposed product walks A's
// rows 8 at a time through blocks of columns, each block of Q^T kept in L1 (MKL's GEMM
// with A transposed and so few columns runs well below the memory's speed).
//
// Measured (one thread, ResNet-18's 21 matrices): forming is faster than torch's add +
// product up to r = 16 (equal at 32), the update up to r = 8 (above it each sweep after
// the first reads G again), the transposed product at every rank measured (1 to 32);
// powersgd.py takes each where it is faster (FUSED_FORM_MAX_RANK, FUSED_UPDATE_MAX_RANK,
// FUSED_Q_MAX_RANK).
#include "powersgd_cpu.h"
#include "vectors.h"

#include <ATen/Parallel.h>

#include <algorithm>

// a * b + c as one fused multiply-add where the instruction set has one (ISO C++ modes
// turn contraction off by default): one rounding instead of two, and half the work.
#pragma GCC optimize("fp-contract=fast")

namespace bagua_householder {
namespace {

using vectors::kLanes;
using vectors::load;
using vectors::store;
using vectors::Vec;
constexpr int64_t kMaxColumns = 8;   // columns of P per sweep of the update (R accumulators)
constexpr int64_t kTileColumns = 4;  // columns of P per tile of the product

template <typename T>
__attribute__((always_inline)) inline T lane_sum(Vec<T> v) {
  T sum = 0;
  for (int64_t l = 0; l < kLanes<T>; ++l) sum += v[l];
  return sum;
}

// RI rows, RJ columns of P: p_ij = sum_k a_ik qt_jk, where a_i = g_i + decay e_i is
// formed here and stored in e_i (`form`), or read from e_i (formed by an earlier column
// group). A tile of RI x RJ sums loads RI + RJ vectors for RI * RJ multiply-adds: at
// 3 x 4, 12 accumulators, 3 rows and a column of Q^T fill AVX2's 16 registers.
template <typename T, int RI, int RJ>
__attribute__((always_inline)) inline void form_tile(T* __restrict e, const T* __restrict g, const T* __restrict qt,
                                                     int64_t m, T decay, bool form, T (&sums)[RI][RJ]) {
  Vec<T> acc[RI][RJ] = {};
  int64_t k = 0;
  for (; k + kLanes<T> <= m; k += kLanes<T>) {
    Vec<T> a[RI];
    for (int i = 0; i < RI; ++i) {
      a[i] = load<T>(e + i * m + k);
      if (form) {
        a[i] = load<T>(g + i * m + k) + decay * a[i];
        store<T>(e + i * m + k, a[i]);
      }
    }
    for (int j = 0; j < RJ; ++j) {
      const Vec<T> q = load<T>(qt + j * m + k);
      for (int i = 0; i < RI; ++i) acc[i][j] += a[i] * q;
    }
  }
  for (int i = 0; i < RI; ++i)
    for (int j = 0; j < RJ; ++j) sums[i][j] = lane_sum<T>(acc[i][j]);
  for (; k < m; ++k) {
    for (int i = 0; i < RI; ++i) {
      T a = e[i * m + k];
      if (form) {
        a = g[i * m + k] + decay * a;
        e[i * m + k] = a;
      }
      for (int j = 0; j < RJ; ++j) sums[i][j] += a * qt[j * m + k];
    }
  }
}

// Rows [i, i + RI) and columns [j0, j0 + RJ) of P.
template <typename T, int RI, int RJ>
__attribute__((always_inline)) inline void form_block(T* e, const T* g, const T* qt, T* p, int64_t p_row,
                                                      int64_t p_col, int64_t i, int64_t j0, int64_t m, T decay) {
  T sums[RI][RJ];
  form_tile<T, RI, RJ>(e + i * m, g + i * m, qt + j0 * m, m, decay, j0 == 0, sums);
  for (int a = 0; a < RI; ++a)
    for (int b = 0; b < RJ; ++b) p[(i + a) * p_row + (j0 + b) * p_col] = sums[a][b];
}

template <typename T, int RI>
__attribute__((always_inline)) inline void form_rows_of(T* e, const T* g, const T* qt, T* p, int64_t p_row,
                                                        int64_t p_col, int64_t i, int64_t m, int64_t r, T decay) {
  for (int64_t j0 = 0; j0 < r; j0 += kTileColumns) {
    switch (std::min(kTileColumns, r - j0)) {
      case 1: form_block<T, RI, 1>(e, g, qt, p, p_row, p_col, i, j0, m, decay); break;
      case 2: form_block<T, RI, 2>(e, g, qt, p, p_row, p_col, i, j0, m, decay); break;
      case 3: form_block<T, RI, 3>(e, g, qt, p, p_row, p_col, i, j0, m, decay); break;
      default: form_block<T, RI, 4>(e, g, qt, p, p_row, p_col, i, j0, m, decay); break;
    }
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

// Rows [begin, end) in tiles of 3 (then 2, 1), the columns of P in groups of up to
// kTileColumns, the first group forming A.
template <typename T>
__attribute__((always_inline)) inline void form_rows(T* e, const T* g, const T* qt, T* p, int64_t p_row, int64_t p_col,
                                                     int64_t begin, int64_t end, int64_t m, int64_t r, T decay) {
  int64_t i = begin;
  if (r == 1) {  // a pure stream: one row at a time keeps three streams, as the hardware prefetches best
    for (; i < end; ++i) form_rows_of<T, 1>(e, g, qt, p, p_row, p_col, i, m, r, decay);
    return;
  }
  for (; i + 3 <= end; i += 3) form_rows_of<T, 3>(e, g, qt, p, p_row, p_col, i, m, r, decay);
  if (end - i == 2) form_rows_of<T, 2>(e, g, qt, p, p_row, p_col, i, m, r, decay);
  if (end - i == 1) form_rows_of<T, 1>(e, g, qt, p, p_row, p_col, i, m, r, decay);
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


// Q^T = P^T A over columns [k0, k1) of rows [i, i + RI): qt_jk += sum_i p_ij a_ik, each
// vector of Q^T loaded and stored once for RI multiply-adds.
template <typename T, int RI>
__attribute__((always_inline)) inline void transposed_tile(const T* __restrict a, const T* p, int64_t p_row,
                                                           int64_t p_col, T* __restrict qt, int64_t i, int64_t m,
                                                           int64_t r, int64_t k0, int64_t k1) {
  for (int64_t j = 0; j < r; ++j) {
    T c[RI];
    for (int ii = 0; ii < RI; ++ii) c[ii] = p[(i + ii) * p_row + j * p_col];
    T* q = qt + j * m;
    int64_t k = k0;
    for (; k + kLanes<T> <= k1; k += kLanes<T>) {
      Vec<T> acc = load<T>(q + k);
      for (int ii = 0; ii < RI; ++ii) acc += c[ii] * load<T>(a + (i + ii) * m + k);
      store<T>(q + k, acc);
    }
    for (; k < k1; ++k) {
      T acc = q[k];
      for (int ii = 0; ii < RI; ++ii) acc += c[ii] * a[(i + ii) * m + k];
      q[k] = acc;
    }
  }
}

// Q^T = P^T A over columns [k0, k1), in blocks of `block` columns: a block of Q^T and the
// parts of 8 rows of A stay in the L1 cache while the rows stream past.
template <typename T>
__attribute__((always_inline)) inline void transposed_columns(const T* a, const T* p, int64_t p_row, int64_t p_col,
                                                              T* qt, int64_t n, int64_t m, int64_t r, int64_t k0,
                                                              int64_t k1, int64_t block) {
  for (int64_t j = 0; j < r; ++j) std::fill(qt + j * m + k0, qt + j * m + k1, T(0));
  for (int64_t b0 = k0; b0 < k1; b0 += block) {
    const int64_t b1 = std::min(k1, b0 + block);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) transposed_tile<T, 8>(a, p, p_row, p_col, qt, i, m, r, b0, b1);
    for (; i + 4 <= n; i += 4) transposed_tile<T, 4>(a, p, p_row, p_col, qt, i, m, r, b0, b1);
    for (; i < n; ++i) transposed_tile<T, 1>(a, p, p_row, p_col, qt, i, m, r, b0, b1);
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

template <typename T>
void transposed_columns_baseline(const T* a, const T* p, int64_t p_row, int64_t p_col, T* qt, int64_t n, int64_t m,
                                 int64_t r, int64_t k0, int64_t k1, int64_t block) {
  transposed_columns<T>(a, p, p_row, p_col, qt, n, m, r, k0, k1, block);
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
template <typename T>
__attribute__((target("avx2,fma"))) void transposed_columns_fma(const T* a, const T* p, int64_t p_row, int64_t p_col,
                                                               T* qt, int64_t n, int64_t m, int64_t r, int64_t k0,
                                                               int64_t k1, int64_t block) {
  transposed_columns<T>(a, p, p_row, p_col, qt, n, m, r, k0, k1, block);
}
#endif

template <typename T>
void form_typed(const at::Tensor& e, const at::Tensor& g, const at::Tensor& qt, const at::Tensor& p, double decay,
                int64_t begin, int64_t end) {
  const int64_t m = e.size(1), r = qt.size(0);
  auto* kernel = &form_rows_baseline<T>;
#if defined(__x86_64__) && defined(__GNUC__)
  if (vectors::cpu_has_fma()) kernel = &form_rows_fma<T>;
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
  if (vectors::cpu_has_fma()) kernel = &update_rows_fma<T>;
#endif
  kernel(e.data_ptr<T>(), g.data_ptr<T>(), p.data_ptr<T>(), p.stride(0), p.stride(1), qt.data_ptr<T>(), begin, end, m,
         r);
}

template <typename T>
void transposed_typed(const at::Tensor& a, const at::Tensor& p, const at::Tensor& qt, int64_t k0, int64_t k1,
                      int64_t block) {
  auto* kernel = &transposed_columns_baseline<T>;
#if defined(__x86_64__) && defined(__GNUC__)
  if (vectors::cpu_has_fma()) kernel = &transposed_columns_fma<T>;
#endif
  kernel(a.data_ptr<T>(), p.data_ptr<T>(), p.stride(0), p.stride(1), qt.data_ptr<T>(), a.size(0), a.size(1),
         qt.size(0), k0, k1, block);
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

void powersgd_transposed_product_cpu(const at::Tensor& a, const at::Tensor& p, const at::Tensor& qt) {
  // Blocks of columns: about 16 KB of Q^T each (2 KB a row of it at r = 8, 16 KB at
  // r = 1), a whole number of vectors; threads take whole blocks.
  const int64_t m = a.size(1), r = qt.size(0), bytes = a.element_size();
  const int64_t lanes = 32 / bytes;
  const int64_t block = std::max<int64_t>(lanes, (int64_t{16} << 10) / (bytes * r) / lanes * lanes);
  const int64_t blocks = (m + block - 1) / block;
  at::parallel_for(0, blocks, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(a.size(0) * block, 1)),
                   [&](int64_t begin, int64_t end) {
                     const int64_t k0 = begin * block, k1 = std::min(m, end * block);
                     if (a.scalar_type() == at::kFloat) {
                       transposed_typed<float>(a, p, qt, k0, k1, block);
                     } else {
                       transposed_typed<double>(a, p, qt, k0, k1, block);
                     }
                   });
}

}  // namespace bagua_householder
