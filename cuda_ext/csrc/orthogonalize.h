// Declarations shared by the C++ sources of the extension.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "householder.h"

namespace bagua_householder {

// Checks every matrix (2-D, floating point, r <= m, one device) and names the
// first bad one; allocates the outputs (contiguous, the inputs' dtypes).
std::vector<at::Tensor> check_and_allocate(const std::vector<at::Tensor>& matrices);

// The descriptor of matrices[i] with its output; work_offset left 0.
MatrixDesc describe(const at::Tensor& input, const at::Tensor& output);

std::vector<at::Tensor> orthogonalize_cpu(const std::vector<at::Tensor>& matrices, double epsilon);

#ifdef BAGUA_WITH_CUDA
std::vector<at::Tensor> orthogonalize_cuda(const std::vector<at::Tensor>& matrices, double epsilon);
#endif

}  // namespace bagua_householder
