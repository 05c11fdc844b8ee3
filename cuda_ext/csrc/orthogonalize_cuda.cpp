// CUDA path, host side (inputs checked in bindings.cpp): one reusable device workspace per (device, stream),
// the descriptors copied in one asynchronous transfer, one kernel launch per dtype
// present (one launch in all for the usual single-dtype call).
#include "orthogonalize.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "orthogonalize_kernel.h"

namespace bagua_householder {
namespace {

constexpr int64_t kAlign = 256;
// Dynamic shared memory a block may use without opting in (48 KiB), less room for
// the kernel's static reduction slots.
constexpr int64_t kSharedWorkLimit = 48 * 1024 - 1024;

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

DType dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: TORCH_CHECK(false, "unreachable dtype ", t);
  }
}

// The workspace of one (device, stream): grown when a call needs more, never freed.
// Kernels on one stream run in order, so a call may reuse the bytes of the last one;
// a new allocation on growth is stream-ordered by the caching allocator.
at::Tensor workspace_for(const at::Device& device, const c10::cuda::CUDAStream& stream, int64_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, int64_t>, at::Tensor> cache;
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& ws = cache[{device.index(), static_cast<int64_t>(stream.id())}];
  if (!ws.defined() || ws.numel() < bytes) {
    const int64_t grown = ws.defined() ? std::max(bytes, 2 * ws.numel()) : bytes;
    ws = at::empty({grown}, at::TensorOptions().dtype(at::kByte).device(device));
  }
  return ws;
}

struct Group {
  at::ScalarType dtype;
  std::vector<int64_t> members;
  int64_t max_rows = 0;
  int64_t max_work = 0;  // elements
  int64_t work_total = 0;  // elements
  int64_t desc_offset = 0;  // bytes into the workspace
  int64_t work_offset = 0;  // bytes into the workspace
  bool shared = false;
};

}  // namespace

void run_cuda(std::vector<Job>& jobs, const at::Device& device, double epsilon) {
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());

  // Group by dtype (one kernel instantiation each), keeping the call's order inside.
  std::vector<Group> groups;
  for (int64_t i = 0; i < static_cast<int64_t>(jobs.size()); ++i) {
    const at::ScalarType t = jobs[i].dtype;
    Group* g = nullptr;
    for (auto& candidate : groups) if (candidate.dtype == t) g = &candidate;
    if (g == nullptr) {
      groups.push_back(Group{t});
      g = &groups.back();
    }
    g->members.push_back(i);
  }
  int64_t bytes = 0;
  std::vector<MatrixDesc> packed;
  for (auto& g : groups) {
    const int64_t acc_size = g.dtype == at::kDouble ? 8 : 4;
    g.desc_offset = bytes;
    for (int64_t i : g.members) {
      MatrixDesc d = jobs[i].desc;
      d.work_offset = g.work_total;
      g.work_total += d.rows * d.cols;
      g.max_work = std::max(g.max_work, d.rows * d.cols);
      g.max_rows = std::max(g.max_rows, d.rows);
      packed.push_back(d);
    }
    bytes = align_up(bytes + static_cast<int64_t>(g.members.size() * sizeof(MatrixDesc)));
    g.shared = g.max_work * acc_size <= kSharedWorkLimit;
    g.work_offset = bytes;
    if (!g.shared) bytes = align_up(bytes + g.work_total * acc_size);
  }
  if (packed.empty() || bytes == 0) return;

  // Descriptors: staged in pinned memory from torch's caching host allocator and copied
  // without blocking; the allocator keeps the pinned block until the copy has run.
  at::Tensor ws = workspace_for(device, stream, bytes);
  at::Tensor staging = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  unsigned char* host = staging.data_ptr<unsigned char>();
  size_t k = 0;
  for (auto& g : groups) {
    std::memcpy(host + g.desc_offset, packed.data() + k, g.members.size() * sizeof(MatrixDesc));
    k += g.members.size();
  }
  ws.narrow(0, 0, bytes).copy_(staging, /*non_blocking=*/true);

  unsigned char* base = ws.data_ptr<unsigned char>();
  for (auto& g : groups) {
    const int64_t acc_size = g.dtype == at::kDouble ? 8 : 4;
    LaunchPlan plan;
    plan.descs = reinterpret_cast<const MatrixDesc*>(base + g.desc_offset);
    plan.count = static_cast<int>(g.members.size());
    plan.threads = threads_for_rows(g.max_rows);
    plan.shared_bytes = g.shared ? static_cast<size_t>(g.max_work * acc_size) : 0;
    plan.global_work = g.shared ? nullptr : base + g.work_offset;
    plan.epsilon = epsilon;
    if (g.max_work == 0) continue;  // only empty matrices: nothing to write
    const char* error = launch_orthogonalize(dtype_code(g.dtype), plan, stream.stream());
    TORCH_CHECK(error == nullptr, "cuda_ext orthogonalize: kernel launch failed: ", error);
  }
}

}  // namespace bagua_householder
