#include "cpu_pin.hpp"

#include <pthread.h>

namespace diffcomm::sim::detail {

int current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

bool CpuPin::pin(int cpu) {
#if defined(__linux__)
  if (cpu < 0 || cpu >= CPU_SETSIZE || pinned_) return false;
  const pthread_t self = pthread_self();
  if (pthread_getaffinity_np(self, sizeof(saved_), &saved_) != 0) return false;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (pthread_setaffinity_np(self, sizeof(one), &one) != 0) return false;
  pinned_ = true;
  return true;
#else
  (void)cpu;
  return false;
#endif
}

void CpuPin::restore() {
#if defined(__linux__)
  if (!pinned_) return;
  // A failure leaves the thread on its one CPU: nothing more can be done,
  // and the thread still runs correctly.
  (void)pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
  pinned_ = false;
#endif
}

}  // namespace diffcomm::sim::detail
