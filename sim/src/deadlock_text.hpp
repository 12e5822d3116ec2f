#pragma once
// The first line of the simulated world's deadlock report, shared with the
// replay (replay.cpp), which reports a deadlock it settled without the world
// in the world's words. Internal to sim/src.
#include <string_view>

namespace diffcomm::sim::detail {

inline constexpr std::string_view kDeadlockLine =
    "deadlock: every live rank is blocked and none can proceed";

}  // namespace diffcomm::sim::detail
