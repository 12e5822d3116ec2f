#include "rank_channel.hpp"

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim::detail {

void RankChannel::serve() {
  {
    std::lock_guard lock(start_mutex_);
    started_ = true;
  }
  baton_.pass(kRank);
  // finish() before the rank ever waited for its start: it passed the baton
  // back before this pass, or set finished_ after the check (then its pass
  // follows this one). Both stores and this load are sequentially consistent.
  if (!finished_) baton_.wait_for(kWorld);
  while (!finished_) {
    // The world's thread runs the call; the rank thread waits. The op may
    // block this fiber in a rendezvous: other proxy fibers then run, each
    // blocking the world's thread on its own channel while its rank runs.
    const std::function<void()>* op = op_;
    op_ = nullptr;
    std::exception_ptr error;
    try {
      (*op)();
    } catch (...) {
      error = std::current_exception();
    }
    op_error_ = error;
    baton_.pass(kRank);
    baton_.wait_for(kWorld);
  }
  done_ = true;
  if (!failure_.empty()) throw Error(failure_);
}

void RankChannel::abort(std::string why) {
  std::lock_guard lock(start_mutex_);
  if (started_) return;
  abort_why_ = std::move(why);
  aborted_ = true;
  baton_.pass(kRank);
}

void RankChannel::wait_start() {
  if (finished_ || owner_.load() != std::thread::id{})
    raise<Error>("diffcomm.sim", "this rank already started (start() is called once per rank)");
  owner_ = std::this_thread::get_id();
  baton_.wait_for(kRank);
  if (aborted_) throw Error(abort_why_);
}

void RankChannel::check_usable() const {
  if (done_ || finished_ || aborted_)
    raise("diffcomm.sim",
          "this rank's simulated world has finished (a group from sim.run was used "
          "after its rank function returned)");
  if (owner_.load() != std::this_thread::get_id())
    raise("diffcomm.sim",
          "a rank's group was used from a thread that is not the rank's (each rank "
          "of sim.run / ThreadedWorld calls diffcomm from its own thread only)");
}

void RankChannel::call(const std::function<void()>& op) {
  check_usable();
  op_ = &op;
  baton_.pass(kWorld);
  baton_.wait_for(kRank);
  if (op_error_) {
    std::exception_ptr e = op_error_;
    op_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void RankChannel::finish(std::string failure) {
  if (aborted_) return;  // the world never started this rank
  failure_ = std::move(failure);
  finished_ = true;
  baton_.pass(kWorld);
}

bool RankChannel::running() const {
  return started_ && baton_.holder() == kRank && !finished_ && !aborted_;
}

}  // namespace diffcomm::sim::detail
