#include <fmt/format.h>

#include <algorithm>
#include <type_traits>

#include "detail/device_ops.hpp"
#include "diffcomm/cuda.hpp"
#include "diffcomm/dist/reduce_op.hpp"
#include "diffcomm/error.hpp"

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

void reduce_into(const Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op) {
  if (inputs.empty()) throw InvalidArgument("reduce_into: no inputs");
  if (out.device().is_cuda()) {
    // The same per-element rule on the device (src/cuda/reduce_semantics.hpp),
    // on the caller's current stream.
    for (const auto& t : inputs)
      if (t.dtype() != out.dtype() || t.numel() != out.numel() || t.device() != out.device())
        throw InvalidArgument(
            fmt::format("reduce_into: input {} does not match output {}", t.str(), out.str()));
    detail::reduce_into_device(out, inputs, op, cuda::current_stream(out.device().index));
    return;
  }
  for (const auto& t : inputs)
    if (t.dtype() != out.dtype() || t.numel() != out.numel() || !t.device().is_cpu())
      throw InvalidArgument(
          fmt::format("reduce_into: input {} does not match output {}", t.str(), out.str()));
  if ((op == ReduceOp::Avg || op == ReduceOp::PremulSum) && !is_floating(out.dtype()))
    throw InvalidArgument(fmt::format("reduce_into: {} is undefined for {}", reduce_op_name(op),
                                      dtype_name(out.dtype())));
  dispatch_dtype(out.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    const auto n = static_cast<std::size_t>(out.numel());
    T* po = static_cast<T*>(out.data_ptr());
    // Block by block: a block of the accumulator stays in L1 while every
    // input streams through it once, and the result is written straight to
    // `out` (no N-sized scratch, no second pass). Safe whenever `out` either
    // is an input (same start: that block of it is read before it is
    // written, and never read again) or overlaps none; any other overlap
    // accumulates everything first, as the rule "out may alias an input"
    // requires. Order of combination per element is unchanged.
    constexpr std::size_t kBlock = 512;  // 4 KiB of C at most: fits a fiber stack
    const char* ob = reinterpret_cast<const char*>(po);
    const char* oe = ob + n * sizeof(T);
    bool blockwise = true;
    for (const auto& t : inputs) {
      const char* ib = static_cast<const char*>(t.data_ptr());
      if (ib != ob && ib < oe && ob < ib + n * sizeof(T)) blockwise = false;
    }
    alignas(64) C block[kBlock];
    std::vector<C> acc(blockwise ? 0 : n);
    auto finish = [&](const C* a, std::size_t b, std::size_t e) {
      if (op == ReduceOp::Avg) {
        const C count = static_cast<C>(inputs.size());
        for (std::size_t i = b; i < e; ++i)
          po[i] = static_cast<T>(static_cast<C>(a[i - b] / count));
      } else {
        for (std::size_t i = b; i < e; ++i) po[i] = static_cast<T>(a[i - b]);
      }
    };
    // One tight loop per op (the switch stays outside the element loop);
    // `first` maps the first input's element (PremulSum's factor).
    auto fold_with = [&](auto combine, auto first) {
      for (std::size_t b = 0; b < n; b += kBlock) {
        const std::size_t e = std::min(n, b + kBlock);
        C* a = blockwise ? block : acc.data() + b;
        const T* p0 = static_cast<const T*>(inputs[0].data_ptr());
        for (std::size_t i = b; i < e; ++i) a[i - b] = first(static_cast<C>(p0[i]));
        for (std::size_t k = 1; k < inputs.size(); ++k) {
          const T* p = static_cast<const T*>(inputs[k].data_ptr());
          for (std::size_t i = b; i < e; ++i) a[i - b] = combine(a[i - b], static_cast<C>(p[i]));
        }
        if (blockwise) finish(a, b, e);
      }
      if (!blockwise)
        for (std::size_t b = 0; b < n; b += kBlock)
          finish(acc.data() + b, b, std::min(n, b + kBlock));
    };
    auto fold = [&](auto combine) { fold_with(combine, [](C v) { return v; }); };
    // Integers wrap around (two's complement, as NCCL and MPI do), computed
    // in the unsigned type so no signed overflow (undefined) happens.
    // Max/Min propagate NaN whatever the order contributions arrive in
    // (IEEE maximum/minimum, torch.maximum): `x != x` is true only for NaN.
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
  });
}

}  // namespace diffcomm::dist
