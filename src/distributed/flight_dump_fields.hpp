#pragma once
// The JSON objects a flight dump is made of (dist/flight_dump.hpp's schema):
// a group, a call description and version 1's whole entry, written and read
// in one place for both layouts (flight_dump.cpp and flight_dump_compact.cpp).
// Internal to src/distributed/.
#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <utility>

#include "diffcomm/distributed/flight_dump.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist::dump_fields {

inline constexpr const char* kFormat = "diffcomm-flight-recorder";

// JSON -> T with every number checked; false for a wrong type or a value T
// cannot hold.
template <class T>
bool convert(const nlohmann::json& v, T& out) {
  if constexpr (std::is_same_v<T, nlohmann::json>) {
    out = v;
    return true;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return false;
    out = v.get<bool>();
    return true;
  } else if constexpr (std::is_integral_v<T>) {
    if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      if (!std::in_range<T>(u)) return false;
      out = static_cast<T>(u);
      return true;
    }
    if (!v.is_number_integer()) return false;
    const auto i = v.get<int64_t>();
    if (!std::in_range<T>(i)) return false;
    out = static_cast<T>(i);
    return true;
  } else if constexpr (std::is_same_v<T, double>) {
    if (!v.is_number()) return false;
    out = v.get<double>();
    return true;
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return false;
    out = v.get<std::string>();
    return true;
  } else {  // std::vector<U> or std::array<U, N>
    if (!v.is_array()) return false;
    if constexpr (requires { out.push_back(out[0]); }) {
      out.clear();
      out.reserve(v.size());
      for (const auto& e : v) {
        typename T::value_type x{};
        if (!convert(e, x)) return false;
        out.push_back(std::move(x));
      }
    } else {
      if (v.size() != out.size()) return false;
      for (std::size_t k = 0; k < out.size(); ++k)
        if (!convert(v[k], out[k])) return false;
    }
    return true;
  }
}

/// Reading: every failure is raise(file, where + what), naming the file and
/// where in it (entry k, field f).
struct Reader {
  const std::string& file;
  std::string where;  ///< "entries[3]: ", or "" at the top level

  /// The field's value as T, checked: a number must be an integer inside
  /// T's range (nlohmann's own conversion casts 1e300 to an integer, which
  /// is undefined behaviour; fuzz_flight_dump found it), element by element
  /// in arrays.
  template <class T>
  T get(const nlohmann::json& obj, const char* field) const {
    auto it = obj.find(field);
    if (it == obj.end()) raise(file, where + fmt::format("missing field '{}'", field));
    T out{};
    if (!convert(*it, out))
      raise(file, where + fmt::format("field '{}' has the wrong type or is out of range ({})",
                                      field, it->type_name()));
    return out;
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
/// send/recv: numbered apart from the group's collectives.
bool is_p2p(OpType op);

}  // namespace diffcomm::dist::dump_fields
