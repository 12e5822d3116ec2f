#pragma once
// Pinning the calling thread to one CPU and undoing it: the threads of a
// ThreadedWorld share one CPU (CpuPlacement::OneCpu, threaded_world.hpp).
// Linux only (sched_getcpu, pthread_setaffinity_np); elsewhere nothing is
// pinned (and no Linux type is named outside the guards).
#if defined(__linux__)
#include <sched.h>
#endif

namespace diffcomm::sim::detail {

/// The CPU the calling thread runs on now, or -1 when unknown.
int current_cpu();

/// One thread's pinning: pin() on the thread, restore() later on the same
/// thread. Not thread-safe; each thread owns its own CpuPin.
class CpuPin {
 public:
  /// Pins the calling thread to `cpu`, remembering its CPU set. Returns
  /// false (and changes nothing) when cpu < 0 or the OS refuses (a CPU
  /// outside the thread's cpuset).
  bool pin(int cpu);
  /// Gives the thread its remembered CPU set back; no-op when not pinned.
  void restore();

 private:
  bool pinned_ = false;
#if defined(__linux__)
  cpu_set_t saved_{};  // the CPU set before pin()
#endif
};

/// A CpuPin for one scope of the calling thread.
class ScopedCpuPin {
 public:
  explicit ScopedCpuPin(int cpu) { pin_.pin(cpu); }
  ~ScopedCpuPin() { pin_.restore(); }
  ScopedCpuPin(const ScopedCpuPin&) = delete;
  ScopedCpuPin& operator=(const ScopedCpuPin&) = delete;

 private:
  CpuPin pin_;
};

}  // namespace diffcomm::sim::detail
