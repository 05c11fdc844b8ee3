// The launcher the host code (orthogonalize_cuda.cpp) calls; no torch types, so the
// .cu file needs no torch/extension.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "householder.h"

namespace bagua_householder {

struct LaunchPlan {
  const MatrixDesc* descs;  // device array of `count` descriptors
  int count;
  int threads;              // per block, a multiple of 32, <= 1024
  size_t shared_bytes;      // > 0: each block works in dynamic shared memory of this size
  void* global_work;        // else: in this device buffer, at each descriptor's work_offset
  double epsilon;
};

// Threads per block for matrices of at most max_rows rows.
int threads_for_rows(int64_t max_rows);

// Launches one kernel for all matrices of the plan (all of dtype `dtype`) on `stream`;
// nullptr on success, else CUDA's error string.
const char* launch_orthogonalize(DType dtype, const LaunchPlan& plan, cudaStream_t stream);

}  // namespace bagua_householder
