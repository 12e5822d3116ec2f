// Dumps at exit after an uncaught error: every production recorder with a
// dump directory registers here; an uncaught C++ exception reaches
// std::terminate, whose handler (ours, installed once) dumps them all and
// then runs the handler it replaced, so the process still ends as it would
// have (or, when a backend set one, its end of the job: mpi::end_job). The
// Python package's sys.excepthook calls dump_all_on_error too.
#include "flight_recorder_exit.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {
namespace {
struct Registry {
  std::mutex mutex;
  std::vector<const FlightRecorder*> recorders;
  std::terminate_handler previous = nullptr;
  std::once_flag installed;
  std::atomic<void (*)(const char*)> end{nullptr};
};

// Leaked on purpose: recorders of static groups outlive any static registry.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// "uncaught <Kind>: <what>" of the exception being handled, if any.
std::string uncaught_text() {
  const std::exception_ptr e = std::current_exception();
  if (!e) return "std::terminate without an exception";
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    return std::string("uncaught ") + error_kind_name(err.kind()) + ": " + err.what();
  } catch (const std::exception& err) {
    return std::string("uncaught exception: ") + err.what();
  } catch (...) {
    return "uncaught exception of a type that is not std::exception";
  }
}

[[noreturn]] void on_terminate() {
  FlightRecorder::dump_all_on_error();
  if (void (*end)(const char*) = registry().end.load()) {
    const std::string why = uncaught_text();
    std::fprintf(stderr, "diffcomm: %s\n", why.c_str());
    std::fflush(stderr);
    end(why.c_str());
  }
  const std::terminate_handler previous = registry().previous;
  if (previous != nullptr) previous();
  std::abort();
}
// Ours replaces the process's handler once; the one it replaced runs after.
void install_terminate_handler(Registry& reg) {
  std::call_once(reg.installed, [&] { reg.previous = std::set_terminate(on_terminate); });
}
}  // namespace

namespace detail {
void register_for_exit_dump(const FlightRecorder* r) {
  Registry& reg = registry();
  install_terminate_handler(reg);
  const std::lock_guard<std::mutex> lock(reg.mutex);
  reg.recorders.push_back(r);
}

void unregister_for_exit_dump(const FlightRecorder* r) noexcept {
  Registry& reg = registry();
  const std::lock_guard<std::mutex> lock(reg.mutex);
  reg.recorders.erase(std::remove(reg.recorders.begin(), reg.recorders.end(), r),
                      reg.recorders.end());
}
}  // namespace detail

void FlightRecorder::set_end_on_terminate(void (*end)(const char* why)) noexcept {
  Registry& reg = registry();
  reg.end.store(end);
  install_terminate_handler(reg);
}

int FlightRecorder::dump_all_on_error() noexcept {
  Registry& reg = registry();
  // try_lock: a terminate raised while the registry is being changed must
  // not deadlock; it then dumps nothing.
  std::unique_lock<std::mutex> lock(reg.mutex, std::try_to_lock);
  if (!lock.owns_lock()) return 0;
  for (const FlightRecorder* r : reg.recorders) r->dump_on_error();
  return static_cast<int>(reg.recorders.size());
}

}  // namespace diffcomm::dist
