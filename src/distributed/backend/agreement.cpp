// Whether the members of one call agree (agreement.hpp's rules): compare()
// names the first difference in the words every backend reports, and
// calls_agree() is its fast path over the Calls themselves.
#include "agreement.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

using agreement::row_shape;
using agreement::rule;
using agreement::shape_of;
using agreement::Shapes;

std::string compare(const std::vector<const CallDesc*>& c, const std::vector<int>& globals) {
  const std::size_t n = c.size();
  auto label = [&](std::size_t i) { return rank_label(static_cast<int>(i), globals[i]); };
  auto differ = [&](std::size_t a, std::size_t b, const std::string& field) {
    return fmt::format("{} called {} but {} called {}: {} differs", label(a), signature(*c[a]),
                       label(b), signature(*c[b]), field);
  };
  for (std::size_t i = 0; i < n; ++i)
    if (!c[i]->refused.empty())
      return fmt::format("{} refused its own call {}: {}", label(i), signature(*c[i]),
                         c[i]->refused);
  for (std::size_t i = 1; i < n; ++i)
    if (c[i]->thread_index != c[0]->thread_index)
      return fmt::format(
          "{} called {} from its thread #{} but {} called {} from its thread #{}: calling thread "
          "differs (thread #k: the k-th thread to make collective calls on this group, from 0; "
          "threads taking turns on one group must take them in the same order on every rank, "
          "or each use a group of its own)",
          label(0), signature(*c[0]), c[0]->thread_index, label(i), signature(*c[i]),
          c[i]->thread_index);
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
    if (ci.op != c0.op || ci.backward_of != c0.backward_of || ci.thread_index != c0.thread_index)
      return false;
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

std::string compare_p2p(const CallDesc& send, int src, int src_global, const CallDesc& recv,
                        int dst, int dst_global) {
  const Shape& sent = send.inputs.empty() ? Shape{} : send.inputs[0];
  const Shape& into = recv.outputs.empty() ? Shape{} : recv.outputs[0];
  if (send.dtype == recv.dtype && sent == into) return "";
  return fmt::format("{} sends {}{} (tag {}) but {} receives into {}{}: shape or dtype differs",
                     rank_label(src, src_global), dtype_name(send.dtype), shape_str(sent), send.tag,
                     rank_label(dst, dst_global), dtype_name(recv.dtype), shape_str(into)) +
         call_sites({send.caller, recv.caller}, {src_global, dst_global});
}

}  // namespace diffcomm::dist
