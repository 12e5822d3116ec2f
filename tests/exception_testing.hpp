#pragma once
// What a test asks of an exception a rank or a run left behind
// (std::exception_ptr): its type and its message.
#include <exception>
#include <string>

namespace diffcomm::test_util {

// Whether `e` holds an exception of type E (or derived from it).
template <class E>
bool holds(const std::exception_ptr& e) {
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

// The message of the exception `e` holds ("" for none).
inline std::string what_of(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace diffcomm::test_util
