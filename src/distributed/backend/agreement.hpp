#pragma once
// What the members of one call must agree on, per op: the one table read by
// compare() (the simulated world's rendezvous and checked mode's report),
// calls_agree() (the simulated world's fast path) and fingerprint() (checked
// mode's fixed-size exchange), so the three cannot drift apart. Internal to
// src/distributed/backend/ (agreement.cpp, fingerprint.cpp, checked_backend.cpp).
#include "diffcomm/distributed/backend/call.hpp"
#include "diffcomm/distributed/backend/fingerprint.hpp"

namespace diffcomm::dist::agreement {

/// Which shapes and splits must agree, and how.
enum class Shapes {
  None,          ///< nothing beyond the op (barrier; send/recv compare envelopes instead)
  SameInput,     ///< every member's inputs[0] has one shape
  SameOutput,    ///< every member's outputs[0] has one shape (the input list is per peer)
  OutputSplits,  ///< equal output_splits and equal row shape (all_gather_v)
  InputSplits,   ///< equal input_splits and equal row shape (reduce_scatter_v)
  CrossSplits,   ///< input_splits[j] on i == output_splits[i] on j, equal row shape
  CrossShapes,   ///< outputs[s] on i has the shape of inputs[i] on s (all_to_all)
  Members,       ///< new_group: equal member lists; split: equal fingerprints
};

struct Rule {
  bool data = true;     ///< carries tensors: the dtype must agree
  bool root = false;    ///< the root (src/dst) must agree
  bool reduce = false;  ///< the reduce op (with PremulSum's factor) must agree
  Shapes shapes = Shapes::None;
};

constexpr Rule rule(OpType op) {
  switch (op) {
    case OpType::Barrier: return {false, false, false, Shapes::None};
    case OpType::AllReduce: return {true, false, true, Shapes::SameInput};
    case OpType::Broadcast: return {true, true, false, Shapes::SameInput};
    case OpType::Reduce: return {true, true, true, Shapes::SameInput};
    case OpType::AllGather: return {true, false, false, Shapes::SameInput};
    case OpType::AllGatherSingle: return {true, false, false, Shapes::SameInput};
    case OpType::AllGatherV: return {true, false, false, Shapes::OutputSplits};
    case OpType::Gather: return {true, true, false, Shapes::SameInput};
    case OpType::Scatter: return {true, true, false, Shapes::SameOutput};
    case OpType::ReduceScatter: return {true, false, true, Shapes::SameOutput};
    case OpType::ReduceScatterSingle: return {true, false, true, Shapes::SameInput};
    case OpType::ReduceScatterV: return {true, false, true, Shapes::InputSplits};
    case OpType::AllToAll: return {true, false, false, Shapes::CrossShapes};
    case OpType::AllToAllSingle: return {true, false, false, Shapes::CrossSplits};
    case OpType::Send:
    case OpType::Recv: return {true, false, false, Shapes::None};
    case OpType::NewGroup: return {false, false, false, Shapes::Members};
  }
  return {};
}

/// One common shape per member (SameInput or SameOutput).
constexpr bool same_shape(const Rule& r) {
  return r.shapes == Shapes::SameInput || r.shapes == Shapes::SameOutput;
}

// The shape every member of a same-shape op must agree on: the output for
// the ops whose input list is empty off the root or per peer.
inline const Shape& shape_of(const CallDesc& c) {
  static const Shape none;
  const std::vector<Shape>& list = rule(c.op).shapes == Shapes::SameOutput ? c.outputs : c.inputs;
  return list.empty() ? none : list[0];
}
inline Shape row_shape(const std::vector<Shape>& shapes) {
  if (shapes.empty() || shapes[0].empty()) return {};
  return Shape(shapes[0].begin() + 1, shapes[0].end());
}

}  // namespace diffcomm::dist::agreement
