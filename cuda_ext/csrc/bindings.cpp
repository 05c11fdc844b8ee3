// Python bindings and the input checks, shared by the CPU and the CUDA module:
//
//   orthogonalize(matrices, epsilon) -> list of Q factors (new tensors)
//   orthogonalize_batches_(batches, epsilon) -> None (each b x m x r batch in place)
//   powersgd_form_a_and_p_(e, g, qt, p, decay) -> None   (CPU only, powersgd_cpu.cpp)
//   powersgd_apply_update_(e, g, p, qt) -> None          (CPU only, powersgd_cpu.cpp)
//   powersgd_transposed_product_(a, p, qt) -> None       (CPU only, powersgd_cpu.cpp)
//
// Both check everything first (check_epsilon, check_matrices / check_batches), then
// dispatch on the device, so a bad input is the same ValueError on every device and
// nothing is launched or allocated for it. cuda_ext/__init__.py has the same checks
// in Python with the same words (tests/test_cuda_ext.py compares them).
#include "orthogonalize.h"
#include "engine_cpu.h"
#include "powersgd_cpu.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <initializer_list>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace bagua_householder {
namespace {

// torch's Python name of a dtype ("torch.int64"), as the Python checks print it.
std::string python_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: {
      std::string name = c10::toString(t);
      for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return "torch." + name;
    }
  }
}

// A shape as Python prints a tuple: (2, 3), (4,), ().
std::string python_shape(const at::Tensor& a) {
  std::ostringstream out;
  out << "(";
  for (int64_t d = 0; d < a.dim(); ++d) out << (d ? ", " : "") << a.size(d);
  if (a.dim() == 1) out << ",";
  out << ")";
  return out.str();
}

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

void check_epsilon(double epsilon) {
  TORCH_CHECK_VALUE(std::isfinite(epsilon) && epsilon >= 0, "epsilon must be a finite number >= 0, got ", epsilon);
}

// `what` is "matrices" (2-D, m x r) or "batches" (3-D, b x m x r): the first bad one is named.
void check_tensors(const std::vector<at::Tensor>& tensors, const char* what, int64_t dims) {
  const char* layout = dims == 2 ? "(m x r)" : "(b x m x r)";
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& a = tensors[i];
    // The name ("matrices[3]") is put together only when a check fails: the messages
    // of TORCH_CHECK_VALUE are evaluated then.
    TORCH_CHECK_VALUE(a.defined(), what, "[", i, "]", " must be a tensor, got an undefined tensor");
    TORCH_CHECK_VALUE(a.dim() == dims, what, "[", i, "]", " must be a ", dims, "-D tensor ", layout, ", got a ", a.dim(),
                      "-D tensor");
    TORCH_CHECK_VALUE(supported_dtype(a.scalar_type()), what, "[", i, "]", " must be float32, float64, float16 or bfloat16, got ",
                      python_dtype(a.scalar_type()));
    TORCH_CHECK_VALUE(a.size(dims - 1) <= a.size(dims - 2), what, "[", i, "]",
                      " must have no more columns than rows (r <= m), got shape ", python_shape(a));
    TORCH_CHECK_VALUE(a.device() == tensors[0].device(), what, "[", i, "]", " is on ", a.device(), " but ", what, "[0] is on ",
                      tensors[0].device(), "; one call takes tensors of one device");
  }
}

void check_batches_writable(const std::vector<at::Tensor>& batches) {
  for (size_t i = 0; i < batches.size(); ++i) {
    TORCH_CHECK_VALUE(at::has_internal_overlap(batches[i]) != at::MemOverlap::Yes, "batches[", i,
                      "] has elements that share memory (e.g. an expanded tensor); it is written in place");
    for (size_t j = 0; j < i; ++j) {
      if (batches[i].numel() == 0 || batches[j].numel() == 0) continue;
      const auto status = at::get_overlap_status(batches[i], batches[j]);
      TORCH_CHECK_VALUE(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, "batches[",
                        i, "] and batches[", j, "] share memory; each batch is written in place");
    }
  }
}

