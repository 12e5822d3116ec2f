// Call descriptions, comparison and fixed-size fingerprints (see
// fingerprint.hpp): shared by the simulated world and the checked mode of the
// production backends, so both report a mismatch in the same words.
#include "diffcomm/dist/backend/fingerprint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

#include "agreement.hpp"
#include "diffcomm/error.hpp"

namespace diffcomm::dist {
namespace {

using agreement::rule;
using agreement::Shapes;

bool has_reduce(OpType op) { return rule(op).reduce; }
bool has_root(OpType op) { return rule(op).root; }

std::string shapes_str(const std::vector<Shape>& shapes) {
  std::vector<std::string> parts;
  parts.reserve(shapes.size());
  for (const auto& s : shapes) parts.push_back(shape_str(s));
  return fmt::format("{}", fmt::join(parts, ","));
}

// The shape every member of a same-shape op must agree on: the output for
// the ops whose input list is empty off the root or per peer.
const Shape& shape_of(const CallDesc& c) {
  static const Shape none;
  const std::vector<Shape>& list = rule(c.op).shapes == Shapes::SameOutput ? c.outputs : c.inputs;
  return list.empty() ? none : list[0];
}
Shape row_shape(const std::vector<Shape>& shapes) {
  if (shapes.empty() || shapes[0].empty()) return {};
  return Shape(shapes[0].begin() + 1, shapes[0].end());
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
  return w;
}

CallDesc deserialize(const int64_t* w, std::size_t n) {
  std::size_t at = 0;
  auto take = [&]() -> int64_t {
    if (at >= n) throw InvalidArgument("deserialize: call description is truncated");
    return w[at++];
  };
  auto take_count = [&]() {
    const int64_t k = take();
    if (k < 0 || static_cast<std::size_t>(k) > n - at)
      throw InvalidArgument(fmt::format("deserialize: bad list length {}", k));
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
    throw InvalidArgument(fmt::format("deserialize: bad op {}", op));
  c.op = static_cast<OpType>(op);
  c.seq = static_cast<uint64_t>(take());
  c.dtype = static_cast<DType>(take());
  c.root = static_cast<int>(take());
  c.tag = static_cast<int>(take());
  const int64_t kind = take();
  const auto factor = std::bit_cast<double>(take());
  if (kind < 0 || kind > static_cast<int64_t>(ReduceOp::PremulSum))
    throw InvalidArgument(fmt::format("deserialize: bad reduce op {}", kind));
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
    throw InvalidArgument(fmt::format("deserialize: bad forward op {}", backward_op));
  if (backward_op >= 0) c.backward_of = CallId{static_cast<OpType>(backward_op), backward_seq};
  return c;
}

std::string compare(const std::vector<const CallDesc*>& c, const std::vector<int>& globals) {
  const std::size_t n = c.size();
  auto label = [&](std::size_t i) { return rank_label(static_cast<int>(i), globals[i]); };
  auto differ = [&](std::size_t a, std::size_t b, const std::string& field) {
    return fmt::format("{} called {} but {} called {}: {} differs", label(a), signature(*c[a]),
                       label(b), signature(*c[b]), field);
  };
  const agreement::Rule r = rule(c[0]->op);
  for (std::size_t i = 1; i < n; ++i) {
    if (c[i]->op != c[0]->op) return differ(0, i, "op");
    if (c[i]->backward_of != c[0]->backward_of) return differ(0, i, "forward call");
    if (r.shapes == Shapes::Members) {
      if (c[i]->members_are_ranks != c[0]->members_are_ranks)
        return differ(0, i, "kind of split (new_group vs split)");
      if (c[i]->members != c[0]->members)
        return differ(0, i, c[0]->members_are_ranks ? "member list" : "fingerprint");
      continue;
    }
    if (!r.data) continue;
    if (c[i]->dtype != c[0]->dtype) return differ(0, i, "dtype");
    if (r.root && c[i]->root != c[0]->root) return differ(0, i, "root");
    if (r.reduce && c[i]->reduce_op != c[0]->reduce_op) return differ(0, i, "reduce op");
  }
  if (agreement::same_shape(r)) {
    for (std::size_t i = 1; i < n; ++i)
      if (shape_of(*c[i]) != shape_of(*c[0])) return differ(0, i, "shape");
    return "";
  }
  switch (r.shapes) {
    case Shapes::OutputSplits:
    case Shapes::InputSplits: {
      // The splits every member must agree on: the output's for the gather,
      // the input's for the reduce-scatter.
      const bool gather = r.shapes == Shapes::OutputSplits;
      auto splits = [&](std::size_t i) -> const std::vector<int64_t>& {
        return gather ? c[i]->output_splits : c[i]->input_splits;
      };
      for (std::size_t i = 1; i < n; ++i) {
        if (splits(i) != splits(0)) return differ(0, i, gather ? "output_splits" : "input_splits");
        if (row_shape(c[i]->inputs) != row_shape(c[0]->inputs)) return differ(0, i, "row shape");
      }
      break;
    }
    case Shapes::CrossSplits:
      for (std::size_t i = 0; i < n; ++i) {
        if (row_shape(c[i]->inputs) != row_shape(c[0]->inputs)) return differ(0, i, "row shape");
        for (std::size_t j = 0; j < n; ++j)
          if (c[i]->input_splits[j] != c[j]->output_splits[i])
            return fmt::format(
                "{} sends input_splits[{}] = {} rows to {}, but that rank expects "
                "output_splits[{}] = {} rows from it: {} calls {}, {} calls {}: splits differ",
                label(i), j, c[i]->input_splits[j], label(j), i, c[j]->output_splits[i], label(i),
                signature(*c[i]), label(j), signature(*c[j]));
      }
      break;
    case Shapes::CrossShapes:
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t s = 0; s < n; ++s)
          if (c[i]->outputs[s] != c[s]->inputs[i])
            return fmt::format(
                "{} expects outputs[{}] of shape {} but {} sends inputs[{}] of shape {}: shape "
                "differs",
                label(i), s, shape_str(c[i]->outputs[s]), label(s), i, shape_str(c[s]->inputs[i]));
      break;
    default: break;
  }
  return "";
}

// Tag in the top two bits: 0-d, 1-d, 2-d.
uint64_t shape_code(const Shape& s) {
  constexpr uint64_t k31 = uint64_t{1} << 31, k62 = uint64_t{1} << 62;
  auto fits = [](int64_t d, uint64_t limit) { return d >= 0 && static_cast<uint64_t>(d) < limit; };
  if (s.empty()) return uint64_t{1} << 62;
  if (s.size() == 1 && fits(s[0], k62)) return (uint64_t{2} << 62) | static_cast<uint64_t>(s[0]);
  if (s.size() == 2 && fits(s[0], k31) && fits(s[1], k31))
    return (uint64_t{3} << 62) | (static_cast<uint64_t>(s[0]) << 31) | static_cast<uint64_t>(s[1]);
  return 0;
}

namespace {

const Shape& first_shape(const TensorList& ts) {
  static const Shape none;
  return ts.empty() ? none : ts[0].shape();
}
// row_shape() of the shapes of `ts`, compared in place.
bool same_row_shape(const TensorList& a, const TensorList& b) {
  const Shape& x = first_shape(a);
  const Shape& y = first_shape(b);
  if (x.empty() || y.empty()) return x.size() <= 1 && y.size() <= 1;
  return std::equal(x.begin() + 1, x.end(), y.begin() + 1, y.end());
}
bool all_defined(const TensorList& ts) {
  return std::all_of(ts.begin(), ts.end(), [](const Tensor& t) { return t.defined(); });
}

// True when compare() of the members' descriptions would return "": the same
// rules, read straight from the Calls. Building N descriptions copies every
// shape and split list (N^2 entries for all_to_all and all_to_all_single: 4
// GiB at 16384 ranks, and most of a 1024-rank list-form call's time), only to
// find that they agree, which is the common case.
bool calls_agree(const std::vector<const Call*>& c, const AllToAllCodes* codes) {
  const std::size_t n = c.size();
  const Call& c0 = *c[0];
  for (std::size_t i = 0; i < n; ++i)
    if (!all_defined(c[i]->inputs) || !all_defined(c[i]->outputs)) return false;
  const agreement::Rule r = rule(c0.op);
  for (std::size_t i = 1; i < n; ++i) {
    const Call& ci = *c[i];
    if (ci.op != c0.op || ci.backward_of != c0.backward_of) return false;
    if (r.shapes == Shapes::Members) {
      if (ci.members_are_ranks != c0.members_are_ranks || ci.members != c0.members) return false;
      continue;
    }
    if (!r.data) continue;
    if (ci.dtype != c0.dtype || (r.root && ci.root != c0.root) ||
        (r.reduce && ci.reduce_op != c0.reduce_op))
      return false;
  }
  if (agreement::same_shape(r)) {
    const bool outs = r.shapes == Shapes::SameOutput;
    const Shape& s0 = first_shape(outs ? c0.outputs : c0.inputs);
    // By exact code when the shape has one (no memcmp call per member).
    const uint64_t k0 = shape_code(s0);
    for (std::size_t i = 1; i < n; ++i) {
      const Shape& si = first_shape(outs ? c[i]->outputs : c[i]->inputs);
      if (k0 != 0 ? shape_code(si) != k0 : si != s0) return false;
    }
    return true;
  }
  switch (r.shapes) {
    case Shapes::OutputSplits:
    case Shapes::InputSplits: {
      const bool gather = r.shapes == Shapes::OutputSplits;
      for (std::size_t i = 1; i < n; ++i) {
        if (!(gather ? c[i]->output_splits == c0.output_splits
                     : c[i]->input_splits == c0.input_splits))
          return false;
        if (!same_row_shape(c[i]->inputs, c0.inputs)) return false;
      }
      return true;
    }
    case Shapes::CrossSplits: {
      bool uniform = true;  // every list uniform with one value: agree in O(N)
      const int64_t v = c0.input_splits.uniform_value();
      for (std::size_t i = 0; i < n; ++i) {
        if (!same_row_shape(c[i]->inputs, c0.inputs)) return false;
        const Call& ci = *c[i];
        if (ci.input_splits.size() != n || ci.output_splits.size() != n) return false;
        uniform = uniform && ci.input_splits.is_uniform() && ci.output_splits.is_uniform() &&
                  ci.input_splits.uniform_value() == v && ci.output_splits.uniform_value() == v;
      }
      if (uniform) return true;
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < n; ++j)
          if (c[i]->input_splits[j] != c[j]->output_splits[i]) return false;
      return true;
    }
    case Shapes::CrossShapes: {
      for (std::size_t i = 0; i < n; ++i)
        if (c[i]->inputs.size() != n || c[i]->outputs.size() != n) return false;
      // Shapes read rank by rank into exact codes (or given so), then
      // compared in the transposed order from that table: comparing tensor
      // to tensor reads N^2 shapes in transposed order, a cache miss each at
      // 1024 ranks.
      std::vector<uint64_t> in_table, out_table;
      const uint64_t* in = codes != nullptr ? codes->in : nullptr;
      const uint64_t* out = codes != nullptr ? codes->out : nullptr;
      if (in == nullptr || out == nullptr) {
        in_table.resize(n * n);
        out_table.resize(n * n);
        for (std::size_t s = 0; s < n; ++s)
          for (std::size_t i = 0; i < n; ++i) {
            in_table[s * n + i] = shape_code(c[s]->inputs[i].shape());
            out_table[s * n + i] = shape_code(c[s]->outputs[i].shape());
          }
        in = in_table.data();
        out = out_table.data();
      }
      // In tiles of kTile x kTile: the transposed reads of one tile touch
      // kTile rows of kTile entries, which stay in cache and in the TLB
      // (row by row, every read of `in` was a new page at 1024 ranks). The
      // answer does not depend on the order.
      constexpr std::size_t kTile = 64;
      for (std::size_t i0 = 0; i0 < n; i0 += kTile)
        for (std::size_t s0 = 0; s0 < n; s0 += kTile)
          for (std::size_t i = i0; i < std::min(n, i0 + kTile); ++i)
            for (std::size_t s = s0; s < std::min(n, s0 + kTile); ++s) {
              const uint64_t a = out[i * n + s], b = in[s * n + i];
              if (a != 0 && b != 0) {
                if (a != b) return false;
              } else if (c[i]->outputs[s].shape() != c[s]->inputs[i].shape()) {
                return false;
              }
            }
      return true;
    }
    default: return true;
  }
}

}  // namespace

std::string compare(const std::vector<const Call*>& calls, const std::vector<int>& globals) {
  return compare(calls, globals, AllToAllCodes{});
}

std::string compare(const std::vector<const Call*>& calls, const std::vector<int>& globals,
                    const AllToAllCodes& codes) {
  if (calls.empty() || calls_agree(calls, &codes)) return "";
  // Disagreement (rare): the descriptions give the one wording of the report.
  std::vector<CallDesc> descs;
  descs.reserve(calls.size());
  for (const Call* c : calls) descs.push_back(describe(*c));
  std::vector<const CallDesc*> ptrs;
  ptrs.reserve(descs.size());
  for (const auto& d : descs) ptrs.push_back(&d);
  return compare(ptrs, globals);
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
                                                            "forward call"};
  for (std::size_t k = 0; k < kFingerprintWords; ++k)
    if (a[k] != b[k]) return kNames[k];
  return "";
}

