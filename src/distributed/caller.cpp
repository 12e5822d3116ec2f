// Callers of collectives (see caller.hpp).
#include "diffcomm/distributed/caller.hpp"

#include <fmt/format.h>

#include <mutex>
#include <string>
#include <unordered_set>

namespace diffcomm::dist {
namespace {
// The caller a binding set on this thread. Not per-rank state: it is written
// by a binding just before it enters C++ and read by that call's funnel
// before any fiber switch (caller.hpp).
thread_local Caller t_scoped{};
}  // namespace

std::string Caller::str() const { return file ? fmt::format("{}:{}", file, line) : std::string(); }

const char* intern_file(std::string_view file) {
  static std::mutex mu;
  static std::unordered_set<std::string> names;  // nodes never move: stable c_str()
  std::lock_guard lock(mu);
  return names.emplace(file).first->c_str();
}

ScopedCaller::ScopedCaller(Caller caller) {
  if (!caller) return;
  t_scoped = caller;
  set_ = true;
}
ScopedCaller::~ScopedCaller() {
  if (set_) t_scoped = Caller{};
}

Caller caller_at(Caller where) { return t_scoped ? t_scoped : where; }

}  // namespace diffcomm::dist
