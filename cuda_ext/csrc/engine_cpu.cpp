// The one-process engine's D-PSGD mix on the stacked state ([n, d]: row i is worker i's
// parameters) as one sweep, in place (bagua_algos/engine/gossip.py's StackedMix, the engine's neighbour allreduce
// behind Gossip, calls it for the decentralized op on the engine's stacked rows, where this module is loaded):
//
//   x_i <- w_i x_i + sum_k w_ik x_{j_ik}      (the old x on the right; slots k in order)
//
// In torch the mix is one pass over [n, d] a term (a ring: a product and two
// multiply-adds) into a second matrix. At 64 workers and a small model the step is
// memory-bound on one thread and x is no longer in cache when the mix runs, so each
// line of the second matrix is read before it is written. Here the columns go in blocks:
// a block of every row is copied to a scratch that stays in the L2 cache, then each row
// of the block is written from it, the sum of its terms kept in registers. x crosses the
// memory bus once each way. Measured: the hooks of a 64-worker ring step take 0.7-0.8x
// the torch passes' time (docs/benchmarks.md, "The one-process engine", comm).
//
// Every sum keeps the torch passes' order of terms (the self term, then the slots) and its
// roundings: the self term is a product, each slot one fused multiply-add, as torch's
// mul and addcmul_ on a CPU with AVX2 + FMA. On such a CPU the results equal the torch
// passes' bit for bit (tests/test_engine_cpu_passes.py).
#include "engine_cpu.h"
#include "vectors.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

// a + x * w as one fused multiply-add where the instruction set has one, as torch's
// addcmul_ (ISO C++ modes turn contraction off by default).
#pragma GCC optimize("fp-contract=fast")

namespace bagua_householder {
namespace {

// Bytes of a block's scratch (n rows of the block): a quarter of a 1 MB L2 cache, so that
// the block's rows of x stay there too (128 KB to 512 KB measured the same).
constexpr int64_t kScratchBytes = int64_t{256} << 10;

using vectors::kLanes;
using vectors::load;
using vectors::store;
using vectors::Vec;

// One row of a block: out = w_self * self + sum_k w_k * scratch_{j_k} (a negative j_k adds
// nothing), 4 vectors at a time with their sums in registers: one load a term, one store.
template <typename T>
__attribute__((always_inline)) inline void mix_row(T* __restrict out, const T* self, T w_self, const T* scratch,
                                                   int64_t block, const int64_t* neighbour, const T* weight,
                                                   int64_t slots, int64_t count) {
  constexpr int64_t L = kLanes<T>;
  int64_t c = 0;
  for (; c + 4 * L <= count; c += 4 * L) {
    Vec<T> a0 = load<T>(self + c) * w_self, a1 = load<T>(self + c + L) * w_self;
    Vec<T> a2 = load<T>(self + c + 2 * L) * w_self, a3 = load<T>(self + c + 3 * L) * w_self;
    for (int64_t k = 0; k < slots; ++k) {
      const int64_t j = neighbour[k];
      if (j < 0) continue;
      const T* s = scratch + j * block + c;
      const T w = weight[k];
      a0 = a0 + load<T>(s) * w;
      a1 = a1 + load<T>(s + L) * w;
      a2 = a2 + load<T>(s + 2 * L) * w;
      a3 = a3 + load<T>(s + 3 * L) * w;
    }
    store<T>(out + c, a0);
    store<T>(out + c + L, a1);
    store<T>(out + c + 2 * L, a2);
    store<T>(out + c + 3 * L, a3);
  }
  for (; c < count; ++c) {
    T a = self[c] * w_self;
    for (int64_t k = 0; k < slots; ++k) {
      if (neighbour[k] >= 0) a = a + scratch[neighbour[k] * block + c] * weight[k];
    }
    out[c] = a;
  }
}

// Columns [c0, c1), in blocks of `block` columns: the block of every row copied to
// `scratch` (n x block), then each row of x written from it.
template <typename T>
__attribute__((always_inline)) inline void mix_columns(T* x, int64_t x_row, int64_t n, const T* self_weight,
                                                       const int64_t* neighbour, const T* weight, int64_t slots,
                                                       T* scratch, int64_t c0, int64_t c1, int64_t block) {
  for (int64_t b0 = c0; b0 < c1; b0 += block) {
    const int64_t count = std::min(block, c1 - b0);
    for (int64_t i = 0; i < n; ++i) std::memcpy(scratch + i * block, x + i * x_row + b0, count * sizeof(T));
    for (int64_t i = 0; i < n; ++i) {
      mix_row<T>(x + i * x_row + b0, scratch + i * block, self_weight[i], scratch, block, neighbour + i * slots,
                 weight + i * slots, slots, count);
    }
  }
}

template <typename T>
void mix_columns_baseline(T* x, int64_t x_row, int64_t n, const T* self_weight, const int64_t* neighbour,
                          const T* weight, int64_t slots, T* scratch, int64_t c0, int64_t c1, int64_t block) {
  mix_columns<T>(x, x_row, n, self_weight, neighbour, weight, slots, scratch, c0, c1, block);
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same loops compiled for AVX2 + FMA, taken where the CPU has them.
template <typename T>
__attribute__((target("avx2,fma"))) void mix_columns_fma(T* x, int64_t x_row, int64_t n, const T* self_weight,
                                                         const int64_t* neighbour, const T* weight, int64_t slots,
                                                         T* scratch, int64_t c0, int64_t c1, int64_t block) {
  mix_columns<T>(x, x_row, n, self_weight, neighbour, weight, slots, scratch, c0, c1, block);
}
#endif

// This thread's scratch of at least `count` values, kept between calls (a fresh
// allocation each step would be fresh pages, faulted in each time); not zeroed.
template <typename T>
T* thread_scratch(int64_t count) {
  thread_local std::vector<T> scratch;
  if (static_cast<int64_t>(scratch.size()) < count) scratch.resize(count);
  return scratch.data();
}

template <typename T>
void mix_typed(const at::Tensor& x, const at::Tensor& self_weight, const at::Tensor& neighbour,
               const at::Tensor& weight, int64_t c0, int64_t c1, int64_t block) {
  auto* kernel = &mix_columns_baseline<T>;
#if defined(__x86_64__) && defined(__GNUC__)
  if (vectors::cpu_has_fma()) kernel = &mix_columns_fma<T>;
#endif
  T* scratch = thread_scratch<T>(std::max<int64_t>(x.size(0), 1) * block);
  kernel(x.data_ptr<T>(), x.stride(0), x.size(0), self_weight.data_ptr<T>(), neighbour.data_ptr<int64_t>(),
         weight.data_ptr<T>(), neighbour.size(1), scratch, c0, c1, block);
}

}  // namespace

void engine_gossip_mix_cpu(const at::Tensor& x, const at::Tensor& self_weight, const at::Tensor& neighbour,
                           const at::Tensor& weight) {
  // columns per block: kScratchBytes of the n rows, a whole number of 32-byte vectors;
  // threads take whole blocks
  const int64_t bytes = x.element_size(), lanes = 32 / bytes, width = x.size(1);
  const int64_t block =
      std::max<int64_t>(lanes, kScratchBytes / (bytes * std::max<int64_t>(x.size(0), 1)) / lanes * lanes);
  at::parallel_for(0, (width + block - 1) / block, 1, [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * block, c1 = std::min(width, end * block);
    if (x.scalar_type() == at::kFloat) {
      mix_typed<float>(x, self_weight, neighbour, weight, c0, c1, block);
    } else {
      mix_typed<double>(x, self_weight, neighbour, weight, c0, c1, block);
    }
  });
}

}  // namespace bagua_householder
