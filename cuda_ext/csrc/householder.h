// Householder QR of one tall-skinny matrix, written once for a "team" of threads:
// the whole team works on one matrix. The CPU path runs it with a team of one thread
// (SerialTeam, below); the CUDA path with one thread block per matrix (BlockTeam in
// orthogonalize_kernel.cu). Both therefore run exactly this algorithm.
//
// Math (A is m x r, r <= m, work W holds A column-major, ld = m):
//
//   0. s = 2^-e with max|a_ij| = f * 2^e, f in [0.5, 1): W = s * A. Scaling by a power
//      of two is exact and leaves Q unchanged, and keeps every sum of squares below
//      in range for tiny or huge inputs.
//   1. REFLECTIONS, for j = 0 .. r-1, with x = W[j:, j] (already reflected by H_0..H_{j-1}):
//        sigma = |x[1:]|^2,  alpha = sqrt(x0^2 + sigma),  sign = (x0 >= 0 ? +1 : -1)
//        if sigma == 0 or alpha <= epsilon:  v_j = 0          (H_j = I)
//        else:  v_j = (x + sign*alpha*e_0) / |x + sign*alpha*e_0|   (unit vector)
//        H_j = I - 2 v_j v_j^T sends x to -sign*alpha*e_0 (LAPACK's sign convention,
//        so Q equals torch.linalg.qr's Q up to rounding where A has full rank);
//        apply H_j to W[j:, j+1:];  store v_j in W[j:, j].
//   2. Q_LOOP (in place, as LAPACK's orgqr), for j = r-1 .. 0:
//        apply H_j to W[j:, j+1:] (which now holds columns of Q),
//        W[:, j] = H_j e_j  =  e_j - 2 v_j v_j[0]   (zero above row j).
//      Q = H_0 H_1 ... H_{r-1} [I_r; 0] is orthonormal whatever A is: a zero or
//      dependent column (H_j = I) gives the unit column H_0..H_{j-1} e_j, orthogonal
//      to the others, never NaN.
//   3. Q is written to the output in the output's dtype.
//
// epsilon is relative to the largest entry (because of step 0): reflection j is
// skipped when the part of column j not yet explained by the columns before it has a
// norm <= epsilon * 2^e.
//
// Every reduction has a fixed order (no atomics), so a result is bitwise reproducible
// run to run on the same device and team size.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define HH_HD __host__ __device__ __forceinline__
#else
#define HH_HD inline
#endif

