#pragma once
// Routing encoder features to their decoder owners, differentiably.
#include <vector>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/encoder_parallel/contracts.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"

namespace diffcomm::encoder_parallel {

/// What one exchange rank received. In the A2A modes an entry of items is a
/// piece of a work item (Transfer): the item's item_id, batch_index and
/// input_rows, with decoder_token_start and output_rows narrowed to the run
/// of its tokens this rank owns (row r of the piece is row
/// decoder_token_start - item.decoder_token_start + r of the item). An item
/// appears once per run (zigzag CP can give a rank two runs of one image).
/// unpack_records and merge_into_decoder take pieces like whole items.
struct RoutedFeatures {
  Tensor rows;                         ///< [sum of received output_rows, hidden]
  std::vector<EncoderWorkItem> items;  ///< in row order: by source producer, then bucket order
};

/// Sends each producer's records to the exchange ranks that need them.
///  - producer_records: this rank's complete features, exactly the items of
///    the bucket it produces, in bucket order; empty on non-producers.
///  - prototype: a [0, hidden] (or any [n, hidden]) tensor fixing dtype,
///    device and width, and the autograd anchor of an empty sender (so a
///    rank with nothing to send still runs the backward collective).
///  - exchange_rank / group: this rank in the exchange group (the TP group
///    in TP modes, the CP x TP parent group in the parent mode).
///  - plan: buckets and destinations; group.size() must equal
///    plan.encoder.buckets * plan.encoder.encoder_cp (InvalidArgument).
///  - grad: the receivers' gradient convention (explicit; see ReceiverGrad).
/// Local: no communication. TpVariableAllGather: every producer's records
/// reach every rank (all_gather_v; ReplicatedOverTp keeps each rank's own
/// copy in backward); there every rank owns every token. A2A modes: each
/// destination gets only the rows of the tokens it owns (ExchangePlan::
/// sends: one all_to_all_single with per-(item, destination) row ranges), so
/// each row crosses once to each owner (PlanStats::owner_minimum_bytes);
/// backward adds each piece's gradient into its rows of the record
/// (ReplicatedOverTp counts the TP rank 0 copy of each CP owner). Throws InvalidArgument when the
/// plan is not valid (ExchangePlan::validate, message names the field) or the records disagree with
/// it (items, order, row counts, width).
/// The records and the prototype are taken by value: moved in, their rows
/// are freed once packed into the send buffer, before the collective (the
/// autograd graph keeps only their shapes).
RoutedFeatures route_features(FeatureExchangeMode mode,
                              std::vector<EncoderFeature> producer_records, Tensor prototype,
                              int exchange_rank, const ExchangePlan& plan,
                              const dist::ProcessGroup& group, ReceiverGrad grad);

/// Splits transported rows by the plan into records ordered by
/// (batch_index, decoder_token_start, item_id). received_items may be
/// pieces of items (RoutedFeatures): each becomes a record of its own rows.
/// Each record's rows are a differentiable view. Throws InvalidArgument for a negative output_rows,
/// a total above 2^63, or when rows' row count differs from the items' total output_rows (both
/// counts in the message).
std::vector<EncoderFeature> unpack_records(const Tensor& rows,
                                           const std::vector<EncoderWorkItem>& received_items);

/// rows [n, ...] as consecutive blocks of lengths[i] rows (sum == n), each a
/// differentiable view; one autograd node whose backward concatenates the
/// blocks' gradients (zeros for a block that got none). A narrow per block
/// would instead give each block a full-size zero gradient and add them all
/// up: O(blocks x n). Throws InvalidArgument for a negative length, a sum
/// other than n or a 0-d tensor.
std::vector<Tensor> split_rows(const Tensor& rows, const std::vector<int64_t>& lengths);

}  // namespace diffcomm::encoder_parallel
