#pragma once
// Where a collective was called from in the user's code (issue [4/7] item 5):
// each call carries its caller (Call::caller), the flight recorder keeps it,
// dumps write it, and Deadlock reports and Timeout dumps print it, so a user
// with 40 all_reduces in a step sees which one is stuck.
//
// C++: the public functions of collectives.hpp take a defaulted
// Caller::here() (the call site, as std::source_location gives it). Python: the bindings set the
// caller from the first Python frame outside diffcomm and torch (ScopedCaller) before releasing the
// GIL; a caller set that way wins over the C++ location of the binding.
// Callers are never compared across ranks (members legally call from
// different lines).
#include <cstdint>
#include <string>
#include <string_view>

namespace diffcomm::dist {

/// A file and line. file is static storage (a string literal, here()) or
/// interned for the process's lifetime (intern_file); null when unknown.
struct Caller {
  const char* file = nullptr;
  uint32_t line = 0;
  explicit operator bool() const { return file != nullptr; }
  /// The file and line of the expression that calls here(); as a defaulted
  /// parameter (`Caller caller = Caller::here()`), of the call to the
  /// function that declares it. GCC's and Clang's __builtin_FILE and
  /// __builtin_LINE, which std::source_location wraps (clang 14 has no
  /// std::source_location).
  static constexpr Caller here(const char* file = __builtin_FILE(),
                               uint32_t line = __builtin_LINE()) noexcept {
    return Caller{file, line};
  }
  /// "train.py:42"; "" when unknown.
  std::string str() const;
};

/// A copy of `file` that lives as long as the process (one per distinct
/// name; thread-safe). For callers whose names are not static: Python's
/// frames, dumps read back.
const char* intern_file(std::string_view file);

/// While it lives, calls this thread makes record `caller` instead of their
/// own call site (the Python bindings: the user's Python line
/// rather than the binding's; replay: the dumped call's caller). Its end
/// clears it (no restore: an enclosing scope's later calls fall back to
/// their own location). Not per-rank state although fibers share the
/// thread: whoever sets it calls into the funnel at once, which reads it
/// before any fiber switch; a fiber that calls without setting one may
/// read another's only while that one is inside a call (replay sets one
/// for every call it issues).
class ScopedCaller {
 public:
  explicit ScopedCaller(Caller caller);
  ~ScopedCaller();
  ScopedCaller(const ScopedCaller&) = delete;
  ScopedCaller& operator=(const ScopedCaller&) = delete;

 private:
  bool set_ = false;
};

/// The caller a call made at `where` records: the live ScopedCaller's, else
/// `where`.
Caller caller_at(Caller where);

}  // namespace diffcomm::dist