void dispatch(std::vector<Job>& jobs, const at::Device& device, double epsilon) {
  if (device.is_cpu()) return run_cpu(jobs, epsilon);
#ifdef BAGUA_WITH_CUDA
  if (device.is_cuda()) return run_cuda(jobs, device, epsilon);
#endif
  TORCH_CHECK_VALUE(false, "the tensors are on ", device, ", which this build does not support (",
#ifdef BAGUA_WITH_CUDA
                    "cpu or cuda"
#else
                    "cpu only"
#endif
                    ")");
}

std::vector<at::Tensor> orthogonalize(const std::vector<at::Tensor>& matrices, double epsilon) {
  check_epsilon(epsilon);
  check_tensors(matrices, "matrices", 2);
  if (matrices.empty()) return {};
  std::vector<at::Tensor> outputs;
  std::vector<Job> jobs;
  outputs.reserve(matrices.size());
  jobs.reserve(matrices.size());
  for (const auto& a : matrices) {
    outputs.push_back(at::empty({a.size(0), a.size(1)}, a.options().memory_format(at::MemoryFormat::Contiguous)));
    jobs.push_back(Job{describe(a, outputs.back()), a.scalar_type()});
  }
  dispatch(jobs, matrices[0].device(), epsilon);
  return outputs;
}

void orthogonalize_batches_(const std::vector<at::Tensor>& batches, double epsilon) {
  check_epsilon(epsilon);
  check_tensors(batches, "batches", 3);
  check_batches_writable(batches);
  if (batches.empty()) return;
  std::vector<Job> jobs;
  for (const auto& batch : batches) {
    for (int64_t j = 0; j < batch.size(0); ++j) jobs.push_back(Job{describe_in_place(batch, j), batch.scalar_type()});
  }
  if (jobs.empty()) return;
  dispatch(jobs, batches[0].device(), epsilon);
}

// PowerSGD's fused CPU passes: e and g (n x m) and qt (r x m) contiguous, p (n x r),
// one floating dtype of float32/float64, all on the CPU; an operand the pass writes
// (`written`: e and p when forming, e and g in the update) shares no memory with another.
using Operand = std::pair<const char*, const at::Tensor*>;

// Whether the bytes from a's first to its last element and b's meet (any strides, so
// also two interleaved views: the passes take plain matrices, a conservative test is enough).
bool byte_ranges_meet(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto range = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(first, first + static_cast<uintptr_t>((last + 1) * t.element_size()));
  };
  const auto [a_first, a_end] = range(a);
  const auto [b_first, b_end] = range(b);
  return a_first < b_end && b_first < a_end;
}

// The operands of a fused pass: `matrices` n x m (the first names the shape and dtype),
// p n x r, qt r x m; those named in `written` share no memory with any other.
void check_powersgd_operands(std::initializer_list<Operand> matrices, const at::Tensor& p, const at::Tensor& qt,
                             std::initializer_list<const char*> written) {
  std::vector<Operand> operands(matrices);
  operands.push_back({"p", &p});
  operands.push_back({"qt", &qt});
  const auto& [first_name, first] = operands.front();
  for (const auto& [name, t] : operands) {
    TORCH_CHECK_VALUE(t->defined() && t->dim() == 2, name, " must be a 2-D tensor, got ",
                      t->defined() ? std::to_string(t->dim()) + "-D" : std::string("an undefined"), " tensor");
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be on the CPU, got a tensor on ", t->device());
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble, name,
                      " must be float32 or float64, got ", python_dtype(t->scalar_type()));
    TORCH_CHECK_VALUE(t->scalar_type() == first->scalar_type(), name, " must have ", first_name, "'s dtype ",
                      python_dtype(first->scalar_type()), ", got ", python_dtype(t->scalar_type()));
  }
  std::string names;  // "e, g and qt", "a and qt"
  bool contiguous = qt.is_contiguous();
  for (const auto& [name, t] : matrices) {
    names += std::string(names.empty() ? "" : ", ") + name;
    contiguous = contiguous && t->is_contiguous();
  }
  TORCH_CHECK_VALUE(contiguous, names, " and qt must be contiguous");
  for (const auto& [name, t] : matrices) {
    TORCH_CHECK_VALUE(t->sizes() == first->sizes(), name, " must have ", first_name, "'s shape ", python_shape(*first),
                      ", got ", python_shape(*t));
  }
  TORCH_CHECK_VALUE(qt.size(0) >= 1 && qt.size(1) == first->size(1), "qt must be r x m with r >= 1 and m = ",
                    first->size(1), " (", first_name, "'s columns), got shape ", python_shape(qt));
  TORCH_CHECK_VALUE(p.size(0) == first->size(0) && p.size(1) == qt.size(0), "p must be n x r = (", first->size(0), ", ",
                    qt.size(0), "), got shape ", python_shape(p));
  TORCH_CHECK_VALUE(at::has_internal_overlap(p) != at::MemOverlap::Yes, "p has elements that share memory");
  for (const char* out : written) {
    const at::Tensor& w = *std::find_if(operands.begin(), operands.end(), [&](const Operand& o) {
                             return std::string(o.first) == out;
                           })->second;
    for (const auto& [name, t] : operands) {
      if (t == &w) continue;
      TORCH_CHECK_VALUE(!byte_ranges_meet(w, *t), out, " and ", name, " share memory; ", out, " is written");
    }
  }
}