namespace bagua_householder {

// One matrix of a batched call. Strides are in elements; work_offset in
// accumulation-type elements from the start of the work area.
struct MatrixDesc {
  const void* input;
  void* output;
  int64_t rows;
  int64_t cols;
  int64_t in_row_stride;
  int64_t in_col_stride;
  int64_t out_row_stride;
  int64_t out_col_stride;
  int64_t work_offset;
};

HH_HD float hh_sqrt(float x) { return sqrtf(x); }
HH_HD double hh_sqrt(double x) { return sqrt(x); }
HH_HD float hh_abs(float x) { return fabsf(x); }
HH_HD double hh_abs(double x) { return fabs(x); }

// 2^-e where x = f * 2^e, f in [0.5, 1); 1 for 0, inf or NaN (nothing to gain).
HH_HD float inverse_power_of_two(float x) {
  if (!(x > 0.0f) || !(x < INFINITY)) return 1.0f;
  int e = 0;
  frexpf(x, &e);
  return ldexpf(1.0f, -e);
}
HH_HD double inverse_power_of_two(double x) {
  if (!(x > 0.0) || !(x < INFINITY)) return 1.0;
  int e = 0;
  frexp(x, &e);
  return ldexp(1.0, -e);
}

// sum of a[i] * b[i] for i = begin, begin + step, ... < end, with four running sums
// (independent add chains; a fixed order, so still reproducible).
template <typename acc_t>
HH_HD acc_t strided_dot(const acc_t* a, const acc_t* b, int64_t begin, int64_t end, int64_t step) {
  acc_t s0 = acc_t(0), s1 = acc_t(0), s2 = acc_t(0), s3 = acc_t(0);
  int64_t i = begin;
  for (; i + 3 * step < end; i += 4 * step) {
    s0 += a[i] * b[i];
    s1 += a[i + step] * b[i + step];
    s2 += a[i + 2 * step] * b[i + 2 * step];
    s3 += a[i + 3 * step] * b[i + 3 * step];
  }
  for (; i < end; i += step) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

struct SumOp {
  template <typename T>
  HH_HD T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  template <typename T>
  HH_HD T operator()(T a, T b) const { return a > b ? a : b; }
};

// A team of one thread: every loop below runs serially, every reduction is the
// identity and every barrier is a no-op.
template <typename acc_t>
struct SerialTeam {
  static constexpr int kGroupSize = 1;
  acc_t partial_storage[1];
  acc_t dots_storage[1];
  inline int thread() const { return 0; }
  inline int threads() const { return 1; }
  inline int group() const { return 0; }
  inline int groups() const { return 1; }
  inline int lane() const { return 0; }
  inline void barrier() const {}
  template <typename Op>
  inline acc_t reduce(acc_t value, Op) { return value; }
  inline acc_t group_sum(acc_t value) const { return value; }
  inline acc_t* partial() { return partial_storage; }  // one slot per group
  inline acc_t* dots() { return dots_storage; }        // one slot per group
};

// W[j:, k] -= 2 (v^T W[j:, k]) v for k in [first, cols), v = W[j:, j].
// Columns are taken in chunks of team.groups(); for a chunk of c columns each column
// gets groups()/c groups, each summing a strided slice of rows; the slices are then
// added in a fixed order.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Team, typename acc_t>
HH_HD void apply_reflection(Team& team, acc_t* w, int64_t m, int64_t cols, int64_t j, int64_t first) {
  const acc_t* v = w + j * m;
  const int group_count = team.groups();
  const int group_size = Team::kGroupSize;
  for (int64_t chunk = first; chunk < cols; chunk += group_count) {
    const int c = static_cast<int>((cols - chunk) < group_count ? (cols - chunk) : group_count);
    const int per_column = group_count / c;
    const int g = team.group();
    if (g < c * per_column) {  // uniform within a group
      const int64_t col = chunk + g / per_column;
      const int slice = g % per_column;
      const acc_t* x = w + col * m;
      acc_t part = strided_dot(v, x, j + static_cast<int64_t>(slice) * group_size + team.lane(), m,
                               static_cast<int64_t>(per_column) * group_size);
      part = team.group_sum(part);
      if (team.lane() == 0) team.partial()[g] = part;
    }
    team.barrier();
    for (int t = team.thread(); t < c; t += team.threads()) {
      acc_t d = acc_t(0);
      for (int s = 0; s < per_column; ++s) d += team.partial()[t * per_column + s];
      team.dots()[t] = acc_t(2) * d;
    }
    team.barrier();
    for (int k = 0; k < c; ++k) {
      acc_t* x = w + (chunk + k) * m;
      const acc_t d = team.dots()[k];
      for (int64_t i = j + team.thread(); i < m; i += team.threads()) x[i] -= d * v[i];
    }
    team.barrier();
  }
}

// Steps 1 and 2 on the work matrix w (m x r, column-major, already scaled).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Team, typename acc_t>
HH_HD void householder_q_inplace(Team& team, acc_t* w, int64_t m, int64_t r, acc_t epsilon) {
  const int t = team.thread();
  const int nt = team.threads();
  // REFLECTIONS
  for (int64_t j = 0; j < r; ++j) {
    acc_t* x = w + j * m;
    const acc_t x0 = x[j];
    const acc_t part = strided_dot(x, x, j + 1 + t, m, nt);
    const acc_t sigma = team.reduce(part, SumOp());  // all threads read x0 before this
    const acc_t alpha = hh_sqrt(x0 * x0 + sigma);
    if (sigma > acc_t(0) && alpha > epsilon) {
      const acc_t v0 = x0 >= acc_t(0) ? x0 + alpha : x0 - alpha;  // |v0| = |x0| + alpha
      const acc_t inv_norm = acc_t(1) / hh_sqrt(v0 * v0 + sigma);
      if (t == 0) x[j] = v0 * inv_norm;
      for (int64_t i = j + 1 + t; i < m; i += nt) x[i] *= inv_norm;
    } else {
      for (int64_t i = j + t; i < m; i += nt) x[i] = acc_t(0);
    }
    team.barrier();
    apply_reflection(team, w, m, r, j, j + 1);
  }
  // Q_LOOP
  for (int64_t j = r - 1; j >= 0; --j) {
    apply_reflection(team, w, m, r, j, j + 1);
    acc_t* x = w + j * m;
    const acc_t v0 = x[j];
    team.barrier();  // everyone has v0 before row j is overwritten
    for (int64_t i = t; i < j; i += nt) x[i] = acc_t(0);
    for (int64_t i = j + t; i < m; i += nt) x[i] = (i == j ? acc_t(1) : acc_t(0)) - acc_t(2) * x[i] * v0;
    team.barrier();
  }
}

#if !defined(__CUDACC__)
// The same steps 1 and 2 for a team of one thread (the CPU path), written so that the
// compiler can vectorize them: every sum of products runs over kSerialLanes running
// sums (element i of a sum goes to sum i mod kSerialLanes, the sums are then added
// pairwise in a fixed tree), and the columns of a reflection are plain loops over
// distinct columns. Same reflections, same Q, only the order of the additions
// differs from the generic code above, so the results agree with it up to rounding;
// the order is fixed (it does not depend on the vector width the compiler picks), so
// a result is still bitwise reproducible run to run.
constexpr int kSerialLanes = 16;

template <typename acc_t>
inline acc_t serial_dot(const acc_t* __restrict__ a, const acc_t* __restrict__ b, int64_t n) {
  acc_t s[kSerialLanes];
  for (int l = 0; l < kSerialLanes; ++l) s[l] = acc_t(0);
  int64_t i = 0;
  for (; i + kSerialLanes <= n; i += kSerialLanes) {
    for (int l = 0; l < kSerialLanes; ++l) s[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i + l < n; ++l) s[l] += a[i + l] * b[i + l];
  // Pairwise: s[l] += s[l + 8], then s[l] += s[l + 4], ... (one loop per width, so
  // each is a constant-trip-count loop the compiler unrolls).
  static_assert(kSerialLanes == 16, "the tree below adds 16 sums");
  for (int l = 0; l < 8; ++l) s[l] += s[l + 8];
  for (int l = 0; l < 4; ++l) s[l] += s[l + 4];
  for (int l = 0; l < 2; ++l) s[l] += s[l + 2];
  return s[0] + s[1];
}

// The leading dimension of the serial work matrix: m rounded up to 16 elements (64
// bytes for float) plus 16, so that no two columns are a multiple of 4 KiB apart
// (stores to one column and loads from another at such distances stall on x86: the
// row-wise copies below would hit that for m = 512 or 1024).
inline int64_t serial_work_ld(int64_t m) { return (m + 15) / 16 * 16 + 16; }

// W[j:, k] -= 2 (v^T W[j:, k]) v for k in [first, cols), v = W[j:, j]; W has leading
// dimension ld.
template <typename acc_t>
inline void serial_apply_reflection(acc_t* w, int64_t ld, int64_t m, int64_t cols, int64_t j, int64_t first) {
  const acc_t* __restrict__ v = w + j * ld + j;
  const int64_t n = m - j;
  for (int64_t k = first; k < cols; ++k) {
    acc_t* __restrict__ x = w + k * ld + j;
    const acc_t d = acc_t(2) * serial_dot(v, x, n);
    for (int64_t i = 0; i < n; ++i) x[i] -= d * v[i];
  }
}

// householder_q_inplace for a team of one thread, W with leading dimension ld >= m.
template <typename acc_t>
inline void serial_householder_q(acc_t* w, int64_t ld, int64_t m, int64_t r, acc_t epsilon) {
  // REFLECTIONS
  for (int64_t j = 0; j < r; ++j) {
    acc_t* __restrict__ x = w + j * ld;
    const acc_t x0 = x[j];
    const acc_t sigma = serial_dot(x + j + 1, x + j + 1, m - j - 1);
    const acc_t alpha = hh_sqrt(x0 * x0 + sigma);
    if (sigma > acc_t(0) && alpha > epsilon) {
      const acc_t v0 = x0 >= acc_t(0) ? x0 + alpha : x0 - alpha;
      const acc_t inv_norm = acc_t(1) / hh_sqrt(v0 * v0 + sigma);
      x[j] = v0 * inv_norm;
      for (int64_t i = j + 1; i < m; ++i) x[i] *= inv_norm;
    } else {
      for (int64_t i = j; i < m; ++i) x[i] = acc_t(0);
    }
    serial_apply_reflection(w, ld, m, r, j, j + 1);
  }
  // Q_LOOP
  for (int64_t j = r - 1; j >= 0; --j) {
    serial_apply_reflection(w, ld, m, r, j, j + 1);
    acc_t* __restrict__ x = w + j * ld;
    const acc_t v0 = x[j];
    for (int64_t i = 0; i < j; ++i) x[i] = acc_t(0);
    x[j] = acc_t(1) - acc_t(2) * x[j] * v0;
    for (int64_t i = j + 1; i < m; ++i) x[i] = acc_t(0) - acc_t(2) * x[i] * v0;
  }
}
// Steps 0 to 3 for one matrix with a team of one thread (orthogonalize_matrix below,
// same arithmetic): the copies run along the input's and the output's shorter stride.
// w holds serial_work_ld(m) * r elements.
template <typename scalar_t, typename acc_t>
inline void serial_orthogonalize_matrix(const MatrixDesc& d, acc_t* w, acc_t epsilon) {
  const int64_t m = d.rows, r = d.cols, ld = serial_work_ld(m);
  const scalar_t* in = static_cast<const scalar_t*>(d.input);
  scalar_t* out = static_cast<scalar_t*>(d.output);
  const bool in_by_rows = d.in_col_stride < d.in_row_stride;
  acc_t largest = acc_t(0);
  if (in_by_rows) {
    for (int64_t i = 0; i < m; ++i) {
      const scalar_t* in_row = in + i * d.in_row_stride;
      for (int64_t k = 0; k < r; ++k) {
        const acc_t a = static_cast<acc_t>(in_row[k * d.in_col_stride]);
        w[k * ld + i] = a;
        largest = MaxOp()(largest, hh_abs(a));
      }
    }
  } else {
    for (int64_t k = 0; k < r; ++k) {
      const scalar_t* in_col = in + k * d.in_col_stride;
      acc_t* w_col = w + k * ld;
      for (int64_t i = 0; i < m; ++i) {
        const acc_t a = static_cast<acc_t>(in_col[i * d.in_row_stride]);
        w_col[i] = a;
        largest = MaxOp()(largest, hh_abs(a));
      }
    }
  }
  const acc_t scale = inverse_power_of_two(largest);
  if (scale != acc_t(1)) {
    for (int64_t k = 0; k < r; ++k) {
      acc_t* w_col = w + k * ld;
      for (int64_t i = 0; i < m; ++i) w_col[i] *= scale;
    }
  }
  serial_householder_q(w, ld, m, r, epsilon);
  if (d.out_col_stride < d.out_row_stride) {
    for (int64_t i = 0; i < m; ++i) {
      scalar_t* out_row = out + i * d.out_row_stride;
      for (int64_t k = 0; k < r; ++k) out_row[k * d.out_col_stride] = static_cast<scalar_t>(w[k * ld + i]);
    }
  } else {
    for (int64_t k = 0; k < r; ++k) {
      scalar_t* out_col = out + k * d.out_col_stride;
      const acc_t* w_col = w + k * ld;
      for (int64_t i = 0; i < m; ++i) out_col[i * d.out_row_stride] = static_cast<scalar_t>(w_col[i]);
    }
  }
}
#endif

// Steps 0 to 3 for one matrix: read (any strides), scale, factor, write Q.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Team, typename scalar_t, typename acc_t>
HH_HD void orthogonalize_matrix(Team& team, const MatrixDesc& d, acc_t* w, acc_t epsilon) {
  const int64_t m = d.rows, r = d.cols;
  const int t = team.thread();
  const int nt = team.threads();
  const scalar_t* in = static_cast<const scalar_t*>(d.input);
  scalar_t* out = static_cast<scalar_t*>(d.output);
  // Each thread copies, scales and writes back the same entries (rows t, t + nt, ...
  // of every column), so only the scale needs the team.
  acc_t largest = acc_t(0);
  for (int64_t k = 0; k < r; ++k) {
    const scalar_t* in_col = in + k * d.in_col_stride;
    acc_t* w_col = w + k * m;
    for (int64_t i = t; i < m; i += nt) {
      const acc_t a = static_cast<acc_t>(in_col[i * d.in_row_stride]);
      w_col[i] = a;
      largest = MaxOp()(largest, hh_abs(a));
    }
  }
  const acc_t scale = inverse_power_of_two(team.reduce(largest, MaxOp()));
  for (int64_t k = 0; k < r; ++k) {
    acc_t* w_col = w + k * m;
    for (int64_t i = t; i < m; i += nt) w_col[i] *= scale;
  }
  team.barrier();
  householder_q_inplace(team, w, m, r, epsilon);
  for (int64_t k = 0; k < r; ++k) {
    scalar_t* out_col = out + k * d.out_col_stride;
    const acc_t* w_col = w + k * m;
    for (int64_t i = t; i < m; i += nt) out_col[i * d.out_row_stride] = static_cast<scalar_t>(w_col[i]);
  }
}

// The accumulation type: float for float, half and bfloat16; double for double.
template <typename scalar_t>
struct AccumulateType {
  using type = float;
};
template <>
struct AccumulateType<double> {
  using type = double;
};

// The dtypes a call may hold (the CUDA launcher's switch).
enum class DType : int { Float32 = 0, Float64 = 1, Float16 = 2, BFloat16 = 3 };

}  // namespace bagua_householder
