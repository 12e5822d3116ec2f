#pragma once
// Plain values shared by the planner, the exchange and the decoder merge.
// Every rank derives them identically from replicated batch metadata;
// nothing is inferred from local tensor shapes.
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::encoder_parallel {

/// One image for the vision encoder.
struct EncoderWorkItem {
  int64_t item_id = 0;              ///< unique within a micro-batch
  int64_t batch_index = 0;          ///< sample of the micro-batch
  int64_t decoder_token_start = 0;  ///< first image token, within the sample
  int64_t input_rows = 0;           ///< encoder patches (encoder cost)
  int64_t output_rows = 0;          ///< feature rows = decoder image tokens
  friend bool operator==(const EncoderWorkItem&, const EncoderWorkItem&) = default;
};

/// A work item with its features: rows is [output_rows, hidden].
struct EncoderFeature {
  EncoderWorkItem item;
  Tensor rows;
};

/// The decoder topology as one rank sees it. Mesh order {dp, cp, tp}, TP
/// fastest: parent (CP x TP) rank = cp_rank * tp_size + tp_rank.
struct MeshContext {
  int cp_size = 1;
  int tp_size = 1;
  bool sequence_parallel = false;
  int cp_rank = 0;
  int tp_rank = 0;
  int parent_rank() const { return cp_rank * tp_size + tp_rank; }
};

/// How features reach their decoder owners (DESIGN.md).
enum class FeatureExchangeMode {
  Local,                ///< tp = 1, cp = 1: no communication
  TpVariableAllGather,  ///< TP without SP: every TP rank needs every row
  TpVariableA2A,        ///< TP with SP: rows go only to the owners of their tokens
  ParentVariableA2A,    ///< CP > 1: all-to-all over the CP x TP parent group
};

/// cp > 1 -> ParentVariableA2A; else tp == 1 -> Local; else SP ->
/// TpVariableA2A; else TpVariableAllGather. Depends on the topology alone, so
/// every rank picks the same mode.
FeatureExchangeMode select_feature_exchange(const MeshContext& mesh);

/// "local", "tp_variable_all_gather", "tp_variable_a2a", "parent_variable_a2a".
std::string mode_name(FeatureExchangeMode mode);

/// Gradient convention of the receivers of a row.
///  - Partial: receivers own distinct tokens (SP or CP shards, straddling
///    images); the exchange's backward sums their gradients (the adjoint).
///  - ReplicatedOverTp: receivers include TP replicas (no SP) whose
///    gradients are already complete and equal (Megatron all-reduces the
///    input gradient over TP); backward takes one copy per CP owner (the TP
///    rank 0 copy) instead of summing tp equal copies.
enum class ReceiverGrad { Partial, ReplicatedOverTp };

/// The convention a Megatron-style decoder needs: ReplicatedOverTp when
/// tp > 1 without SP, else Partial.
ReceiverGrad receiver_grad_for(const MeshContext& mesh);

}  // namespace diffcomm::encoder_parallel
