// The restricted unpickler of unpickle.hpp: a stack machine over the
// opcodes plain containers and scalars use (pickletools' names below).
#include "unpickle.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim::detail {
namespace {
using Json = nlohmann::json;

// The unpickled objects, shared as Python shares them: a memo read pushes
// the memoised object itself, so a list appended to after it was memoised
// is seen with its appends wherever it was read, and reading is O(input)
// (each opcode makes at most one object). Strings and containers live in
// the reader's arena and are referred to by pointer (a container may hold
// itself); scalars are kept inline.
struct Obj;
struct Val {
  enum class Kind : uint8_t { None, Bool, Int, Float, Obj };
  Kind kind = Kind::None;
  union {
    bool b;
    int64_t i;
    double d;
    Obj* obj = nullptr;
  };
};
struct Obj {
  enum class Kind : uint8_t { String, List, Tuple, Dict };
  Kind kind = Kind::String;
  std::size_t at = 0;  // offset of the opcode that made it
  std::string s;
  std::vector<Val> items;                          // List, Tuple
  std::vector<std::pair<std::string, Val>> entry;  // Dict, keys as JSON writes them
};

constexpr int kMaxDepth = 64;
// The JSON tree writes each shared object out once per reference, so a few
// hundred bytes of pickle that put a memoised list twice into a new one, 40
// times over, would ask for 2^40 values. The tree is bounded instead: a real
// flight recorder dump (2000 entries with their frames) writes about one
// value and a few string bytes per byte of pickle (the checked-in torch
// dumps: under 0.2 values and 2 bytes), so the budget grows with the input,
// 64 values and 256 string bytes per byte, within a fixed cap: a 626-byte
// memo bomb stops after about 10^5 values (milliseconds), a large one at the
// cap (seconds), never at 2^34.
constexpr std::size_t kMaxValues = std::size_t{1} << 23;
constexpr std::size_t kMaxBytes = std::size_t{256} << 20;
std::size_t values_budget(std::size_t input_bytes) {
  return std::min(kMaxValues, (std::size_t{1} << 16) + 64 * input_bytes);
}
std::size_t bytes_budget(std::size_t input_bytes) {
  return std::min(kMaxBytes, (std::size_t{1} << 20) + 256 * input_bytes);
}

class Unpickler {
 public:
  Unpickler(std::string_view bytes, const std::string& file) : in_(bytes), file_(file) {}

  Json run() {
    while (true) {
      const std::size_t at = pos_;
      const auto op = static_cast<uint8_t>(take(1)[0]);
      if (op == '.') {  // STOP
        if (stack_.size() != 1)
          raise(file_, fmt::format("pickle STOP with a stack of {} values at offset {}",
                                   stack_.size(), at));
        return to_json(stack_.back(), 0);
      }
      step(op, at);
    }
  }

