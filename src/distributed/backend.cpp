// Backend::run: the one dispatch from a Call's op to its primitive.
#include "diffcomm/distributed/backend.hpp"

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

void Backend::run(Call& c) {
  switch (c.op) {
    case OpType::Barrier: return barrier(c);
    case OpType::AllReduce: return all_reduce(c);
    case OpType::Broadcast: return broadcast(c);
    case OpType::Reduce: return reduce(c);
    case OpType::AllGather: return all_gather(c);
    case OpType::AllGatherSingle: return all_gather_single(c);
    case OpType::AllGatherV: return all_gather_v(c);
    case OpType::Gather: return gather(c);
    case OpType::Scatter: return scatter(c);
    case OpType::ReduceScatter: return reduce_scatter(c);
    case OpType::ReduceScatterSingle: return reduce_scatter_single(c);
    case OpType::ReduceScatterV: return reduce_scatter_v(c);
    case OpType::AllToAll: return all_to_all(c);
    case OpType::AllToAllSingle: return all_to_all_single(c);
    case OpType::Send: return send(c);
    case OpType::Recv: return recv(c);
    case OpType::NewGroup: break;
  }
  raise(c.site(), "Backend::run cannot run new_group (it returns a backend): call Backend::split");
}

}  // namespace diffcomm::dist
