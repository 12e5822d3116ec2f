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
/// dict keys must be strings or ints, which become strings). Memo reads
/// share the memoised object as Python does (appends after the read are
/// seen); reading takes memory in proportion to `bytes`, and the JSON tree,
/// which writes a shared object out once per reference, is bounded: at most
/// 2^16 + 64 values and 2^20 + 256 string bytes per input byte (caps 2^23
/// values, 256 MiB). Throws InvalidArgument "<file>: pickle ..." on a
/// truncated stream, an unsupported or malformed opcode (naming its
/// offset), containers nested deeper than 64 or holding themselves, and a
/// tree past the budget (a memo bomb).
nlohmann::json unpickle(std::string_view bytes, const std::string& file);

}  // namespace diffcomm::sim::detail