 private:
  std::string_view take(std::size_t n) {
    if (n > in_.size() - pos_)
      raise(file_,
            fmt::format("pickle truncated (needs {} more bytes) at offset {}", n, in_.size()));
    const std::string_view s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  uint64_t uint_le(std::size_t n) {
    const std::string_view s = take(n);
    uint64_t v = 0;
    for (std::size_t i = n; i-- > 0;) v = (v << 8) | static_cast<uint8_t>(s[i]);
    return v;
  }
  void push(Val v) { stack_.push_back(v); }
  void push_none() { push(Val{}); }
  void push_bool(bool b) {
    Val v;
    v.kind = Val::Kind::Bool;
    v.b = b;
    push(v);
  }
  void push_int(int64_t i) {
    Val v;
    v.kind = Val::Kind::Int;
    v.i = i;
    push(v);
  }
  void push_float(double d) {
    Val v;
    v.kind = Val::Kind::Float;
    v.d = d;
    push(v);
  }
  Obj& make(Obj::Kind kind, std::size_t at) {
    Obj& o = arena_.emplace_back();
    o.kind = kind;
    o.at = at;
    return o;
  }
  void push_obj(Obj& o) {
    Val v;
    v.kind = Val::Kind::Obj;
    v.obj = &o;
    push(v);
  }
  void push_string(std::string_view s, std::size_t at) {
    Obj& o = make(Obj::Kind::String, at);
    o.s = std::string(s);
    push_obj(o);
  }
  Val pop(std::size_t at) {
    if (stack_.size() <= mark_floor())
      raise(file_, fmt::format("pickle pops an empty stack at offset {}", at));
    const Val v = stack_.back();
    stack_.pop_back();
    return v;
  }
  std::size_t mark_floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // The values above the last MARK, removed from the stack.
  std::vector<Val> since_mark(std::size_t at) {
    if (marks_.empty()) raise(file_, fmt::format("pickle needs a MARK at offset {}", at));
    std::vector<Val> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()),
                           stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  // The container on top of the stack, which must be of `kind` for `what`.
  Obj& top(Obj::Kind kind, const char* what, std::size_t at) {
    if (stack_.size() <= mark_floor())
      raise(file_, fmt::format("pickle needs a value on the stack at offset {}", at));
    const Val& v = stack_.back();
    if (v.kind != Val::Kind::Obj || v.obj->kind != kind)
      raise(file_, fmt::format("pickle {} at offset {}", what, at));
    return *v.obj;
  }
  void set_item(Obj& dict, const Val& key, const Val& value, std::size_t at) {
    if (key.kind == Val::Kind::Obj && key.obj->kind == Obj::Kind::String)
      dict.entry.emplace_back(key.obj->s, value);
    else if (key.kind == Val::Kind::Int)
      dict.entry.emplace_back(std::to_string(key.i), value);
    else
      raise(file_, fmt::format("pickle dict key that is not a string or an int at offset {}", at));
  }
  void memo_put(uint64_t i, std::size_t at) {
    if (i > (1u << 24)) raise(file_, fmt::format("pickle memo index {} at offset {}", i, at));
    if (stack_.empty())
      raise(file_, fmt::format("pickle memoizes an empty stack at offset {}", at));
    if (memo_.size() <= i) memo_.resize(i + 1);
    memo_[i] = stack_.back();
  }
  void memo_get(uint64_t i, std::size_t at) {
    if (i >= memo_.size() || !memo_[i])
      raise(file_, fmt::format("pickle reads memo {} never written at offset {}", i, at));
    push(*memo_[i]);  // the object itself, as Python's unpickler does
  }
  void push_tuple(std::vector<Val> items, std::size_t at) {
    Obj& t = make(Obj::Kind::Tuple, at);
    t.items = std::move(items);
    push_obj(t);
  }
  void tuple_of(std::size_t n, std::size_t at) {
    if (stack_.size() < mark_floor() + n)
      raise(file_, fmt::format("pickle TUPLE{} on a short stack at offset {}", n, at));
    const auto first = stack_.end() - static_cast<std::ptrdiff_t>(n);
    std::vector<Val> items(first, stack_.end());
    stack_.erase(first, stack_.end());
    push_tuple(std::move(items), at);
  }
  // LONG1 / LONG4: little-endian two's complement of n bytes.
  void long_of(std::size_t n, std::size_t at) {
    if (n > 8) raise(file_, fmt::format("pickle integer of {} bytes at offset {}", n, at));
    const std::string_view s = take(n);
    uint64_t v = 0;
    for (std::size_t i = n; i-- > 0;) v = (v << 8) | static_cast<uint8_t>(s[i]);
    if (n > 0 && n < 8 && (static_cast<uint8_t>(s[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
    push_int(static_cast<int64_t>(v));
  }
  // One value written out; the whole tree counts against the budgets.
  void count(std::size_t values, std::size_t string_bytes) {
    values_ += values;
    bytes_ += string_bytes;
    const std::size_t max_values = values_budget(in_.size()), max_bytes = bytes_budget(in_.size());
    if (values_ > max_values || bytes_ > max_bytes)
      raise(file_, fmt::format("pickle expands to more than {} values or {} bytes of strings "
                               "once its shared values are written out (a flight recorder dump of "
                               "{} bytes needs far fewer; a memo bomb?)",
                               max_values, max_bytes, in_.size()));
  }
  // The JSON tree of `v` (tuples become arrays, bytes strings); containers
  // nest at most kMaxDepth deep, which also refuses one that holds itself.
  Json to_json(const Val& v, int depth) {
    count(1, 0);
    switch (v.kind) {
      case Val::Kind::None: return nullptr;
      case Val::Kind::Bool: return v.b;
      case Val::Kind::Int: return v.i;
      case Val::Kind::Float: return v.d;
      case Val::Kind::Obj: break;
    }
    const Obj& o = *v.obj;
    if (o.kind == Obj::Kind::String) {
      count(0, o.s.size());
      return o.s;
    }
    if (depth >= kMaxDepth)
      raise(file_, fmt::format("pickle nests containers deeper than {} (or a container holds "
                               "itself): the container made at offset {}",
                               kMaxDepth, o.at));
    if (o.kind == Obj::Kind::Dict) {
      Json j = Json::object();
      for (const auto& [key, value] : o.entry) {
        count(1, key.size());
        j[key] = to_json(value, depth + 1);
      }
      return j;
    }
    Json j = Json::array();
    for (const Val& item : o.items) j.push_back(to_json(item, depth + 1));
    return j;
  }
  void step(uint8_t op, std::size_t at);

  std::string_view in_;
  const std::string& file_;
  std::size_t pos_ = 0;
  std::deque<Obj> arena_;  // stable addresses; freed with the reader, cycles included
  std::vector<Val> stack_;
  std::vector<std::size_t> marks_;
  std::vector<std::optional<Val>> memo_;
  std::size_t values_ = 0;  // written out, against values_budget
  std::size_t bytes_ = 0;   // of strings written out, against bytes_budget
};

void Unpickler::step(uint8_t op, std::size_t at) {
  switch (op) {
    case 0x80: take(1); return;                                    // PROTO
    case 0x95: take(8); return;                                    // FRAME
    case '(': marks_.push_back(stack_.size()); return;             // MARK
    case '0': (void)pop(at); return;                               // POP
    case '}': push_obj(make(Obj::Kind::Dict, at)); return;         // EMPTY_DICT
    case ']': push_obj(make(Obj::Kind::List, at)); return;         // EMPTY_LIST
    case ')': push_tuple({}, at); return;                          // EMPTY_TUPLE
    case 'N': push_none(); return;                                 // NONE
    case 0x88: push_bool(true); return;                            // NEWTRUE
    case 0x89: push_bool(false); return;                           // NEWFALSE
    case 'K': push_int(static_cast<int64_t>(uint_le(1))); return;  // BININT1
    case 'M': push_int(static_cast<int64_t>(uint_le(2))); return;  // BININT2
    case 'J': push_int(static_cast<int32_t>(uint_le(4))); return;  // BININT
    case 0x8a: long_of(uint_le(1), at); return;                    // LONG1
    case 0x8b: long_of(uint_le(4), at); return;                    // LONG4
    case 'G': {                                                    // BINFLOAT: big-endian double
      const std::string_view s = take(8);
      uint64_t bits = 0;
      for (char c : s) bits = (bits << 8) | static_cast<uint8_t>(c);
      double d = 0;
      std::memcpy(&d, &bits, sizeof d);
      push_float(d);
      return;
    }
    case 0x8c: push_string(take(uint_le(1)), at); return;  // SHORT_BINUNICODE
    case 'X': push_string(take(uint_le(4)), at); return;   // BINUNICODE
    case 0x8d: push_string(take(uint_le(8)), at); return;  // BINUNICODE8
    case 'C': push_string(take(uint_le(1)), at); return;   // SHORT_BINBYTES
    case 'B': push_string(take(uint_le(4)), at); return;   // BINBYTES
    case 0x85: tuple_of(1, at); return;                    // TUPLE1
    case 0x86: tuple_of(2, at); return;                    // TUPLE2
    case 0x87: tuple_of(3, at); return;                    // TUPLE3
    case 't': push_tuple(since_mark(at), at); return;      // TUPLE
    case 'a': {                                            // APPEND
      const Val v = pop(at);
      top(Obj::Kind::List, "APPEND to a non-list", at).items.push_back(v);
      return;
    }
    case 'e': {  // APPENDS
      std::vector<Val> items = since_mark(at);
      Obj& list = top(Obj::Kind::List, "APPENDS to a non-list", at);
      list.items.insert(list.items.end(), items.begin(), items.end());
      return;
    }
    case 's': {  // SETITEM
      const Val v = pop(at);
      const Val k = pop(at);
      set_item(top(Obj::Kind::Dict, "SETITEM on a non-dict", at), k, v, at);
      return;
    }
    case 'u': {  // SETITEMS
      const std::vector<Val> items = since_mark(at);
      if (items.size() % 2 != 0)
        raise(file_, fmt::format("pickle SETITEMS with an odd number of values at offset {}", at));
      Obj& dict = top(Obj::Kind::Dict, "SETITEMS on a non-dict", at);
      for (std::size_t i = 0; i < items.size(); i += 2) set_item(dict, items[i], items[i + 1], at);
      return;
    }
    case 'q': memo_put(uint_le(1), at); return;     // BINPUT
    case 'r': memo_put(uint_le(4), at); return;     // LONG_BINPUT
    case 0x94: memo_put(memo_.size(), at); return;  // MEMOIZE
    case 'h': memo_get(uint_le(1), at); return;     // BINGET
    case 'j': memo_get(uint_le(4), at); return;     // LONG_BINGET
    default:
      raise(file_, fmt::format(
                       "pickle opcode 0x{:02x} is not one a flight recorder dump uses at offset {}",
                       op, at));
  }
}
}  // namespace

nlohmann::json unpickle(std::string_view bytes, const std::string& file) {
  return Unpickler(bytes, file).run();
}

}  // namespace diffcomm::sim::detail
