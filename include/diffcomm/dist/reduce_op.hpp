#pragma once
// Reduction operators of all_reduce, reduce and reduce_scatter.
#include <string>
#include <vector>

#include "diffcomm/tensor.hpp"

namespace diffcomm::dist {

/// Sum and Avg are linear (exact adjoints in nn::). Product, Min and Max are
/// not: nn:: gives their true gradient on all_reduce and reduce and refuses
/// them elsewhere. Avg on integer dtypes is refused (InvalidArgument).
/// Follows torch.distributed.ReduceOp / ncclRedOp_t.
enum class ReduceOp { Sum, Avg, Product, Min, Max };

/// "sum", "avg", "product", "min", "max".
std::string reduce_op_name(ReduceOp op);

/// out <- inputs[0] op inputs[1] op ... elementwise, combined in list order
/// (so a backend that lists contributions by group rank is bit-reproducible).
/// bfloat16/float16 accumulate in float32, other dtypes in their own type; Avg
/// is the sum divided by inputs.size(), then rounded once. Integers wrap
/// around (two's complement). Max/Min propagate NaN: the first NaN in list
/// order wins; ties keep the earlier input. out may alias an input. Tensors of
/// one dtype, numel and device (CPU, or CUDA on the current stream with the
/// bit-identical device rule); throws InvalidArgument otherwise or for Avg on
/// integers. This is THE reduction of every backend (sim directly; MPI and
/// NCCL through dist/composed.hpp).
void reduce_into(const Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op);

}  // namespace diffcomm::dist
