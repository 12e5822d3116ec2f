#include "diffcomm/distributed/backend/options.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

bool Options::resolved_check() const {
  if (check) return *check;
  if (const char* env = std::getenv("DIFFCOMM_CHECK")) {
    const std::string v(env);
    if (v == "1" || v == "true" || v == "on") return true;
    if (v == "0" || v == "false" || v == "off" || v.empty()) return false;
    throw InvalidArgument(fmt::format("DIFFCOMM_CHECK='{}': expected 1 or 0", v));
  }
#ifdef NDEBUG
  return false;
#else
  return true;
#endif
}

// A deadline must be a finite number of seconds above zero: NaN compares
// false with every waited time (the deadline would never expire), and "0 or
// less waits forever" would turn the promise "nothing hangs" off by a typo.
double Options::resolved_timeout_s() const {
  if (timeout_s) {
    if (!(std::isfinite(*timeout_s) && *timeout_s > 0 && *timeout_s <= kMaxTimeoutS))
      throw InvalidArgument(
          fmt::format("Options::timeout_s = {}: expected a finite number of seconds > 0 and at "
                      "most {:.0f}",
                      *timeout_s, kMaxTimeoutS));
    return *timeout_s;
  }
  if (const char* env = std::getenv("DIFFCOMM_TIMEOUT")) {
    char* end = nullptr;
    const double v = std::strtod(env, &end);
    if (end == env || *end != '\0')
      throw InvalidArgument(fmt::format("DIFFCOMM_TIMEOUT='{}': expected seconds", env));
    if (!(std::isfinite(v) && v > 0 && v <= kMaxTimeoutS))
      throw InvalidArgument(fmt::format(
          "DIFFCOMM_TIMEOUT='{}': expected a finite number of seconds > 0 and at most {:.0f} "
          "(every wait has a deadline)",
          env, kMaxTimeoutS));
    return v;
  }
  return 600.0;
}

std::size_t Options::resolved_flight_recorder_size() const {
  if (flight_recorder_size) {
    if (*flight_recorder_size == 0 || *flight_recorder_size > kMaxFlightRecorderSize)
      throw InvalidArgument(
          fmt::format("Options::flight_recorder_size = {}: expected 1 to {} entries",
                      *flight_recorder_size, kMaxFlightRecorderSize));
    return *flight_recorder_size;
  }
  if (const char* env = std::getenv("DIFFCOMM_FR_SIZE")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (end == env || *end != '\0' || v == 0 || env[0] == '-' || v > kMaxFlightRecorderSize)
      throw InvalidArgument(
          fmt::format("DIFFCOMM_FR_SIZE='{}': expected a number of entries from 1 to {}", env,
                      kMaxFlightRecorderSize));
    return static_cast<std::size_t>(v);
  }
  return 2000;
}

std::string Options::resolved_flight_recorder_dump_dir() const {
  if (flight_recorder_dump_dir) return *flight_recorder_dump_dir;
  if (const char* env = std::getenv("DIFFCOMM_FR_DUMP_DIR")) return env;
  return "";
}

}  // namespace diffcomm::dist
