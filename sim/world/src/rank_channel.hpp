#pragma once
// RankChannel: the baton between one ThreadedWorld rank's thread and its
// proxy fiber on the world's thread (threaded_world.hpp). Exactly one of the
// two holds it; whatever one side wrote before passing it is what the other
// reads after receiving it.
#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "baton.hpp"

namespace diffcomm::sim::detail {

class RankChannel {
 public:
  /// Rank thread: blocks until the world first hands this rank the baton;
  /// the calling thread becomes the rank's. Throws Error when the world was
  /// aborted before the rank started, or the rank already finished.
  void wait_start();
  /// Rank thread: runs `op` on the world's thread (the fiber) and blocks
  /// until it finished; rethrows what it threw. Throws InvalidArgument when
  /// this rank does not hold the baton (its world finished, or another
  /// thread's call).
  void call(const std::function<void()>& op);
  /// Rank thread: the rank function finished (failure: its message, or "").
  /// The proxy fiber then returns or throws Error(failure). Also before
  /// wait_start() (the rank never ran its function): the world then counts
  /// the rank as finished when it reaches it.
  void finish(std::string failure);
  /// Throws InvalidArgument unless the calling thread is the rank's and the
  /// rank has not finished: a group used after its rank function returned
  /// (the world may be gone) or from another thread.
  void check_usable() const;
  /// Any thread: whether the rank thread holds the baton now (running its
  /// own code, not waiting for a call or for its start).
  bool running() const;

  // World side (the proxy fiber).
  void serve();                 ///< hands the baton over and serves calls until finish()
  void abort(std::string why);  ///< wakes a rank thread that never got the baton

 private:
  enum : int { kWorld = 0, kRank = 1 };
  Baton baton_{kWorld};
  // Written by the holder of the baton only.
  const std::function<void()>* op_ = nullptr;
  std::exception_ptr op_error_;
  std::string failure_;
  // Read by running() from other threads.
  std::atomic<bool> started_{false};
  std::atomic<bool> finished_{false};
  std::atomic<bool> done_{false};  // the fiber returned: further calls are refused
  std::atomic<bool> aborted_{false};
  std::mutex start_mutex_;  // orders abort() against serve()'s start
  std::string abort_why_;
  std::atomic<std::thread::id> owner_{};  // the rank thread, from wait_start()
};

}  // namespace diffcomm::sim::detail
