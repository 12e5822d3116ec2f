#pragma once
// A reader for the pickles PyTorch's Flight Recorder writes
// (torch._C._distributed_c10d._dump_fr_trace, TORCH_FR_DUMP_TEMP_FILE):
// protocol 2 to 5 streams of dicts, lists, tuples, strings, bytes, ints,
// floats, bools and None. Nothing else is accepted — no globals, no
// reduce, no persistent ids — so reading a dump never runs code. There is
// no maintained C++ pickle library to use instead.
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace diffcomm::sim::detail {

/// The pickled value as JSON (tuples become arrays, bytes become strings,
/// dict keys must be strings or ints, which become strings). Throws
/// InvalidArgument "<file>: pickle ... at offset N" on a truncated stream,
/// an unsupported opcode, or a malformed one.
nlohmann::json unpickle(std::string_view bytes, const std::string& file);

}  // namespace diffcomm::sim::detail
