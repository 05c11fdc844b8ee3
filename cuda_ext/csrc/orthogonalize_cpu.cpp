// CPU path: the per-matrix Householder math of householder.h with a team of one
// thread (serial_orthogonalize_matrix: the generic steps written so that the compiler
// vectorizes them), matrices spread over threads with ATen's parallel_for. Inputs are checked
// in bindings.cpp before this runs.
#include "orthogonalize.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace bagua_householder {

namespace {

template <typename scalar_t>
void run_one(const MatrixDesc& d, void* work, double epsilon) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  serial_orthogonalize_matrix<scalar_t, acc_t>(d, static_cast<acc_t*>(work) + d.work_offset,
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

void run_cpu(std::vector<Job>& jobs, double epsilon) {
  const int64_t count = static_cast<int64_t>(jobs.size());
  int64_t float_size = 0, double_size = 0;
  for (auto& job : jobs) {
    int64_t& size = job.dtype == at::kDouble ? double_size : float_size;
    job.desc.work_offset = size;
    size += serial_work_ld(job.desc.rows) * job.desc.cols;
  }
  CpuWorkspace& ws = cpu_workspace;
  if (static_cast<int64_t>(ws.floats.size()) < float_size) ws.floats.resize(float_size);
  if (static_cast<int64_t>(ws.doubles.size()) < double_size) ws.doubles.resize(double_size);
  float* float_work = ws.floats.data();
  double* double_work = ws.doubles.data();
  // Threads only pay off with enough work (about m r^2 per matrix): below ~256k
  // multiply-adds in all, waking a second thread costs more than it saves.
  int64_t work = 0;
  for (const auto& job : jobs) work += job.desc.rows * job.desc.cols * job.desc.cols;
  const int64_t grain = work < (int64_t(1) << 18) ? std::max<int64_t>(count, 1) : 1;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (jobs[i].desc.rows * jobs[i].desc.cols == 0) continue;
      run_one_any(jobs[i].dtype, jobs[i].desc, float_work, double_work, epsilon);
    }
  });
}

}  // namespace bagua_householder
