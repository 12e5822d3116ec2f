// Call descriptions, comparison and fixed-size fingerprints (see
// fingerprint.hpp): shared by the simulated world and the checked mode of the
// production backends, so both report a mismatch in the same words.
#include "diffcomm/distributed/backend/fingerprint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

#include "agreement.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {
namespace {

using agreement::row_shape;
using agreement::rule;
using agreement::shape_of;
using agreement::Shapes;

bool has_reduce(OpType op) { return rule(op).reduce; }
// Fingerprint word 0 of a member refusing its own call (no op has it).
constexpr int64_t kRefusedWord = -2;
bool has_root(OpType op) { return rule(op).root; }

std::string shapes_str(const std::vector<Shape>& shapes) {
  std::vector<std::string> parts;
  parts.reserve(shapes.size());
  for (const auto& s : shapes) parts.push_back(shape_str(s));
  return fmt::format("{}", fmt::join(parts, ","));
}

// SplitMix64 finaliser: a well-mixed 64-bit hash step.
uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
template <class List>
uint64_t hash_words(const List& v, uint64_t seed) {
  uint64_t h = mix(seed ^ v.size());
  for (int64_t x : v) h = mix(h ^ static_cast<uint64_t>(x));
  return h;
}
uint64_t hash_shape(const Shape& s) { return hash_words(s, 0x5ba9e); }
// A (sender, receiver, value) triple: summed over all members, the senders'
// and receivers' views agree exactly when every pair agrees.
// A reduce op as one word: its kind, and for PremulSum the factor's bits, so
// members passing different factors disagree.
int64_t reduce_word(ReduceOp op) {
  if (op != ReduceOp::PremulSum) return static_cast<int64_t>(op.kind());
  // Factors compare as numbers (ReduceOp's ==, compare()): +0.0 and -0.0
  // are one factor, so they must hash alike (their bits differ).
  const double factor = op.factor() == 0.0 ? 0.0 : op.factor();
  const uint64_t h = mix(std::bit_cast<uint64_t>(factor) ^ op.kind());
  return static_cast<int64_t>((h << 8) | op.kind());
}
uint64_t edge(int from, int to, uint64_t value) {
  return mix(mix(static_cast<uint64_t>(from) * 0x100000001b3ull + static_cast<uint64_t>(to)) ^
             value);
}

}  // namespace

std::string rank_label(int group_rank, int global_rank) {
  return fmt::format("rank {} (global {})", group_rank, global_rank);
}

std::string call_sites(const std::vector<std::string>& callers, const std::vector<int>& globals) {
  std::vector<std::pair<std::string_view, std::vector<int>>> sites;
  for (std::size_t i = 0; i < callers.size(); ++i) {
    if (callers[i].empty()) continue;
    auto it = std::find_if(sites.begin(), sites.end(),
                           [&](const auto& s) { return s.first == callers[i]; });
    if (it == sites.end()) it = sites.insert(sites.end(), {callers[i], {}});
    it->second.push_back(globals[i]);
  }
  if (sites.empty()) return "";
  std::string out = "\ncalled at: ";
  for (std::size_t k = 0; k < sites.size(); ++k) {
    const auto& [at, rs] = sites[k];
    const std::size_t shown = std::min<std::size_t>(rs.size(), 8);
    out += fmt::format("{}{} (rank{} {}{})", k ? ", " : "", at, rs.size() > 1 ? "s" : "",
                       fmt::join(rs.begin(), rs.begin() + static_cast<std::ptrdiff_t>(shown), ","),
                       rs.size() > shown ? fmt::format(" and {} more", rs.size() - shown) : "");
  }
  return out;
}