void powersgd_form_a_and_p_(const at::Tensor& e, const at::Tensor& g, const at::Tensor& qt, const at::Tensor& p,
                            double decay) {
  check_powersgd_operands({{"e", &e}, {"g", &g}}, p, qt, {"e", "p"});
  if (e.numel() == 0) return;
  powersgd_form_a_and_p_cpu(e, g, qt, p, decay);
}

void powersgd_apply_update_(const at::Tensor& e, const at::Tensor& g, const at::Tensor& p, const at::Tensor& qt) {
  check_powersgd_operands({{"e", &e}, {"g", &g}}, p, qt, {"e", "g"});
  if (e.numel() == 0) return;
  powersgd_apply_update_cpu(e, g, p, qt);
}

void powersgd_transposed_product_(const at::Tensor& a, const at::Tensor& p, const at::Tensor& qt) {
  check_powersgd_operands({{"a", &a}}, p, qt, {"qt"});
  if (qt.numel() == 0) return;
  powersgd_transposed_product_cpu(a, p, qt);
}

// The engine's gossip mix (engine_cpu.cpp): x n x d, float32 or float64, on the CPU,
// columns contiguous (its rows may be any distance apart); self_weight (n) and weight
// (n x slots) of x's dtype; neighbour (n x slots) int64 in [-1, n).
void check_vector(const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t length) {
  TORCH_CHECK_VALUE(t.defined() && t.dim() == 1 && t.size(0) == length && t.device().is_cpu() && t.is_contiguous(),
                    name, " must be a contiguous 1-D CPU tensor of ", length, " values, got ",
                    t.defined() ? "shape " + python_shape(t) + " on " + t.device().str() : std::string("none"));
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", python_dtype(dtype), ", got ",
                    python_dtype(t.scalar_type()));
}

