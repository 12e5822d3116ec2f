// The restricted unpickler of unpickle.hpp: a stack machine over the
// opcodes plain containers and scalars use (pickletools' names below).
#include "unpickle.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim::detail {
namespace {
using Json = nlohmann::json;
// A value, how deeply containers nest in it and how much of it there is
// (values, and bytes of strings), shared: the memo sees later appends. The
// depth is bounded so that no recursion over the value later (copy, compare,
// print) can exhaust the stack. The result is a tree (JSON), so every memo
// read copies the memoised value: a few hundred bytes of pickle that read a
// memoised list twice into a new one, again and again, ask for 2^34 values.
// Those copies are counted against a budget instead (values_budget,
// bytes_budget).
struct Item {
  Json v;
  int depth = 0;
  std::size_t values = 1;  // JSON values in v, v included
  std::size_t bytes = 0;   // bytes of the strings in v
};
using Node = std::shared_ptr<Item>;
constexpr int kMaxDepth = 64;
// What all memo reads of one pickle may copy: a real flight recorder dump
// (2000 entries with their frames) reads a few hundred thousand values, and
// the checked-in torch dumps copy 0.15 values and 1.6 string bytes per byte
// of pickle (a memo read is 2 bytes and copies mostly one string). So the
// budget grows with the input, 64 values and 256 bytes per byte, within a
// fixed cap: a 626-byte memo bomb stops after about 10^5 values copied (in
// milliseconds), a large one at the cap (seconds), never at 2^34.
constexpr std::size_t kMaxCopiedValues = std::size_t{1} << 23;
constexpr std::size_t kMaxCopiedBytes = std::size_t{256} << 20;
std::size_t values_budget(std::size_t input_bytes) {
  return std::min(kMaxCopiedValues, (std::size_t{1} << 16) + 64 * input_bytes);
}
std::size_t bytes_budget(std::size_t input_bytes) {
  return std::min(kMaxCopiedBytes, (std::size_t{1} << 20) + 256 * input_bytes);
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
        return stack_.back()->v;
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
  // A value leaving the stack: moved out unless the memo shares it.
  static Json value_of(Node& n) { return n.use_count() == 1 ? std::move(n->v) : Json(n->v); }
  void push(Json v, int depth = 0, std::size_t values = 1, std::size_t bytes = 0) {
    stack_.push_back(std::make_shared<Item>(Item{std::move(v), depth, values, bytes}));
  }
  void push_string(std::string_view s) { push(std::string(s), 0, 1, s.size()); }
  // `parent` now holds `child`: its depth and size follow.
  void nest(Item& parent, const Item& child, std::size_t at) const {
    parent.depth = std::max(parent.depth, child.depth + 1);
    parent.values += child.values;
    parent.bytes += child.bytes;
    if (parent.depth > kMaxDepth)
      raise(file_,
            fmt::format("pickle nests containers deeper than {} at offset {}", kMaxDepth, at));
  }
  Node pop(std::size_t at) {
    if (stack_.size() <= mark_floor())
      raise(file_, fmt::format("pickle pops an empty stack at offset {}", at));
    Node n = std::move(stack_.back());
    stack_.pop_back();
    return n;
  }
  std::size_t mark_floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // The values above the last MARK, removed from the stack.
  std::vector<Node> since_mark(std::size_t at) {
    if (marks_.empty()) raise(file_, fmt::format("pickle needs a MARK at offset {}", at));
    std::vector<Node> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()),
                            stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  Item& top(std::size_t at) {
    if (stack_.size() <= mark_floor())
      raise(file_, fmt::format("pickle needs a value on the stack at offset {}", at));
    return *stack_.back();
  }
  void set_item(Item& dict, const Json& key, Node& value, std::size_t at) {
    if (!dict.v.is_object())
      raise(file_, fmt::format("pickle SETITEM on a non-dict at offset {}", at));
    nest(dict, *value, at);
    if (key.is_string())
      dict.v[key.get<std::string>()] = value_of(value);
    else if (key.is_number_integer())
      dict.v[key.dump()] = value_of(value);
    else
      raise(file_, fmt::format("pickle dict key of type {} at offset {}", key.type_name(), at));
  }
  void append(Item& list, Node& value, std::size_t at) {
    if (!list.v.is_array())
      raise(file_, fmt::format("pickle APPEND to a non-list at offset {}", at));
    nest(list, *value, at);
    list.v.push_back(value_of(value));
  }
  void memo_put(uint64_t i, std::size_t at) {
    if (i > (1u << 24)) raise(file_, fmt::format("pickle memo index {} at offset {}", i, at));
    if (memo_.size() <= i) memo_.resize(i + 1);
    memo_[i] = stack_.empty() ? nullptr : stack_.back();
    if (!memo_[i]) raise(file_, fmt::format("pickle memoizes an empty stack at offset {}", at));
  }
  void memo_get(uint64_t i, std::size_t at) {
    if (i >= memo_.size() || !memo_[i])
      raise(file_, fmt::format("pickle reads memo {} never written at offset {}", i, at));
    const Item& m = *memo_[i];
    copied_values_ += m.values;
    copied_bytes_ += m.bytes;
    const std::size_t max_values = values_budget(in_.size()), max_bytes = bytes_budget(in_.size());
    if (copied_values_ > max_values || copied_bytes_ > max_bytes)
      raise(file_, fmt::format("pickle memo reads copy more than {} values or {} bytes at offset "
                               "{} (a flight recorder dump of {} bytes needs far fewer; a memo "
                               "bomb?)",
                               max_values, max_bytes, at, in_.size()));
    push(m.v, m.depth, m.values, m.bytes);
  }
  // A tuple of `items` (TUPLE, TUPLE1..3).
  void push_tuple(std::vector<Node> items, std::size_t at) {
    Item t{Json::array(), 0, 1, 0};
    for (Node& n : items) {
      nest(t, *n, at);
      t.v.push_back(value_of(n));
    }
    push(std::move(t.v), t.depth, t.values, t.bytes);
  }
  void tuple_of(std::size_t n, std::size_t at) {
    if (stack_.size() < mark_floor() + n)
      raise(file_, fmt::format("pickle TUPLE{} on a short stack at offset {}", n, at));
    const auto first = stack_.end() - static_cast<std::ptrdiff_t>(n);
    std::vector<Node> items(first, stack_.end());
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
    push(static_cast<int64_t>(v));
  }
  void step(uint8_t op, std::size_t at);

  std::string_view in_;
  const std::string& file_;
  std::size_t pos_ = 0;
  std::vector<Node> stack_;
  std::vector<std::size_t> marks_;
  std::vector<Node> memo_;
  std::size_t copied_values_ = 0;  // by memo reads, against kMaxCopiedValues
  std::size_t copied_bytes_ = 0;   // against kMaxCopiedBytes
};

void Unpickler::step(uint8_t op, std::size_t at) {
  switch (op) {
    case 0x80: take(1); return;                                                      // PROTO
    case 0x95: take(8); return;                                                      // FRAME
    case '(': marks_.push_back(stack_.size()); return;                               // MARK
    case '}': push(Json::object()); return;                                          // EMPTY_DICT
    case ']': push(Json::array()); return;                                           // EMPTY_LIST
    case ')': push(Json::array()); return;                                           // EMPTY_TUPLE
    case 'N': push(nullptr); return;                                                 // NONE
    case 0x88: push(true); return;                                                   // NEWTRUE
    case 0x89: push(false); return;                                                  // NEWFALSE
    case 'K': push(static_cast<int64_t>(uint_le(1))); return;                        // BININT1
    case 'M': push(static_cast<int64_t>(uint_le(2))); return;                        // BININT2
    case 'J': push(static_cast<int64_t>(static_cast<int32_t>(uint_le(4)))); return;  // BININT
    case 0x8a: long_of(uint_le(1), at); return;                                      // LONG1
    case 0x8b: long_of(uint_le(4), at); return;                                      // LONG4
    case 'G': {  // BINFLOAT: big-endian double
      const std::string_view s = take(8);
      uint64_t bits = 0;
      for (char c : s) bits = (bits << 8) | static_cast<uint8_t>(c);
      double d = 0;
      std::memcpy(&d, &bits, sizeof d);
      push(d);
      return;
    }
    case 0x8c: push_string(take(uint_le(1))); return;  // SHORT_BINUNICODE
    case 'X': push_string(take(uint_le(4))); return;   // BINUNICODE
    case 0x8d: push_string(take(uint_le(8))); return;  // BINUNICODE8
    case 'C': push_string(take(uint_le(1))); return;   // SHORT_BINBYTES
    case 'B': push_string(take(uint_le(4))); return;   // BINBYTES
    case 0x85: tuple_of(1, at); return;                // TUPLE1
    case 0x86: tuple_of(2, at); return;                // TUPLE2
    case 0x87: tuple_of(3, at); return;                // TUPLE3
    case 't': push_tuple(since_mark(at), at); return;  // TUPLE
    case 'a': {                                        // APPEND
      Node v = pop(at);
      append(top(at), v, at);
      return;
    }
    case 'e': {  // APPENDS
      std::vector<Node> items = since_mark(at);
      Item& list = top(at);
      for (Node& n : items) append(list, n, at);
      return;
    }
    case 's': {  // SETITEM
      Node v = pop(at);
      Node k = pop(at);
      set_item(top(at), k->v, v, at);
      return;
    }
    case 'u': {  // SETITEMS
      std::vector<Node> items = since_mark(at);
      if (items.size() % 2 != 0)
        raise(file_, fmt::format("pickle SETITEMS with an odd number of values at offset {}", at));
      Item& dict = top(at);
      for (std::size_t i = 0; i < items.size(); i += 2)
        set_item(dict, items[i]->v, items[i + 1], at);
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
