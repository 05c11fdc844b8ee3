// CUDA path: one thread block per matrix, all matrices of one dtype in one launch.
// The block runs the per-matrix math of householder.h as a BlockTeam: reductions
// are warp shuffles plus one shared-memory stage (fixed order, fp32 or fp64), and
// the only synchronization is __syncthreads() inside the block, so blocks never wait
// for one another and need not be resident together.
//
// This file includes no torch header beyond c10's Half/BFloat16, so nvcc compiles it
// quickly on its own (the compile-only check in tests/test_cuda_ext.py).
#include <cuda_runtime.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "householder.h"
#include "orthogonalize_kernel.h"

namespace bagua_householder {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxWarps = 32;  // 1024 threads

template <typename acc_t>
struct BlockTeam {
  static constexpr int kGroupSize = kWarp;
  acc_t* reduce_slots;  // kMaxWarps + 1, shared
  acc_t* partial_slots;  // kMaxWarps, shared
  acc_t* dot_slots;  // kMaxWarps, shared
  __device__ __forceinline__ int thread() const { return threadIdx.x; }
  __device__ __forceinline__ int threads() const { return blockDim.x; }
  __device__ __forceinline__ int group() const { return threadIdx.x / kWarp; }
  __device__ __forceinline__ int groups() const { return blockDim.x / kWarp; }
  __device__ __forceinline__ int lane() const { return threadIdx.x % kWarp; }
  __device__ __forceinline__ void barrier() const { __syncthreads(); }
  __device__ __forceinline__ acc_t* partial() { return partial_slots; }
  __device__ __forceinline__ acc_t* dots() { return dot_slots; }

  template <typename Op>
  __device__ __forceinline__ acc_t warp_reduce(acc_t value, Op op) const {
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
  }
  __device__ __forceinline__ acc_t group_sum(acc_t value) const { return warp_reduce(value, SumOp()); }

  // Block-wide reduction, the result returned to every thread. Called by all threads.
  template <typename Op>
  __device__ __forceinline__ acc_t reduce(acc_t value, Op op) {
    value = warp_reduce(value, op);
    if (lane() == 0) reduce_slots[group()] = value;
    __syncthreads();
    if (group() == 0) {
      // Lanes past the last warp contribute the operation's neutral element.
      acc_t v = lane() < groups() ? reduce_slots[lane()] : Identity(op);
      v = warp_reduce(v, op);
      if (lane() == 0) reduce_slots[kMaxWarps] = v;
    }
    __syncthreads();
    return reduce_slots[kMaxWarps];
  }
  __device__ __forceinline__ static acc_t Identity(SumOp) { return acc_t(0); }
  __device__ __forceinline__ static acc_t Identity(MaxOp) { return acc_t(0); }  // reduced values are >= 0
};

// Up to 1024 threads per block (threads_for_rows): the bound makes the compiler keep
// registers within what such a block may use.
template <typename scalar_t>
__global__ void __launch_bounds__(1024) orthogonalize_kernel(const MatrixDesc* __restrict__ descs, void* global_work, int shared_work,
                                     double epsilon) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  __shared__ acc_t reduce_slots[kMaxWarps + 1];
  __shared__ acc_t partial_slots[kMaxWarps];
  __shared__ acc_t dot_slots[kMaxWarps];
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  const MatrixDesc d = descs[blockIdx.x];
  if (d.rows * d.cols == 0) return;  // uniform over the block
  acc_t* work = shared_work ? reinterpret_cast<acc_t*>(dynamic_shared)
                            : static_cast<acc_t*>(global_work) + d.work_offset;
  BlockTeam<acc_t> team{reduce_slots, partial_slots, dot_slots};
  orthogonalize_matrix<BlockTeam<acc_t>, scalar_t, acc_t>(team, d, work, static_cast<acc_t>(epsilon));
}

template <typename scalar_t>
cudaError_t launch_typed(const LaunchPlan& plan, cudaStream_t stream) {
  orthogonalize_kernel<scalar_t><<<plan.count, plan.threads, plan.shared_bytes, stream>>>(
      plan.descs, plan.global_work, plan.shared_bytes > 0 ? 1 : 0, plan.epsilon);
  return cudaGetLastError();
}

}  // namespace

int threads_for_rows(int64_t max_rows) {
  // About two rows per thread, a whole number of warps, 64 to 1024 threads.
  int threads = 64;
  while (threads < 1024 && 2 * static_cast<int64_t>(threads) < max_rows) threads *= 2;
  return threads;
}

const char* launch_orthogonalize(DType dtype, const LaunchPlan& plan, cudaStream_t stream) {
  if (plan.count == 0) return nullptr;
  cudaError_t status = cudaSuccess;
  switch (dtype) {
    case DType::Float32: status = launch_typed<float>(plan, stream); break;
    case DType::Float64: status = launch_typed<double>(plan, stream); break;
    case DType::Float16: status = launch_typed<c10::Half>(plan, stream); break;
    case DType::BFloat16: status = launch_typed<c10::BFloat16>(plan, stream); break;
    default: return "unsupported dtype code";
  }
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

}  // namespace bagua_householder
