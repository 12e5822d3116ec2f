#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <type_traits>

#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/tensor/cuda.hpp"
#include "diffcomm/tensor/error.hpp"
#include "tensor/cuda/device_ops.hpp"
#include "tensor/cuda/reduce_semantics.hpp"

namespace diffcomm::dist {
namespace {
// The type integer sums and products are computed in: unsigned, so they wrap
// without undefined behaviour. Floats compute in their own type.
template <class C, bool = std::is_integral_v<C>>
struct wrap_type {
  using type = C;
};
template <class C>
struct wrap_type<C, true> {
  using type = std::make_unsigned_t<C>;
};
}  // namespace

namespace {
// Elements per block of the accumulator: 512 (4 KiB of C at most) stays in
// L1 and fits a fiber stack (the last rank to arrive runs the reduction on its
// own stack; a 64 KiB stack under AddressSanitizer overflowed with a larger
// block).
constexpr std::size_t kBlock = 512;

bool overlap(const char* a, std::size_t na, const char* b, std::size_t nb) {
  return a < b + nb && b < a + na;
}

// True when writing block b of every output right after reading block b of
// every input is safe: each output either starts where an input starts (in
// place: the same bytes, read before written) or overlaps no input, and
// outputs that overlap each other start at the same byte. Every range is
// `bytes` long. O((inputs + outputs) log outputs): the simulated all_reduce
// passes one output per rank, and a pairwise check was O(N^2) per call
// (8 s per 8-byte all_reduce at 16384 ranks).
bool blockwise_safe(const Tensor* outs, std::size_t n_outs, const std::vector<Tensor>& inputs,
                    std::size_t bytes) {
  if (bytes == 0) return true;
  if (n_outs == 1) {  // one output (reduce_into's usual form): no allocation
    const char* ob = static_cast<const char*>(outs[0].data_ptr());
    for (const auto& t : inputs) {
      const char* ib = static_cast<const char*>(t.data_ptr());
      if (ib != ob && overlap(ib, bytes, ob, bytes)) return false;
    }
    return true;
  }
  std::vector<const char*> starts;
  starts.reserve(n_outs);
  for (std::size_t j = 0; j < n_outs; ++j)
    starts.push_back(static_cast<const char*>(outs[j].data_ptr()));
  std::sort(starts.begin(), starts.end(), std::less<>());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  // Distinct output starts closer than `bytes`: two outputs partly overlap.
  for (std::size_t j = 1; j < starts.size(); ++j)
    if (overlap(starts[j - 1], bytes, starts[j], bytes)) return false;
  for (const auto& t : inputs) {
    const char* ib = static_cast<const char*>(t.data_ptr());
    // The nearest output starts at or above ib, and below it; any other
    // output overlapping ib would overlap one of these (checked above).
    const auto it = std::lower_bound(starts.begin(), starts.end(), ib, std::less<>());
    if (it != starts.end() && *it != ib && overlap(*it, bytes, ib, bytes)) return false;
    if (it != starts.begin() && overlap(*(it - 1), bytes, ib, bytes)) return false;
  }
  return true;
}

// Refuses inputs or outputs that do not match outs[0] (dtype, numel, CPU),
// and Avg / PremulSum on integers.
void check_cpu_operands(const Tensor* outs, std::size_t n_outs, const std::vector<Tensor>& inputs,
                        ReduceOp op) {
  const Tensor& out = outs[0];
  for (const auto& t : inputs)
    if (t.dtype() != out.dtype() || t.numel() != out.numel() || !t.device().is_cpu())
      raise("reduce_into", fmt::format("input {} does not match output {}", t.str(), out.str()));
  for (std::size_t j = 1; j < n_outs; ++j)
    if (outs[j].dtype() != out.dtype() || outs[j].numel() != out.numel() ||
        !outs[j].device().is_cpu())
      raise("reduce_into",
            fmt::format("output {} does not match output {}", outs[j].str(), out.str()));
  if ((op == ReduceOp::Avg || op == ReduceOp::PremulSum) && !is_floating(out.dtype()))
    raise("reduce_into",
          fmt::format("{} is undefined for {}", reduce_op_name(op), dtype_name(out.dtype())));
}

// The CPU rule for element type T (computed in C = compute_t<T>).
//
// Block by block: a block of the accumulator stays in L1 while every input
// streams through it once, and the result is written straight to every
// output (no N-sized scratch, no second pass). Safe whenever each output
// either is an input (same start: that block of it is read before it is
// written, and never read again) or overlaps no input, and outputs that
// overlap each other start at the same byte (they receive the same values).
// Any other overlap accumulates everything first and then writes the outputs
// one after the other, as copies from a temporary would. Order of
// combination per element is unchanged.
template <class T>
struct CpuReduction {
  using C = compute_t<T>;
  const Tensor* outs;
  std::size_t n_outs;
  const std::vector<Tensor>& inputs;
  ReduceOp op;
  bool one_block;  // at most kBlock elements: outputs written in order from the accumulator
  bool blockwise;  // block by block (else: accumulate all, then write)
  std::size_t n;

