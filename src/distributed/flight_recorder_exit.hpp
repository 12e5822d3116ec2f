#pragma once
// The registry of production recorders that dump at exit after an uncaught
// error (FlightRecorder::dump_all_on_error). Not an API.
namespace diffcomm::dist {
class FlightRecorder;
namespace detail {
/// Adds `r`; the first call installs diffcomm's std::terminate handler.
void register_for_exit_dump(const FlightRecorder* r);
void unregister_for_exit_dump(const FlightRecorder* r) noexcept;
}  // namespace detail
}  // namespace diffcomm::dist
