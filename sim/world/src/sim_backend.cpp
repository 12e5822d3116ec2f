// SimBackend: the dist::Backend of the simulated world.
#include "sim_backend.hpp"

#include <fmt/format.h>

#include <boost/fiber/all.hpp>

#include "diffcomm/tensor/error.hpp"
#include "scheduler.hpp"
#include "world_impl.hpp"

namespace diffcomm::sim::detail {

using dist::Call;

void SimBackend::check_caller(const Call& call) const {
  const int owner = group_->members[static_cast<std::size_t>(slot_)];
  // ErrorSite writes no global rank inside the parenthesis: the op carries it.
  if (!*running_)
    raise(fmt::format("{} on group '{}' (sim backend, global rank {})", dist::op_name(call.op),
                      call.group, owner),
          "this group handle belongs to a sim::World run that has finished, or to a World that "
          "was destroyed; a handle lives only for the run() whose rank function obtained it");
  const auto* props =
      static_cast<const FiberProps*>(boost::fibers::context::active()->get_properties());
  const int caller = props != nullptr ? props->rank : -1;
  if (caller != owner)
    raise({.op = dist::op_name(call.op), .group = std::string(call.group), .backend = "sim"},
          fmt::format("called from {}, but this handle is global rank {}'s (group rank {} of {}); "
                      "a group handle is per rank: every member calls through the handle its "
                      "own rank function obtained, and non-members cannot call",
                      caller >= 0 ? fmt::format("global rank {}", caller)
                                  : std::string("outside the ranks"),
                      owner, slot_, group_->members.size()));
}

std::shared_ptr<dist::Backend> SimBackend::split(Call& call, int, int) {
  return world_->split(group_, slot_, call);
}
void SimBackend::barrier(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::all_reduce(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::broadcast(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::reduce(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::all_gather(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::all_gather_single(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::all_gather_v(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::gather(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::scatter(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::reduce_scatter(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::reduce_scatter_single(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::reduce_scatter_v(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::all_to_all(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::all_to_all_single(Call& c) { world_->collective(group_, slot_, c); }
void SimBackend::send(Call& c) { world_->point_to_point(group_, slot_, c, p2p_counters_); }
void SimBackend::recv(Call& c) { world_->point_to_point(group_, slot_, c, p2p_counters_); }

}  // namespace diffcomm::sim::detail