CallDesc describe(const Call& call) {
  CallDesc d;
  d.op = call.op;
  d.seq = call.seq;
  d.dtype = call.dtype;
  d.root = call.root;
  d.tag = call.tag;
  d.reduce_op = call.reduce_op;
  d.inputs.reserve(call.inputs.size());
  for (const auto& t : call.inputs) d.inputs.push_back(t.defined() ? t.shape() : Shape{});
  d.outputs.reserve(call.outputs.size());
  for (const auto& t : call.outputs) d.outputs.push_back(t.defined() ? t.shape() : Shape{});
  d.input_splits = call.input_splits.to_vector();
  d.output_splits = call.output_splits.to_vector();
  d.members = call.members;
  d.color = call.color;
  d.key = call.key;
  d.members_are_ranks = call.members_are_ranks;
  d.backward_of = call.backward_of;
  d.thread_index = call.thread_index;
  d.caller = call.caller.str();
  return d;
}

namespace {
std::string plain_signature(const CallDesc& c);
}  // namespace

std::string signature(const CallDesc& c) {
  if (!c.backward_of) return plain_signature(c);
  return fmt::format("{} (backward of {} #{})", plain_signature(c), op_name(c.backward_of->op),
                     c.backward_of->seq);
}

namespace {
std::string plain_signature(const CallDesc& c) {
  if (c.op == OpType::NewGroup) {
    // new_group passes its member list (group ranks); ProcessGroup::split
    // (device meshes, encoder CP groups) its caller's fingerprint, which is
    // no member list: print each as what it is.
    if (c.members_are_ranks)
      return fmt::format("new_group(ranks=[{}]{})", fmt::join(c.members, ","),
                         c.color < 0 ? ", not a member" : "");
    return fmt::format("split(color={}, key={}, fingerprint=[{}])", c.color, c.key,
                       fmt::join(c.members, ","));
  }
  std::string s = op_name(c.op) + "(";
  if (c.op != OpType::Barrier) {
    s += dtype_name(c.dtype);
    if (!c.inputs.empty()) s += fmt::format(", in={}", shapes_str(c.inputs));
    if (!c.outputs.empty() && c.op != OpType::AllReduce && c.op != OpType::Broadcast &&
        c.op != OpType::Reduce)
      s += fmt::format(", out={}", shapes_str(c.outputs));
  }
  if (has_root(c.op)) s += fmt::format(", root={}", c.root);
  if (c.op == OpType::Send || c.op == OpType::Recv)
    s += fmt::format(", peer={}, tag={}", c.root, c.tag);
  if (has_reduce(c.op)) s += ", op=" + reduce_op_name(c.reduce_op);
  if (!c.input_splits.empty())
    s += fmt::format(", input_splits=[{}]", fmt::join(c.input_splits, ","));
  if (!c.output_splits.empty())
    s += fmt::format(", output_splits=[{}]", fmt::join(c.output_splits, ","));
  return s + ")";
}
}  // namespace

std::vector<int64_t> serialize(const CallDesc& c) {
  std::vector<int64_t> w = {static_cast<int64_t>(c.op),
                            static_cast<int64_t>(c.seq),
                            static_cast<int64_t>(c.dtype),
                            c.root,
                            c.tag,
                            static_cast<int64_t>(c.reduce_op.kind()),
                            std::bit_cast<int64_t>(c.reduce_op.factor()),
                            c.color,
                            c.key,
                            c.members_are_ranks ? 1 : 0};
  auto put_list = [&](const std::vector<int64_t>& v) {
    w.push_back(static_cast<int64_t>(v.size()));
    w.insert(w.end(), v.begin(), v.end());
  };
  auto put_shapes = [&](const std::vector<Shape>& shapes) {
    w.push_back(static_cast<int64_t>(shapes.size()));
    for (const auto& s : shapes) put_list(s);
  };
  put_shapes(c.inputs);
  put_shapes(c.outputs);
  put_list(c.input_splits);
  put_list(c.output_splits);
  put_list(c.members);
  w.push_back(c.backward_of ? static_cast<int64_t>(c.backward_of->op) : -1);
  w.push_back(c.backward_of ? static_cast<int64_t>(c.backward_of->seq) : 0);
  w.push_back(c.thread_index);
  // The refusal's text and the caller, eight bytes per word after a length.
  for (const std::string* text : {&c.refused, &c.caller}) {
    w.push_back(static_cast<int64_t>(text->size()));
    for (std::size_t i = 0; i < text->size(); i += 8) {
      uint64_t word = 0;
      for (std::size_t k = 0; k < 8 && i + k < text->size(); ++k)
        word |= static_cast<uint64_t>(static_cast<unsigned char>((*text)[i + k])) << (8 * k);
      w.push_back(static_cast<int64_t>(word));
    }
  }
  return w;
}

