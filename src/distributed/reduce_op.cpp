// ReduceOp (reduce_op.hpp): PremulSum's factor check and the op names.
#include "diffcomm/distributed/reduce_op.hpp"

#include <fmt/format.h>

#include <cmath>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

ReduceOp ReduceOp::premul_sum(double factor) {
  if (!std::isfinite(factor))
    raise("ReduceOp::premul_sum", fmt::format("factor {} is not finite", factor));
  ReduceOp op(PremulSum);
  op.factor_ = factor;
  return op;
}

std::string reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::PremulSum: return fmt::format("premul_sum({})", op.factor());
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Product: return "product";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

}  // namespace diffcomm::dist