  // Writes the finished elements [b, e) of the accumulator `a` to `po`.
  void finish(T* po, const C* a, std::size_t b, std::size_t e) const {
    if (op == ReduceOp::Avg) {
      const C count = static_cast<C>(inputs.size());
      for (std::size_t i = b; i < e; ++i) po[i] = static_cast<T>(static_cast<C>(a[i - b] / count));
    } else {
      for (std::size_t i = b; i < e; ++i) po[i] = static_cast<T>(a[i - b]);
    }
  }

  // Blockwise: the first output gets the finished block, the others a copy
  // of it (skipped where an output is the same buffer).
  void write_block(const C* a, std::size_t b, std::size_t e) const {
    if (one_block) {  // every output from the accumulator, in order
      for (std::size_t j = 0; j < n_outs; ++j) finish(static_cast<T*>(outs[j].data_ptr()), a, b, e);
      return;
    }
    T* p0 = static_cast<T*>(outs[0].data_ptr());
    finish(p0, a, b, e);
    for (std::size_t j = 1; j < n_outs; ++j) {
      T* pj = static_cast<T*>(outs[j].data_ptr());
      if (pj != p0) std::memcpy(pj + b, p0 + b, (e - b) * sizeof(T));
    }
  }

  // Up to four inputs (k..k+m) folded into a[b..e) in one pass, combined one
  // after another — (((x0 op x1) op x2) op x3), the same order as one input
  // at a time — with a quarter of the accumulator loads and stores. `first`
  // maps the first input's element (PremulSum's factor) when `init`.
  template <std::size_t m, class Combine, class First>
  void pass(C* a, std::size_t b, std::size_t e, std::size_t k, bool init, Combine combine,
            First first) const {
    const T* q[4] = {};
    for (std::size_t j = 0; j < m; ++j) q[j] = static_cast<const T*>(inputs[k + j].data_ptr());
    for (std::size_t i = b; i < e; ++i) {
      C v = init ? first(static_cast<C>(q[0][i])) : combine(a[i - b], static_cast<C>(q[0][i]));
      if constexpr (m > 1) v = combine(v, static_cast<C>(q[1][i]));
      if constexpr (m > 2) v = combine(v, static_cast<C>(q[2][i]));
      if constexpr (m > 3) v = combine(v, static_cast<C>(q[3][i]));
      a[i - b] = v;
    }
  }

  // One tight loop per op (the switch stays outside the element loop).
  template <class Combine, class First>
  void fold_with(Combine combine, First first) const {
    alignas(64) C block[kBlock];
    std::vector<C> acc(blockwise ? 0 : n);
    for (std::size_t b = 0; b < n; b += kBlock) {
      const std::size_t e = std::min(n, b + kBlock);
      C* a = blockwise ? block : acc.data() + b;
      for (std::size_t k = 0; k < inputs.size();) {
        const std::size_t m = std::min<std::size_t>(4, inputs.size() - k);
        const bool init = k == 0;
        switch (m) {
          case 4: pass<4>(a, b, e, k, init, combine, first); break;
          case 3: pass<3>(a, b, e, k, init, combine, first); break;
          case 2: pass<2>(a, b, e, k, init, combine, first); break;
          default: pass<1>(a, b, e, k, init, combine, first); break;
        }
        k += m;
      }
      if (blockwise) write_block(a, b, e);
    }
    if (!blockwise)
      for (std::size_t j = 0; j < n_outs; ++j)
        for (std::size_t b = 0; b < n; b += kBlock)
          finish(static_cast<T*>(outs[j].data_ptr()), acc.data() + b, b, std::min(n, b + kBlock));
  }
  template <class Combine>
  void fold(Combine combine) const {
    fold_with(combine, [](C v) { return v; });
  }

