// PowerSGD's fused CPU passes (powersgd_cpu.cpp). Inputs are checked in bindings.cpp:
// e and g (or a) n x m, contiguous, one dtype (float32 or float64), qt r x m contiguous,
// p n x r, all on the CPU, what is written sharing memory with nothing else.
#pragma once

#include <torch/extension.h>

namespace bagua_householder {

// A = G + decay * E written into E, and P = A Q (Q given as qt = Q^T), row by row.
void powersgd_form_a_and_p_cpu(const at::Tensor& e, const at::Tensor& g, const at::Tensor& qt, const at::Tensor& p,
                               double decay);

// U = P Q^T written into G, and E <- E - U, row by row.
void powersgd_apply_update_cpu(const at::Tensor& e, const at::Tensor& g, const at::Tensor& p, const at::Tensor& qt);

// Q^T = P^T A (Q = A^T P, given transposed: qt r x m, contiguous), in blocks of columns.
void powersgd_transposed_product_cpu(const at::Tensor& a, const at::Tensor& p, const at::Tensor& qt);

}  // namespace bagua_householder
