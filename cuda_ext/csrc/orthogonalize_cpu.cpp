// CPU path: the per-matrix Householder math of householder.h with a team of one
// thread, matrices spread over threads with ATen's parallel_for.
#include "orthogonalize.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace bagua_householder {

std::vector<at::Tensor> check_and_allocate(const std::vector<at::Tensor>& matrices) {
  std::vector<at::Tensor> outputs;
  outputs.reserve(matrices.size());
  for (size_t i = 0; i < matrices.size(); ++i) {
    const at::Tensor& a = matrices[i];
    const std::string name = "matrices[" + std::to_string(i) + "]";
    TORCH_CHECK_VALUE(a.defined(), name, " must be a tensor, got an undefined tensor");
    TORCH_CHECK_VALUE(a.dim() == 2, name, " must be a 2-D tensor (m x r), got ", a.dim(), " dimensions");
    const auto dtype = a.scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
                      name, " must be float32, float64, float16 or bfloat16, got ", dtype);
    TORCH_CHECK_VALUE(a.size(1) <= a.size(0), name, " must have no more columns than rows (r <= m), got shape [",
                      a.size(0), ", ", a.size(1), "]");
    TORCH_CHECK_VALUE(a.device() == matrices[0].device(), name, " is on ", a.device(), " but matrices[0] is on ",
                      matrices[0].device(), "; one call takes matrices of one device");
    outputs.push_back(at::empty({a.size(0), a.size(1)}, a.options().memory_format(at::MemoryFormat::Contiguous)));
  }
  return outputs;
}

MatrixDesc describe(const at::Tensor& input, const at::Tensor& output) {
  MatrixDesc d;
  d.input = input.data_ptr();
  d.output = output.data_ptr();
  d.rows = input.size(0);
  d.cols = input.size(1);
  d.in_row_stride = input.stride(0);
  d.in_col_stride = input.stride(1);
  d.out_row_stride = output.stride(0);
  d.out_col_stride = output.stride(1);
  d.work_offset = 0;
  return d;
}

namespace {

template <typename scalar_t>
void run_one(const MatrixDesc& d, void* work, double epsilon) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  SerialTeam<acc_t> team;
  orthogonalize_matrix<SerialTeam<acc_t>, scalar_t, acc_t>(team, d, static_cast<acc_t*>(work) + d.work_offset,
                                                           static_cast<acc_t>(epsilon));
}

void run_one_any(at::ScalarType dtype, const MatrixDesc& d, void* float_work, void* double_work, double epsilon) {
  switch (dtype) {
    case at::kFloat: run_one<float>(d, float_work, epsilon); break;
    case at::kDouble: run_one<double>(d, double_work, epsilon); break;
    case at::kHalf: run_one<at::Half>(d, float_work, epsilon); break;
    case at::kBFloat16: run_one<at::BFloat16>(d, float_work, epsilon); break;
    default: TORCH_CHECK(false, "unreachable dtype ", dtype);
  }
}

// One work area per calling thread, grown when needed, never shrunk: a float region
// and a double region, each matrix at its own offset.
struct CpuWorkspace {
  std::vector<float> floats;
  std::vector<double> doubles;
};
thread_local CpuWorkspace cpu_workspace;

}  // namespace

std::vector<at::Tensor> orthogonalize_cpu(const std::vector<at::Tensor>& matrices, double epsilon) {
  TORCH_CHECK_VALUE(std::isfinite(epsilon) && epsilon >= 0, "epsilon must be a finite number >= 0, got ", epsilon);
  std::vector<at::Tensor> outputs = check_and_allocate(matrices);
  const int64_t count = static_cast<int64_t>(matrices.size());
  std::vector<MatrixDesc> descs(count);
  int64_t float_size = 0, double_size = 0;
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK_VALUE(matrices[i].device().is_cpu(), "matrices[", i, "] must be on the CPU here, got ",
                      matrices[i].device());
    descs[i] = describe(matrices[i], outputs[i]);
    int64_t& size = matrices[i].scalar_type() == at::kDouble ? double_size : float_size;
    descs[i].work_offset = size;
    size += descs[i].rows * descs[i].cols;
  }
  CpuWorkspace& ws = cpu_workspace;
  if (static_cast<int64_t>(ws.floats.size()) < float_size) ws.floats.resize(float_size);
  if (static_cast<int64_t>(ws.doubles.size()) < double_size) ws.doubles.resize(double_size);
  float* float_work = ws.floats.data();
  double* double_work = ws.doubles.data();
  // Threads only pay off with enough work (about m r^2 per matrix): below ~256k
  // multiply-adds in all, waking a second thread costs more than it saves.
  int64_t work = 0;
  for (const auto& d : descs) work += d.rows * d.cols * d.cols;
  const int64_t grain = work < (int64_t(1) << 18) ? std::max<int64_t>(count, 1) : 1;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (descs[i].rows * descs[i].cols == 0) continue;
      run_one_any(matrices[i].scalar_type(), descs[i], float_work, double_work, epsilon);
    }
  });
  return outputs;
}

}  // namespace bagua_householder
