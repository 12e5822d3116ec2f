// The canonical column-parallel linear (header:
// include/diffcomm/nn/canonical_linear.hpp).
#include "diffcomm/nn/canonical_linear.hpp"

#include <fmt/format.h>

#include <cstring>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"
#include "nn/canonical_tree.hpp"
#include "nn/nn_site.hpp"

namespace diffcomm::nn {
namespace {

constexpr const char* kOp = "canonical_column_parallel_linear";

// Columns [c0, c0 + w) of a row-major [R, cols] tensor, as [R, w].
Tensor columns(const Tensor& t, int64_t c0, int64_t w) {
  const int64_t R = t.size(0), cols = t.size(1);
  const auto esize = static_cast<int64_t>(element_size(t.dtype()));
  Tensor out = empty({R, w}, t.dtype(), t.device());
  const auto* src = static_cast<const char*>(t.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(dst + r * w * esize, src + (r * cols + c0) * esize,
                static_cast<std::size_t>(w * esize));
  return out;
}

// [blocks, R * in]: block b's dy[:, b*w, (b+1)*w) A[:, same]^T, one matmul
// each (so the block's columns are summed in order, as matmul sums).
Tensor column_block_partials(const Tensor& dy, const Tensor& weight, int64_t w) {
  const int64_t blocks = weight.size(1) / w, R = dy.size(0), in = weight.size(0);
  if (blocks == 1) return matmul(dy, transpose(weight)).view_as_shape({1, R * in});
  Tensor out = empty({blocks, R * in}, dy.dtype(), dy.device());
  for (int64_t b = 0; b < blocks; ++b)
    out.row_view(b, 1).copy_(matmul(columns(dy, b * w, w), transpose(columns(weight, b * w, w)))
                                 .view_as_shape({1, R * in}));
  return out;
}

struct CanonicalColumnLinearFn : Function<CanonicalColumnLinearFn> {
  static constexpr const char* kName = "CanonicalColumnParallelLinearBackward";
  dist::Caller caller;
  ProcessGroup group;
  bool sp = false;
  int64_t block_cols = 1;
  bool weight_grad = false;  // forward sees detached inputs: told by the caller
  std::function<Tensor(int64_t, int64_t)> dx_addend;
  Tensor weight;  // data: the backward's right operand
  Tensor x_full;  // kept only when the weight needs its gradient
  int64_t x_rows = 0;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    Tensor x = in[0];
    x_rows = x.size(0);
    if (sp) {
      Tensor gathered = empty({group.size() * x.size(0), x.size(1)}, x.dtype(), x.device());
      dist::all_gather_single(group, gathered, x, caller);
      forward_call = group.last_call();
      x = gathered;
    }
    weight = in[1];
    if (weight_grad) x_full = x;
    return {matmul(x, in[1])};  // detached inputs: records nothing
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    const int64_t in = weight.size(0);
    Tensor dweight = x_full.defined() ? matmul(transpose(x_full), g[0]) : Tensor{};
    Tensor partials = column_block_partials(g[0], weight, block_cols);
    Tensor dx;
    if (sp) {
      const ProcessGroup::BackwardOf tie(group, forward_call);
      dx = detail::canonical_slice(std::move(partials), x_rows * in, {}, group, caller, nullptr)
               .view_as_shape({x_rows, in});
      if (dx_addend && x_rows * in > 0)
        dx = add(dx, dx_addend(0, x_rows * in).view_as_shape({x_rows, in}));
    } else {
      dx = detail::canonical_all_reduce_tree(std::move(partials), {}, group, caller, nullptr,
                                             dx_addend)
               .view_as_shape({x_rows, in});
    }
    return {dx, dweight};
  }
  dist::CallId forward_call{};
};

void check_args(const Tensor& x, const Tensor& weight, const ProcessGroup& group,
                int64_t block_cols) {
  const ErrorSite site = detail::nn_site(kOp, group);
  if (!x.defined() || !weight.defined() || x.dim() != 2 || weight.dim() != 2)
    raise(site, fmt::format("needs x [R, in] and weight [in, cols], got {} and {}",
                            x.defined() ? x.str() : "undefined",
                            weight.defined() ? weight.str() : "undefined"));
  if (x.size(1) != weight.size(0) || x.dtype() != weight.dtype())
    raise(site, fmt::format("x {} and weight {} must share dtype and the inner size", x.str(),
                            weight.str()));
  if (block_cols < 1 || weight.size(1) % block_cols != 0)
    raise(site, fmt::format("block_cols {} must be >= 1 and divide the weight's {} columns",
                            block_cols, weight.size(1)));
}

}  // namespace

Tensor canonical_column_parallel_linear(const Tensor& x, const Tensor& weight,
                                        const ProcessGroup& group, bool sequence_parallel,
                                        int64_t block_cols,
                                        std::function<Tensor(int64_t, int64_t)> dx_addend,
                                        dist::Caller caller) {
  check_args(x, weight, group, block_cols);
  std::vector<Tensor> outs = CanonicalColumnLinearFn{{},
                                                     caller,
                                                     group,
                                                     sequence_parallel,
                                                     block_cols,
                                                     weight.requires_grad(),
                                                     std::move(dx_addend),
                                                     {},
                                                     {},
                                                     0}
                                 .apply({x, weight});
  if (outs[0].defined() && outs[0].grad_fn()) Cohort::add(group.cohort(), outs[0].grad_fn());
  return outs[0];
}

}  // namespace diffcomm::nn