CallDesc deserialize(const int64_t* w, std::size_t n) {
  std::size_t at = 0;
  auto take = [&]() -> int64_t {
    if (at >= n) raise("deserialize", "call description is truncated");
    return w[at++];
  };
  auto take_count = [&]() {
    const int64_t k = take();
    if (k < 0 || static_cast<std::size_t>(k) > n - at)
      raise("deserialize", fmt::format("bad list length {}", k));
    return static_cast<std::size_t>(k);
  };
  auto take_list = [&]() {
    std::vector<int64_t> v(take_count());
    for (auto& x : v) x = take();
    return v;
  };
  auto take_shapes = [&]() {
    std::vector<Shape> shapes(take_count());
    for (auto& s : shapes) s = take_list();
    return shapes;
  };
  CallDesc c;
  const int64_t op = take();
  if (op < 0 || op > static_cast<int64_t>(OpType::NewGroup))
    raise("deserialize", fmt::format("bad op {}", op));
  c.op = static_cast<OpType>(op);
  c.seq = static_cast<uint64_t>(take());
  c.dtype = static_cast<DType>(take());
  c.root = static_cast<int>(take());
  c.tag = static_cast<int>(take());
  const int64_t kind = take();
  const auto factor = std::bit_cast<double>(take());
  if (kind < 0 || kind > static_cast<int64_t>(ReduceOp::PremulSum))
    raise("deserialize", fmt::format("bad reduce op {}", kind));
  c.reduce_op = kind == ReduceOp::PremulSum ? ReduceOp::premul_sum(factor)
                                            : ReduceOp(static_cast<ReduceOp::Kind>(kind));
  c.color = static_cast<int>(take());
  c.key = static_cast<int>(take());
  c.members_are_ranks = take() != 0;
  c.inputs = take_shapes();
  c.outputs = take_shapes();
  c.input_splits = take_list();
  c.output_splits = take_list();
  c.members = take_list();
  const int64_t backward_op = take();
  const auto backward_seq = static_cast<uint64_t>(take());
  if (backward_op > static_cast<int64_t>(OpType::NewGroup))
    raise("deserialize", fmt::format("bad forward op {}", backward_op));
  if (backward_op >= 0) c.backward_of = CallId{static_cast<OpType>(backward_op), backward_seq};
  c.thread_index = static_cast<int>(take());
  for (std::string* text : {&c.refused, &c.caller}) {
    const int64_t length = take();
    if (length < 0 || static_cast<std::size_t>(length) > 8 * (n - at))
      raise("deserialize",
            fmt::format("bad {} length {}", text == &c.refused ? "refusal" : "caller", length));
    text->resize(static_cast<std::size_t>(length));
    for (std::size_t i = 0; i < text->size(); i += 8) {
      const auto word = static_cast<uint64_t>(take());
      for (std::size_t k = 0; k < 8 && i + k < text->size(); ++k)
        (*text)[i + k] = static_cast<char>((word >> (8 * k)) & 0xff);
    }
  }
  return c;
}