bool fingerprints_agree(const std::vector<Fingerprint>& prints) {
  if (prints.empty()) return true;
  const Fingerprint& a = prints[0];
  uint64_t out_edges = 0, in_edges = 0;
  for (const auto& p : prints) {
    if (p[0] != a[0] || p[1] != a[1]) return false;
    if (rule(static_cast<OpType>(a[0])).data)
      for (std::size_t k = 2; k <= 7; ++k)
        if (p[k] != a[k]) return false;
    if (p[10] != a[10] || p[11] != a[11] || p[12] != a[12] || p[13] != a[13]) return false;
    out_edges += static_cast<uint64_t>(p[8]);
    in_edges += static_cast<uint64_t>(p[9]);
  }
  return out_edges == in_edges;
}

std::string compare_p2p(const CallDesc& send, int src, int src_global, const CallDesc& recv,
                        int dst, int dst_global) {
  const Shape& sent = send.inputs.empty() ? Shape{} : send.inputs[0];
  const Shape& into = recv.outputs.empty() ? Shape{} : recv.outputs[0];
  if (send.dtype == recv.dtype && sent == into) return "";
  return fmt::format("{} sends {}{} (tag {}) but {} receives into {}{}: shape or dtype differs",
                     rank_label(src, src_global), dtype_name(send.dtype), shape_str(sent), send.tag,
                     rank_label(dst, dst_global), dtype_name(recv.dtype), shape_str(into));
}

}  // namespace diffcomm::dist