  // Integers wrap around (two's complement, as NCCL and MPI do), computed
  // in the unsigned type so no signed overflow (undefined) happens.
  // Max/Min propagate NaN whatever the order contributions arrive in
  // (IEEE maximum/minimum, torch.maximum): `x != x` is true only for NaN.
  void run() const {
    using U = typename wrap_type<C>::type;
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        fold([](C a, C v) { return static_cast<C>(static_cast<U>(a) + static_cast<U>(v)); });
        break;
      case ReduceOp::PremulSum:
        // Σ (factor · x_s), as NCCL's PreMulSum: each product rounded in C.
        if constexpr (std::is_floating_point_v<C>) {
          const auto f = static_cast<C>(op.factor());
          fold_with([f](C a, C v) { return static_cast<C>(a + static_cast<C>(f * v)); },
                    [f](C v) { return static_cast<C>(f * v); });
        }
        break;
      case ReduceOp::Product:
        fold([](C a, C v) { return static_cast<C>(static_cast<U>(a) * static_cast<U>(v)); });
        break;
      // The first NaN in rank order wins (bit-identical NaN payloads on every
      // backend); otherwise the earlier input wins ties.
      case ReduceOp::Min:
        fold([](C a, C v) { return (a != a) ? a : (v < a || v != v) ? v : a; });
        break;
      case ReduceOp::Max:
        fold([](C a, C v) { return (a != a) ? a : (a < v || v != v) ? v : a; });
        break;
    }
  }
};

// The CPU rule, written to outs[0..n_outs) (see reduce_op.hpp).
void reduce_cpu(const Tensor* outs, std::size_t n_outs, const std::vector<Tensor>& inputs,
                ReduceOp op) {
  check_cpu_operands(outs, n_outs, inputs, op);
  const Tensor& out = outs[0];
  // A tensor of at most kBlock elements is one block: every input is read
  // into the accumulator before any output is written, and the outputs are
  // then written from it one after the other, which is the non-blockwise
  // rule. No overlap can change that result, so small reductions (an
  // 8-byte all_reduce over N ranks) skip the O(N log N) check. Otherwise
  // decided before the block is on the stack (it may allocate).
  const bool one_block = static_cast<std::size_t>(out.numel()) <= kBlock;
  const bool blockwise = one_block || blockwise_safe(outs, n_outs, inputs, out.nbytes());
  dispatch_dtype(out.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    CpuReduction<T>{
        outs, n_outs, inputs, op, one_block, blockwise, static_cast<std::size_t>(out.numel())}
        .run();
  });
}
}  // namespace

void reduce_into(const Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op) {
  if (inputs.empty()) raise("reduce_into", "no inputs");
  if (out.device().is_cuda()) {
    // The same per-element rule on the device (src/tensor/cuda/reduce_semantics.hpp),
    // on the caller's current stream.
    for (const auto& t : inputs)
      if (t.dtype() != out.dtype() || t.numel() != out.numel() || t.device() != out.device())
        raise("reduce_into", fmt::format("input {} does not match output {}", t.str(), out.str()));
    if ((op == ReduceOp::Avg || op == ReduceOp::PremulSum) && !is_floating(out.dtype()))
      raise("reduce_into_device",
            fmt::format("{} is undefined for {}", reduce_op_name(op), dtype_name(out.dtype())));
    detail::reduce_into_device(out, inputs, static_cast<int>(op.kind()), op.factor(),
                               cuda::current_stream(out.device().index));
    return;
  }
  reduce_cpu(&out, 1, inputs, op);
}

void reduce_into(const std::vector<Tensor>& outs, const std::vector<Tensor>& inputs, ReduceOp op) {
  if (inputs.empty()) raise("reduce_into", "no inputs");
  if (outs.empty()) raise("reduce_into", "no outputs");
  for (const auto& t : outs)
    if (!t.device().is_cpu())
      raise("reduce_into",
            fmt::format("output {} is not a CPU tensor (one output on devices)", t.str()));
  reduce_cpu(outs.data(), outs.size(), inputs, op);
}

}  // namespace diffcomm::dist

// The device kernels (src/tensor/cuda/device_ops.cu) take ReduceOp's kind as a
// number: these keep the two numberings equal.
static_assert(static_cast<int>(diffcomm::dist::ReduceOp::Sum) ==
              static_cast<int>(diffcomm::detail::rs::Op::Sum));
static_assert(static_cast<int>(diffcomm::dist::ReduceOp::Avg) ==
              static_cast<int>(diffcomm::detail::rs::Op::Avg));
static_assert(static_cast<int>(diffcomm::dist::ReduceOp::Product) ==
              static_cast<int>(diffcomm::detail::rs::Op::Product));
static_assert(static_cast<int>(diffcomm::dist::ReduceOp::Min) ==
              static_cast<int>(diffcomm::detail::rs::Op::Min));
static_assert(static_cast<int>(diffcomm::dist::ReduceOp::Max) ==
              static_cast<int>(diffcomm::detail::rs::Op::Max));
static_assert(static_cast<int>(diffcomm::dist::ReduceOp::PremulSum) ==
              static_cast<int>(diffcomm::detail::rs::Op::PremulSum));
