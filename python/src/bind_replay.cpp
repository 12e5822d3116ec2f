// diffcomm._core.sim (continued): replay of flight recorder dumps
// (sim/replay.hpp). diffcomm.sim.replay wraps replay_dir's JSON, the same
// report `diffcomm-sim replay --json` prints, in a ReplayReport.
#include <string>
#include <tuple>
#include <vector>

#include "bind.hpp"
#include "diffcomm/sim/replay.hpp"
#include "diffcomm/sim/replay_edit.hpp"

namespace diffcomm_python {
namespace {

// Reads `dir` (diffcomm's or torch's dumps), applies the edits as the CLI
// does (apply_edits: each CALL in the recorded numbering), replays under
// `seed`: (json, text, exit code).
std::tuple<std::string, std::string, int> replay_dir(const std::string& dir, uint64_t seed,
                                                     const std::vector<std::string>& drops,
                                                     const std::vector<std::string>& barriers) {
  const dc::sim::Recording recording = dc::sim::read_edited(dir, drops, barriers);
  dc::sim::ReplayOptions options;
  options.seed = seed;
  const dc::sim::ReplayReport rep = dc::sim::replay(recording, options);
  return {dc::sim::replay_json(rep), dc::sim::replay_text(rep), rep.exit_code()};
}
}  // namespace

void bind_replay(nb::module_& m) {
  nb::module_ s = nb::borrow<nb::module_>(m.attr("sim"));
  s.def("replay_dir", &replay_dir, "dir"_a, "seed"_a, "drops"_a, "barriers"_a, release(),
        "Replays DIR's flight recorder dumps: (report JSON, report text, exit code).");
}

}  // namespace diffcomm_python
