#pragma once
// The decoder merge: image feature rows written into this rank's shard of
// the decoder input embeddings, at their token positions.
#include <vector>

#include "diffcomm/encoder_parallel/contracts.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"

namespace diffcomm::encoder_parallel {

/// Where this rank's decoder shard rows come from: samples in batch order,
/// each sample's owned tokens in local order.
class ShardLayout {
 public:
  ShardLayout(const ExchangePlan& plan, int exchange_rank);
  /// Rows of the shard.
  int64_t rows() const { return rows_; }
  /// Shard row of (sample, token), or -1 when this rank does not own it.
  int64_t row_of(int64_t batch_index, int64_t token) const;
  /// (sample, token) of every shard row, in row order.
  const std::vector<std::pair<int64_t, int64_t>>& tokens() const { return tokens_; }

 private:
  struct Range {
    int64_t batch_index, begin, end, first_row;
  };
  std::vector<Range> ranges_;
  std::vector<std::pair<int64_t, int64_t>> tokens_;
  int64_t rows_ = 0;
};

/// out = base with, for every record, the rows of its image tokens that
/// this rank owns replaced by the record's rows. A record may be a piece of
/// an item (RoutedFeatures): its span is the piece's tokens. base is [layout.rows(),
/// hidden]. Differentiable in base (gradient zero at replaced rows) and in
/// every record's rows (gradient at owned rows, zero elsewhere).
/// anchor (optional): the routed rows the records were unpacked from. It
/// keeps the exchange's backward reachable on a rank that received no
/// records, so that rank still runs the backward collective; it gets no
/// gradient of its own (the records carry it).
/// Throws InvalidArgument on width/dtype mismatches or a record whose item
/// lies outside its sample.
Tensor merge_into_decoder(const Tensor& base, const std::vector<EncoderFeature>& records,
                          const ShardLayout& layout, const Tensor& anchor = {});

}  // namespace diffcomm::encoder_parallel
