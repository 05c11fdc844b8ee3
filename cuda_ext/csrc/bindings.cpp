// Python binding: orthogonalize(matrices, epsilon) -> list of Q factors.
#include "orthogonalize.h"

namespace {

std::vector<at::Tensor> orthogonalize(const std::vector<at::Tensor>& matrices, double epsilon) {
  if (matrices.empty()) return {};
  if (matrices[0].device().is_cpu()) return bagua_householder::orthogonalize_cpu(matrices, epsilon);
#ifdef BAGUA_WITH_CUDA
  if (matrices[0].device().is_cuda()) return bagua_householder::orthogonalize_cuda(matrices, epsilon);
#endif
  TORCH_CHECK_VALUE(false, "matrices[0] is on ", matrices[0].device(), ", which this build does not support (",
#ifdef BAGUA_WITH_CUDA
                    "cpu or cuda"
#else
                    "cpu only"
#endif
                    ")");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Batched Householder orthogonalization (bagua-algos cuda_ext)";
  m.def("orthogonalize", &orthogonalize, "Q factors (orthonormal columns) of a list of m x r matrices",
        pybind11::arg("matrices"), pybind11::arg("epsilon"));
#ifdef BAGUA_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
