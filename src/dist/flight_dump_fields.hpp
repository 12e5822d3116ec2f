#pragma once
// The JSON objects a flight dump is made of (dist/flight_dump.hpp's schema):
// a group, a call description and version 1's whole entry, written and read
// in one place for both layouts (flight_dump.cpp and flight_dump_compact.cpp).
// Internal to src/dist/.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>

#include "diffcomm/dist/flight_dump.hpp"
#include "diffcomm/error.hpp"

namespace diffcomm::dist::dump_fields {

inline constexpr const char* kFormat = "diffcomm-flight-recorder";

/// Reading: every failure names the file and where (entry k, field f).
struct Reader {
  const std::string& file;
  std::string where;

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument(fmt::format("{}: {}{}", file, where, what));
  }
  template <class T>
  T get(const nlohmann::json& obj, const char* field) const {
    auto it = obj.find(field);
    if (it == obj.end()) fail(fmt::format("missing field '{}'", field));
    try {
      return it->get<T>();
    } catch (const nlohmann::json::exception&) {
      fail(fmt::format("field '{}' has the wrong type ({})", field, it->type_name()));
    }
  }
  OpType op(const std::string& name) const;
  DType dtype(const std::string& name) const;
  ReduceOp reduce(const std::string& name, double factor) const;
  FlightRecord::State state(const std::string& name) const;
};

/// A group; members as "member_range" when they are an arithmetic
/// progression of 3 or more (the world group: 16384 numbers in every file).
nlohmann::json group_json(const DumpedGroup& g);
DumpedGroup parse_group(const nlohmann::json& g, const Reader& rd);

/// A call description: a record's fields but id, call, state, times, bytes
/// and backward_of's call (version 2's "calls").
nlohmann::json desc_json(const FlightRecord& r);
FlightRecord parse_desc(const nlohmann::json& e, const Reader& rd);

/// Version 1's whole dump, from its parsed document.
FlightDump parse_v1(const nlohmann::json& doc, Reader& rd);

}  // namespace diffcomm::dist::dump_fields