void engine_gossip_mix_(const at::Tensor& x, const at::Tensor& self_weight, const at::Tensor& neighbour,
                        const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.defined() && x.dim() == 2, "x must be a 2-D tensor (n x d), got ",
                    x.defined() ? std::to_string(x.dim()) + "-D" : std::string("an undefined"), " tensor");
  TORCH_CHECK_VALUE(x.device().is_cpu(), "x must be on the CPU, got a tensor on ", x.device());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
                    "x must be float32 or float64, got ", python_dtype(x.scalar_type()));
  TORCH_CHECK_VALUE(x.size(1) <= 1 || x.stride(1) == 1, "x's columns must be contiguous (stride 1), got strides (",
                    x.stride(0), ", ", x.stride(1), ")");
  TORCH_CHECK_VALUE(at::has_internal_overlap(x) != at::MemOverlap::Yes, "x has elements that share memory");
  const int64_t n = x.size(0);
  check_vector("self_weight", self_weight, x.scalar_type(), n);
  TORCH_CHECK_VALUE(neighbour.defined() && neighbour.dim() == 2 && neighbour.size(0) == n &&
                        neighbour.scalar_type() == at::kLong && neighbour.device().is_cpu() &&
                        neighbour.is_contiguous(),
                    "neighbour must be a contiguous n x slots CPU tensor of torch.int64 with n = ", n, ", got ",
                    neighbour.defined() ? python_dtype(neighbour.scalar_type()) + " of shape " +
                                              python_shape(neighbour) + " on " + neighbour.device().str()
                                        : std::string("none"));
  const int64_t* j = neighbour.data_ptr<int64_t>();
  for (int64_t k = 0; k < neighbour.numel(); ++k) {
    TORCH_CHECK_VALUE(j[k] >= -1 && j[k] < n, "neighbour[", k / std::max<int64_t>(neighbour.size(1), 1), "][",
                      k % std::max<int64_t>(neighbour.size(1), 1), "] is ", j[k], "; valid: -1 (no term) to ", n - 1);
  }
  TORCH_CHECK_VALUE(weight.defined() && weight.sizes() == neighbour.sizes() && weight.is_contiguous() &&
                        weight.device().is_cpu() && weight.scalar_type() == x.scalar_type(),
                    "weight must be a contiguous CPU tensor of x's dtype and neighbour's shape ",
                    python_shape(neighbour), ", got ",
                    weight.defined() ? python_dtype(weight.scalar_type()) + " of shape " + python_shape(weight)
                                     : std::string("none"));
  for (const auto& [name, t] : {Operand{"self_weight", &self_weight}, Operand{"weight", &weight}}) {
    TORCH_CHECK_VALUE(!byte_ranges_meet(x, *t), "x and ", name, " share memory; x is written");
  }
  if (x.numel() == 0) return;
  engine_gossip_mix_cpu(x, self_weight, neighbour, weight);
}

}  // namespace

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

MatrixDesc describe_in_place(const at::Tensor& batch, int64_t index) {
  MatrixDesc d;
  void* data = static_cast<char*>(batch.data_ptr()) + index * batch.stride(0) * batch.element_size();
  d.input = data;
  d.output = data;
  d.rows = batch.size(1);
  d.cols = batch.size(2);
  d.in_row_stride = d.out_row_stride = batch.stride(1);
  d.in_col_stride = d.out_col_stride = batch.stride(2);
  d.work_offset = 0;
  return d;
}

}  // namespace bagua_householder

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Batched Householder orthogonalization (bagua-algos cuda_ext)";
  m.def("orthogonalize", &bagua_householder::orthogonalize,
        "Q factors (orthonormal columns) of a list of m x r matrices, as new tensors", pybind11::arg("matrices"),
        pybind11::arg("epsilon"));
  m.def("orthogonalize_batches_", &bagua_householder::orthogonalize_batches_,
        "Each matrix of each b x m x r batch replaced by its Q factor, in place (one launch on CUDA)",
        pybind11::arg("batches"), pybind11::arg("epsilon"));
  m.def("powersgd_form_a_and_p_", &bagua_householder::powersgd_form_a_and_p_,
        "PowerSGD on CPU: A = G + decay E written into E and P = A Q (qt = Q^T), in one sweep of the rows",
        pybind11::arg("e"), pybind11::arg("g"), pybind11::arg("qt"), pybind11::arg("p"), pybind11::arg("decay"));
  m.def("powersgd_apply_update_", &bagua_householder::powersgd_apply_update_,
        "PowerSGD on CPU: U = P Q^T written into G and E <- E - U (qt = Q^T), in one sweep of the rows",
        pybind11::arg("e"), pybind11::arg("g"), pybind11::arg("p"), pybind11::arg("qt"));
  m.def("powersgd_transposed_product_", &bagua_householder::powersgd_transposed_product_,
        "PowerSGD on CPU: Q^T = P^T A written into qt (Q = A^T P), in blocks of columns", pybind11::arg("a"),
        pybind11::arg("p"), pybind11::arg("qt"));
  m.def("engine_gossip_mix_", &bagua_householder::engine_gossip_mix_,
        "The engine's D-PSGD mix on CPU, in place: x_i <- self_weight_i x_i + sum_k weight_ik x_{neighbour_ik} "
        "(old x on the right; slots in order; a negative neighbour adds nothing), in one sweep",
        pybind11::arg("x"), pybind11::arg("self_weight"), pybind11::arg("neighbour"), pybind11::arg("weight"));
#ifdef BAGUA_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
