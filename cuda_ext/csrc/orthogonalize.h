// Declarations shared by the C++ sources of the extension.
//
// Every input check lives in bindings.cpp and runs before the call is dispatched to a
// device, so the CPU and the CUDA module refuse bad input with the same ValueError and
// the same words (cuda_ext/__init__.py repeats them in Python, word for word). The
// device paths below trust their input.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "householder.h"

namespace bagua_householder {

// One matrix of a call with its dtype: the descriptor the per-matrix math reads
// (input and output may be the same memory: each matrix is read whole into a work
// area before its Q is written), work_offset filled in by the device path.
struct Job {
  MatrixDesc desc;
  at::ScalarType dtype;
};

// The descriptor of `input` (m x r) with its `output` (same shape), any strides.
MatrixDesc describe(const at::Tensor& input, const at::Tensor& output);

// The descriptor of matrix `index` of the batch `batch` (b x m x r), written in place.
MatrixDesc describe_in_place(const at::Tensor& batch, int64_t index);

// The device paths: every job's Q written to its output. Inputs already checked.
void run_cpu(std::vector<Job>& jobs, double epsilon);

#ifdef BAGUA_WITH_CUDA
void run_cuda(std::vector<Job>& jobs, const at::Device& device, double epsilon);
#endif

}  // namespace bagua_householder
