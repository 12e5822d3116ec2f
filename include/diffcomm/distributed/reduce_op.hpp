#pragma once
// Reduction operators of all_reduce, reduce and reduce_scatter.
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::dist {

/// A reduction: one of the kinds below, plus the factor of PremulSum.
/// Follows torch.distributed.ReduceOp / ncclRedOp_t: `ReduceOp::Sum` etc. are
/// the kinds, a ReduceOp is implicitly constructible from a kind (so
/// `all_reduce(g, t, ReduceOp::Max)` reads as in torch) and converts back to
/// its kind (so `switch (op)` works); `ReduceOp::premul_sum(0.5)` is torch's
/// `_make_nccl_premul_sum(0.5)`.
///
/// Semantics (every backend, through dist::reduce_into):
///  - Sum, Product: integers wrap around (two's complement), as NCCL and MPI.
///  - Avg: the sum divided by the member count, rounded once; refused
///    (InvalidArgument) for integer dtypes.
///  - Min, Max: NaN propagates (IEEE maximum/minimum, torch.maximum): the
///    first NaN in group-rank order is the result, whichever rank holds it.
///  - PremulSum: factor x sum, computed as NCCL does, Σ_s (factor · x_s)
///    (each product rounded in the accumulation type); floating dtypes only.
/// Sum, Avg and PremulSum are linear (exact adjoints in nn::). Product, Min
/// and Max are not: nn:: gives their true gradient on all_reduce and reduce
/// and refuses them elsewhere.
class ReduceOp {
 public:
  /// The kinds, numbered as the device kernels expect (do not reorder).
  enum Kind : uint8_t { Sum = 0, Avg = 1, Product = 2, Min = 3, Max = 4, PremulSum = 5 };

  /// Sum.
  constexpr ReduceOp() = default;
  /// The reduction of kind `kind` (PremulSum gets factor 1; prefer
  /// premul_sum()).
  constexpr ReduceOp(Kind kind) : kind_(kind) {}  // NOLINT: implicit, as torch's ReduceOp
  /// factor x sum (torch's _make_nccl_premul_sum, NCCL's
  /// ncclRedOpCreatePreMulSum). Throws InvalidArgument for a non-finite
  /// factor.
  static ReduceOp premul_sum(double factor);

  /// The kind (implicit, so a ReduceOp can be switched on like the enum).
  constexpr operator Kind() const { return kind_; }  // NOLINT: implicit by design
  /// The kind.
  constexpr Kind kind() const { return kind_; }
  /// PremulSum's factor; 1 for every other kind.
  constexpr double factor() const { return factor_; }

  /// Same kind and factor.
  friend constexpr bool operator==(ReduceOp a, ReduceOp b) {
    return a.kind_ == b.kind_ && a.factor_ == b.factor_;
  }
  /// Whether `a` is of kind `k` (any factor): `op == ReduceOp::PremulSum`.
  friend constexpr bool operator==(ReduceOp a, Kind k) { return a.kind_ == k; }

 private:
  Kind kind_ = Sum;
  double factor_ = 1.0;
};

/// "sum", "avg", "product", "min", "max", "premul_sum(0.5)".
std::string reduce_op_name(ReduceOp op);

/// out <- inputs[0] op inputs[1] op ... elementwise, combined in list order
/// (so a backend that lists contributions by group rank is bit-reproducible).
/// bfloat16/float16 accumulate in float32, other dtypes in their own type; Avg
/// is the sum divided by inputs.size(), then rounded once; PremulSum is
/// Σ (factor · input) in list order, then rounded once. Integers wrap around
/// (two's complement). Max/Min propagate NaN: the first NaN in list order
/// wins; ties keep the earlier input. out may alias an input. Tensors of one
/// dtype, numel and device (CPU, or CUDA on the current stream with the
/// bit-identical device rule); throws InvalidArgument otherwise or for
/// Avg/PremulSum on integers. This is THE reduction of every backend (sim
/// directly; MPI and NCCL through dist/backend/composed.hpp).
void reduce_into(const Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op);

/// The same reduction written to every tensor of `outs` (CPU only): the
/// result is as if reduced into a temporary and then copied to outs[0],
/// outs[1], ... in list order. Why: an in-process all_reduce (the simulated
/// world) then reads each input block and writes each output block once,
/// block by block while the block is hot, instead of reducing into one
/// buffer and copying it N - 1 times. Each output may be an input (same
/// start: in place); any other overlap takes a slower path with the same
/// result. Throws InvalidArgument as reduce_into does.
void reduce_into(const std::vector<Tensor>& outs, const std::vector<Tensor>& inputs, ReduceOp op);

}  // namespace diffcomm::dist
