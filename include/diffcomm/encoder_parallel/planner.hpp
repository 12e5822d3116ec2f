#pragma once
// The exchange planner: from replicated batch metadata, every rank computes
// the same plan — which encoder bucket computes each image (LPT on patches)
// and which exchange ranks own its tokens.
//
// Token ownership, for one sample of length S (DESIGN.md):
//  - contiguous CP: CP rank c owns [c*S/cp, (c+1)*S/cp);
//  - zigzag CP: S is cut into 2*cp equal chunks; rank c owns chunks c and
//    2*cp-1-c, in that order (its "local sequence");
//  - SP: a CP rank's local sequence is cut into tp equal parts, TP rank t
//    owning part t; without SP every TP rank owns its CP rank's tokens.
// Exchange ranks: the TP rank in TP modes, c*tp + t in the parent mode. The
// exchange group is also buckets x encoder_cp (encoder_cp fastest): bucket b
// is computed by exchange ranks b*ecp .. b*ecp+ecp-1 and its producer is
// exchange rank b*ecp.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/encoder_parallel/contracts.hpp"

namespace diffcomm::encoder_parallel {

/// One image in a sample: its decoder token span and encoder cost.
struct ImageSpan {
  int64_t token_start = 0;  ///< first image token within the sample
  int64_t tokens = 0;       ///< decoder image tokens (= feature rows)
  int64_t patches = 0;      ///< encoder patches (cost); 4 * tokens for Qwen2-VL
  int64_t source_id = -1;   ///< e.g. the COCO image id (informational)
};

struct Sample {
  int64_t seq_len = 0;
  std::vector<ImageSpan> images;  ///< non-overlapping, inside [0, seq_len)
};

/// One micro-batch (of one data-parallel replica).
struct Batch {
  std::vector<Sample> samples;
};

enum class CpLayout { Contiguous, Zigzag };
std::string cp_layout_name(CpLayout layout);

struct DecoderMesh {
  int cp = 1;
  int tp = 1;
  bool sp = false;
  CpLayout layout = CpLayout::Contiguous;
  MeshContext context(int cp_rank, int tp_rank) const { return {cp, tp, sp, cp_rank, tp_rank}; }
  /// Ranks of the feature exchange's group (the one rule): the CP x TP
  /// parent group when cp > 1 (ParentVariableA2A), else the TP group.
  int64_t exchange_size() const { return cp > 1 ? int64_t{cp} * tp : tp; }
  /// The exchange rank of decoder rank (cp_rank, tp_rank): cp_rank * tp +
  /// tp_rank in the parent group, tp_rank in the TP group
  /// (ExchangePlan::coordinates is the inverse).
  int exchange_rank(int cp_rank, int tp_rank) const {
    return cp > 1 ? cp_rank * tp + tp_rank : tp_rank;
  }
};

struct EncoderLayout {
  int buckets = 1;
  int encoder_cp = 1;
};

/// The one rule for sequence lengths on a decoder mesh: a sample's length must
/// be a multiple of cp (contiguous CP) or 2*cp (zigzag CP), times tp with SP
/// (Megatron's rule for CP with SP). owned_ranges and plan_exchange refuse
/// exactly the lengths that are not; batch builders pad to it.
int64_t required_seq_multiple(const DecoderMesh& mesh);

/// Token ranges [begin, end) of one sample owned by (cp_rank, tp_rank), in
/// the rank's local order. Throws InvalidArgument when seq_len is negative or
/// not a multiple of required_seq_multiple(mesh), or the rank is outside the
/// mesh.
std::vector<std::pair<int64_t, int64_t>> owned_ranges(int64_t seq_len, const DecoderMesh& mesh,
                                                      int cp_rank, int tp_rank);

/// Rows and bytes from one exchange rank to another.
struct PairTraffic {
  int src = 0;
  int dst = 0;
  int64_t rows = 0;
  uint64_t bytes = 0;
};

struct PlanStats {
  std::vector<PairTraffic> pairs;        ///< every (src, dst) with rows > 0, src != dst included
  uint64_t total_bytes = 0;              ///< bytes that cross ranks (src != dst)
  uint64_t padded_all_gather_bytes = 0;  ///< pad-to-max all-gather: N*(N-1)*max_rows*row_bytes
  /// The least any exchange can move: each token's row once to each rank
  /// that owns it, rows the producer owns itself free. Counted from the
  /// owned ranges alone (not from sends()), so it checks the send path.
  uint64_t owner_minimum_bytes = 0;
  double encoder_imbalance = 1.0;  ///< max / mean bucket cost (patches); 1 when balanced
  std::vector<int64_t> bucket_patches;
  std::vector<int64_t> rows_sent;      ///< per exchange rank, to other ranks
  std::vector<int64_t> rows_received;  ///< per exchange rank, from other ranks
};

/// What one exchange rank sends or receives in route_features: rows per
/// peer (the splits of its all_to_all_single / all_gather_v) and the pieces
/// of items in the order of their rows. A piece is rows [begin, end) of an
/// item: the whole item in the all-gather and local modes, a run of the
/// item's tokens that the peer owns in the A2A modes.
struct Transfer {
  std::vector<int64_t> splits;  ///< rows per exchange rank
  std::vector<int64_t> items;   ///< item id of each piece, in row order
  /// Per piece: its rows [begin, end) within the item.
  std::vector<std::pair<int64_t, int64_t>> ranges;
};

/// The plan of one micro-batch. Identical on every rank of the exchange.
struct ExchangePlan {
  FeatureExchangeMode mode = FeatureExchangeMode::Local;
  DecoderMesh decoder;
  EncoderLayout encoder;
  int exchange_size = 1;
  std::vector<int64_t> seq_lens;               ///< per sample
  std::vector<EncoderWorkItem> items;          ///< items[i].item_id == i
  std::vector<std::vector<int64_t>> buckets;   ///< item ids per bucket, in send order
  std::vector<int> bucket_of;                  ///< per item
  std::vector<std::vector<int>> destinations;  ///< per item: exchange ranks, ascending

