// Fuzzes the flight recorder dump reader (dist/flight_dump.hpp), the input
// `diffcomm-sim replay` takes from production: any bytes must either be
// refused with one InvalidArgument or read as a dump that writes back
// (format 2) and reads again to the same entries.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "diffcomm/distributed/flight_dump.hpp"
#include "diffcomm/tensor/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  namespace dist = diffcomm::dist;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  dist::FlightDump dump;
  try {
    dump = dist::expand(dist::parse_compact_flight_dump(text, "fuzz.json"));
  } catch (const diffcomm::InvalidArgument&) {
    return 0;
  }
  const dist::FlightDump again = dist::parse_flight_dump(dist::flight_dump_json(dump), "again");
  if (again.entries.size() != dump.entries.size() || again.groups.size() != dump.groups.size())
    std::abort();
  for (std::size_t i = 0; i < dump.entries.size(); ++i)
    if (again.entries[i].seq != dump.entries[i].seq || again.entries[i].op != dump.entries[i].op ||
        again.entries[i].input_shapes != dump.entries[i].input_shapes)
      std::abort();
  return 0;
}