Fingerprint fingerprint(const Call& call) {
  Fingerprint f{};
  const OpType op = call.op;
  const agreement::Rule r = rule(op);
  f[0] = static_cast<int64_t>(op);
  f[1] = static_cast<int64_t>(call.seq);
  f[2] = r.data ? static_cast<int64_t>(call.dtype) : -1;
  f[3] = r.root ? call.root : -1;
  f[4] = r.reduce ? reduce_word(call.reduce_op) : -1;
  uint64_t shape = 0, row = 0, splits = 0, out_edges = 0, in_edges = 0, members = 0;
  auto shapes = [](const TensorList& ts) {
    std::vector<Shape> s;
    for (const auto& t : ts) s.push_back(t.shape());
    return s;
  };
  const int me = call.rank;
  const int n = call.group_size;
  if (agreement::same_shape(r)) {
    CallDesc d;
    d.op = op;
    d.inputs = shapes(call.inputs);
    d.outputs = shapes(call.outputs);
    shape = hash_shape(shape_of(d));
  }
  switch (r.shapes) {
    case Shapes::OutputSplits:
      row = hash_shape(row_shape(shapes(call.inputs)));
      splits = hash_words(call.output_splits, 1);
      break;
    case Shapes::InputSplits:
      row = hash_shape(row_shape(shapes(call.inputs)));
      splits = hash_words(call.input_splits, 2);
      break;
    case Shapes::CrossSplits:
      row = hash_shape(row_shape(shapes(call.inputs)));
      for (int j = 0; j < n; ++j) {
        out_edges += edge(me, j, static_cast<uint64_t>(call.input_splits[static_cast<size_t>(j)]));
        in_edges += edge(j, me, static_cast<uint64_t>(call.output_splits[static_cast<size_t>(j)]));
      }
      break;
    case Shapes::CrossShapes:
      for (int j = 0; j < n; ++j) {
        out_edges += edge(me, j, hash_shape(call.inputs[static_cast<size_t>(j)].shape()));
        in_edges += edge(j, me, hash_shape(call.outputs[static_cast<size_t>(j)].shape()));
      }
      break;
    case Shapes::Members: members = hash_words(call.members, call.members_are_ranks ? 3 : 4); break;
    default: break;
  }
  f[5] = static_cast<int64_t>(shape);
  f[6] = static_cast<int64_t>(row);
  f[7] = static_cast<int64_t>(splits);
  f[8] = static_cast<int64_t>(out_edges);
  f[9] = static_cast<int64_t>(in_edges);
  f[10] = static_cast<int64_t>(members);
  f[11] = call.group_size;
  f[12] = call.backward_of ? static_cast<int64_t>(call.backward_of->op) : -1;
  f[13] = call.backward_of ? static_cast<int64_t>(call.backward_of->seq) : -1;
  f[14] = call.thread_index;
  return f;
}

const char* fingerprint_field(const Fingerprint& a, const Fingerprint& b) {
  // The words fingerprint() fills, in order; the split edges (8, 9) are
  // per-member sums, so a pair of members cannot disagree on them alone.
  static constexpr const char* kNames[kFingerprintWords] = {"op",
                                                            "call number",
                                                            "dtype",
                                                            "root",
                                                            "reduce op",
                                                            "shape",
                                                            "row shape",
                                                            "splits",
                                                            "outgoing splits",
                                                            "incoming splits",
                                                            "member list",
                                                            "group size",
                                                            "forward call",
                                                            "forward call",
                                                            "calling thread"};
  for (std::size_t k = 0; k < kFingerprintWords; ++k)
    if (a[k] != b[k]) return kNames[k];
  return "";
}

Fingerprint refusal_fingerprint(const Call& call) {
  Fingerprint f{};
  f[0] = kRefusedWord;
  f[1] = static_cast<int64_t>(call.op);
  return f;
}

bool fingerprints_agree(const std::vector<Fingerprint>& prints) {
  if (prints.empty()) return true;
  const Fingerprint& a = prints[0];
  for (const auto& p : prints)
    if (p[0] == kRefusedWord) return false;  // a refusal never agrees
  uint64_t out_edges = 0, in_edges = 0;
  for (const auto& p : prints) {
    if (p[0] != a[0] || p[1] != a[1]) return false;
    if (rule(static_cast<OpType>(a[0])).data)
      for (std::size_t k = 2; k <= 7; ++k)
        if (p[k] != a[k]) return false;
    if (p[10] != a[10] || p[11] != a[11] || p[12] != a[12] || p[13] != a[13] || p[14] != a[14])
      return false;
    out_edges += static_cast<uint64_t>(p[8]);
    in_edges += static_cast<uint64_t>(p[9]);
  }
  return out_edges == in_edges;
}

}  // namespace diffcomm::dist