  /// Exchange rank of the producer of bucket b: b * encoder_cp.
  int producer(int bucket) const { return bucket * encoder.encoder_cp; }
  /// (cp_rank, tp_rank) of an exchange rank.
  std::pair<int, int> coordinates(int exchange_rank) const;
  /// The rows exchange rank `src` sends: splits[q] to rank q; pieces grouped
  /// by destination q ascending, each group in the bucket's order, an item's
  /// pieces by row. In the A2A modes a destination gets only the rows of the
  /// tokens it owns (owned_rows), so each row crosses once to each owner; in
  /// TpVariableAllGather mode every rank receives the whole bucket (every
  /// rank owns every token there). A rank that produces no bucket sends
  /// nothing. route_features and stats both read it. No validation
  /// (route_features and stats validate first); src must lie in [0,
  /// exchange_size).
  Transfer sends(int src) const;
  /// The rows exchange rank `dst` receives: splits[p] from rank p; pieces in
  /// bucket order (the order of the producers), an item's pieces by row.
  Transfer receives(int dst) const;
  /// Rows of item `item` (0-based within the item) whose tokens exchange
  /// rank `exchange_rank` owns: ascending, disjoint, adjacent runs joined;
  /// empty when it owns none. No validation.
  std::vector<std::pair<int64_t, int64_t>> owned_rows(int64_t item, int exchange_rank) const;
  /// Token ranges of a sample owned by an exchange rank (local order).
  std::vector<std::pair<int64_t, int64_t>> owned(int64_t batch_index, int exchange_rank) const;
  /// Traffic and balance statistics for feature rows of `hidden` elements
  /// (bytes = rows * hidden * element size). Validates the plan first; throws
  /// InvalidArgument for hidden < 0 or a byte count above 2^63.
  PlanStats stats(int64_t hidden, DType dtype) const;
  /// A text form of everything above (to compare plans across ranks).
  /// Validates the plan first.
  std::string fingerprint() const;
  /// Checks that a plan (built by plan_exchange or by hand) is one that
  /// route_features, stats and fingerprint can use without reading out of
  /// range: mode == select_feature_exchange(decoder); cp, tp, buckets,
  /// encoder_cp >= 1; exchange_size == cp*tp (parent mode) or tp, ==
  /// buckets * encoder_cp; items[i].item_id == i (plans are keyed by
  /// position); each item's batch_index names a sample, its rows are >= 0 and
  /// its token span [start, start + output_rows) lies in the sample; the
  /// sample lengths are >= 0 and divisible by the layout; buckets.size() ==
  /// buckets, every item in exactly one bucket, bucket_of agreeing;
  /// destinations.size() == items.size(), each list ascending, without
  /// duplicates, inside [0, exchange_size); the rows of a bucket sum below
  /// 2^63. And that it routes correctly: no two items of a sample have
  /// overlapping token spans (zero-row items overlap nothing), and every
  /// exchange rank that owns (owned()) a token of an item's span is among the
  /// item's destinations. Extra destinations that own none of the span are
  /// allowed: the A2A modes send such a rank no rows of the item (it owns
  /// none), the all-gather mode sends every rank everything anyway;
  /// plan_exchange never adds them. Cost: O(n log n) in the items plus
  /// O(items x exchange_size) for the owners. Throws InvalidArgument naming
  /// the first field that is wrong; for the last two, both items with their
  /// spans and sample, or the item, the missing rank and the tokens it owns.
  void validate() const;
};

/// Builds the plan (valid by construction: validate() holds). mode comes from
/// select_feature_exchange; the exchange group has cp*tp ranks in the parent mode, tp otherwise,
/// and must equal buckets * encoder_cp. Buckets: longest-processing-time first on patches (ties:
/// lower item id first, then the least-loaded, lowest bucket); items within a bucket are sent in
/// item-id order. Destinations: every exchange rank whose owned tokens intersect the image's span.
/// Throws InvalidArgument on inconsistent layouts, overlapping or
/// out-of-range images, or sequence lengths the layout cannot divide.
ExchangePlan plan_exchange(const Batch& batch, const DecoderMesh& decoder,
                           const EncoderLayout& encoder);

}  // namespace diffcomm::encoder_parallel
