// The one-process engine's D-PSGD mix as one sweep (engine_cpu.cpp). Inputs are checked
// in bindings.cpp: x 2-D with unit column stride, float32 or float64, on the CPU;
// self_weight (n) and weight (n x slots) of x's dtype, contiguous; neighbour int64
// (n x slots), each in [-1, n).
#pragma once

#include <torch/extension.h>

namespace bagua_householder {

// x_i <- self_weight_i x_i + sum_k weight_ik x_{neighbour_ik} for every row i at once, in
// place (the right side is the old x), the slots k in order; a negative neighbour adds
// nothing.
void engine_gossip_mix_cpu(const at::Tensor& x, const at::Tensor& self_weight, const at::Tensor& neighbour,
                           const at::Tensor& weight);

}  // namespace bagua_householder
