#include <fmt/format.h>

#include <algorithm>

#include "diffcomm/dist/reduce_op.hpp"
#include "diffcomm/error.hpp"

namespace diffcomm::dist {

void reduce_into(const Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op) {
  if (inputs.empty()) throw InvalidArgument("reduce_into: no inputs");
  for (const auto& t : inputs)
    if (t.dtype() != out.dtype() || t.numel() != out.numel() || !t.device().is_cpu())
      throw InvalidArgument(
          fmt::format("reduce_into: input {} does not match output {}", t.str(), out.str()));
  if (op == ReduceOp::Avg && !is_floating(out.dtype()))
    throw InvalidArgument(
        fmt::format("reduce_into: avg is undefined for {}", dtype_name(out.dtype())));
  dispatch_dtype(out.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    const int64_t n = out.numel();
    std::vector<C> acc(static_cast<std::size_t>(n));
    const T* p0 = static_cast<const T*>(inputs[0].data_ptr());
    for (int64_t i = 0; i < n; ++i) acc[static_cast<std::size_t>(i)] = static_cast<C>(p0[i]);
    for (std::size_t k = 1; k < inputs.size(); ++k) {
      const T* p = static_cast<const T*>(inputs[k].data_ptr());
      for (int64_t i = 0; i < n; ++i) {
        C& a = acc[static_cast<std::size_t>(i)];
        const C v = static_cast<C>(p[i]);
        switch (op) {
          case ReduceOp::Sum:
          case ReduceOp::Avg: a = static_cast<C>(a + v); break;
          case ReduceOp::Product: a = static_cast<C>(a * v); break;
          case ReduceOp::Min: a = std::min(a, v); break;
          case ReduceOp::Max: a = std::max(a, v); break;
        }
      }
    }
    T* po = static_cast<T*>(out.data_ptr());
    const C count = static_cast<C>(inputs.size());
    for (int64_t i = 0; i < n; ++i) {
      C a = acc[static_cast<std::size_t>(i)];
      if (op == ReduceOp::Avg) a = static_cast<C>(a / count);
      po[i] = static_cast<T>(a);
    }
  });
}

}  // namespace diffcomm::dist
