#include "diffcomm/encoder_parallel/exchange.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <tuple>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::encoder_parallel {
namespace {

// Forward: identity. Backward: zeros. Marks a TP replica's copy of received
// rows whose gradient must not be counted again (ReplicatedOverTp).
struct ReplicaCopyFn : Function<ReplicaCopyFn> {
  static constexpr const char* kName = "ReplicaCopyBackward";
  std::vector<Tensor> forward(const std::vector<Tensor>& in) { return {in[0]}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) { return {zeros_like(grads[0])}; }
};

// Forward: row views of the input. Backward: the views' gradients
// concatenated (cat of gradients records nothing).
struct SplitRowsFn : Function<SplitRowsFn> {
  static constexpr const char* kName = "SplitRowsBackward";
  std::vector<int64_t> lengths;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    std::vector<Tensor> out;
    out.reserve(lengths.size());
    int64_t at = 0;
    for (int64_t n : lengths) {
      out.push_back(in[0].row_view(at, n));
      at += n;
    }
    return out;
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) { return {cat(grads)}; }
};

// Forward: the send buffer, pieces (rows [begin, begin + len) of record
// `record`) one after another. Backward: each piece's gradient added into its
// record's rows. One node for all pieces: a narrow per piece would give each
// piece a record-sized zero gradient to add up. Pieces of one record may
// overlap (TP replicas without SP get the same rows), hence add, not copy.
struct GatherPiecesFn : Function<GatherPiecesFn> {
  static constexpr const char* kName = "GatherPiecesBackward";
  struct Piece {
    std::size_t record;
    int64_t begin, len;
  };
  std::vector<Piece> pieces;
  std::vector<Shape> record_shapes;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    int64_t total = 0;
    for (const Piece& p : pieces) total += p.len;
    Tensor out = zeros({total, in[0].size(1)}, in[0].dtype(), in[0].device());
    int64_t at = 0;
    for (const Piece& p : pieces) {
      out.row_view(at, p.len).copy_(in[p.record].row_view(p.begin, p.len));
      at += p.len;
    }
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const Tensor& g = grads[0];
    std::vector<Tensor> out;
    for (const Shape& s : record_shapes) out.push_back(zeros(s, g.dtype(), g.device()));
    int64_t at = 0;
    for (const Piece& p : pieces) {
      Tensor dst = out[p.record].row_view(p.begin, p.len);
      dst.copy_(add(dst, g.row_view(at, p.len)));
      at += p.len;
    }
    return out;
  }
};

// The record piece that arrives as rows [begin, end) of `item`: the same
// item, batch and input_rows, its span narrowed to those rows' tokens, so
// unpack_records and merge_into_decoder place it like a whole item.
EncoderWorkItem piece_of(EncoderWorkItem item, std::pair<int64_t, int64_t> rows) {
  item.decoder_token_start += rows.first;
  item.output_rows = rows.second - rows.first;
  return item;
}

// The send buffer of an A2A exchange: the pieces `sent` lists, cut from this
// producer's records (the bucket `mine`, in order). A rank that sends nothing
// anchors on the prototype so it still runs the backward collective.
Tensor pack_pieces(const std::vector<EncoderFeature>& records, const std::vector<int64_t>& mine,
                   const Transfer& sent, const Tensor& prototype, int64_t hidden) {
  if (sent.items.empty()) return nn::cat_or_empty({}, prototype, hidden);
  std::map<int64_t, std::size_t> record;  // item id -> its record
  for (std::size_t k = 0; k < mine.size(); ++k) record[mine[k]] = k;
  GatherPiecesFn gather;
  std::vector<Tensor> inputs;
  for (const auto& f : records) {
    inputs.push_back(f.rows);
    gather.record_shapes.push_back(f.rows.shape());
  }
  for (std::size_t k = 0; k < sent.items.size(); ++k)
    gather.pieces.push_back({record.at(sent.items[k]), sent.ranges[k].first,
                             sent.ranges[k].second - sent.ranges[k].first});
  return std::move(gather).apply(inputs)[0];
}

// The records' rows, in order, as one tensor (a copy; prototype when none).
Tensor cat_records(const std::vector<EncoderFeature>& records, const Tensor& prototype,
                   int64_t hidden) {
  std::vector<Tensor> pieces;
  for (const auto& f : records) pieces.push_back(f.rows);
  return nn::cat_or_empty(pieces, prototype, hidden);
}

// The send buffer holds a copy of every row that leaves: the records and
// the prototype are not read again, and a caller that moved them in frees
// them here, before the collective parks this rank (in a simulated world of
// N ranks, a parked rank's buffers count N times).
void drop_records(std::vector<EncoderFeature>& records, Tensor& prototype) {
  std::vector<EncoderFeature>().swap(records);
  prototype = Tensor{};
}

}  // namespace

RoutedFeatures route_features(FeatureExchangeMode mode,
                              std::vector<EncoderFeature> producer_records, Tensor prototype,
                              int exchange_rank, const ExchangePlan& plan,
                              const dist::ProcessGroup& group, ReceiverGrad grad) {
  try {
    plan.validate();
  } catch (const InvalidArgument& e) {
    raise("route_features", e.what());
  }
  const int n = group.size();
  const int ecp = plan.encoder.encoder_cp;
  if (mode != plan.mode)
    raise("route_features",
          fmt::format("mode {} differs from the plan's {}", mode_name(mode), mode_name(plan.mode)));
  if (n != plan.encoder.buckets * ecp || n != plan.exchange_size)
    raise("route_features",
          fmt::format("exchange group '{}' has {} ranks but buckets x encoder_cp = {} x {} = {}",
                      group.name(), n, plan.encoder.buckets, ecp, plan.encoder.buckets * ecp));
  if (exchange_rank != group.rank())
    raise("route_features", fmt::format("exchange_rank {} is not this rank's rank {} in group '{}'",
                                        exchange_rank, group.rank(), group.name()));
  if (!prototype.defined() || prototype.dim() != 2)
    raise("route_features",
          fmt::format("prototype must be a 2-d [n, hidden] tensor, got {}", prototype.str()));
  const int64_t hidden = prototype.size(1);

  // This rank's records must be exactly its bucket, in bucket order.
  const bool producer = exchange_rank % ecp == 0;
  const std::vector<int64_t> none;
  const std::vector<int64_t>& mine =
      producer ? plan.buckets[static_cast<std::size_t>(exchange_rank / ecp)] : none;
  if (producer_records.size() != mine.size())
    raise("route_features",
          fmt::format("exchange rank {} holds {} records but the plan gives it {} items",
                      exchange_rank, producer_records.size(), mine.size()));
  for (std::size_t k = 0; k < mine.size(); ++k) {
    const EncoderFeature& f = producer_records[k];
    const EncoderWorkItem& want = plan.items[static_cast<std::size_t>(mine[k])];
    if (!(f.item == want))
      raise(
          "route_features",
          fmt::format("record {} on exchange rank {} is item {} but the plan expects item {} there",
                      k, exchange_rank, f.item.item_id, want.item_id));
    if (!f.rows.defined() || f.rows.dim() != 2 || f.rows.size(0) != want.output_rows ||
        f.rows.size(1) != hidden || f.rows.dtype() != prototype.dtype())
      raise("route_features",
            fmt::format("record of item {} has rows {}, expected {}[{}, {}]", want.item_id,
                        f.rows.str(), dtype_name(prototype.dtype()), want.output_rows, hidden));
  }
  RoutedFeatures out;
  if (mode == FeatureExchangeMode::Local) {
    out.rows = cat_records(producer_records, prototype, hidden);
    for (int64_t id : mine) out.items.push_back(plan.items[static_cast<std::size_t>(id)]);
    return out;
  }

  if (mode == FeatureExchangeMode::TpVariableAllGather) {
    Tensor local = cat_records(producer_records, prototype, hidden);
    drop_records(producer_records, prototype);
    const Transfer in = plan.receives(exchange_rank);
    for (int64_t id : in.items) out.items.push_back(plan.items[static_cast<std::size_t>(id)]);
    out.rows = nn::all_gather_v(local, in.splits, group,
                                grad == ReceiverGrad::ReplicatedOverTp ? nn::GatherGrad::Replicated
                                                                       : nn::GatherGrad::Partial);
    return out;
  }

  // A2A modes: each destination gets the rows of the tokens it owns, in the
  // plan's send order (the records are the bucket, in order: validated above).
  const Transfer sent = plan.sends(exchange_rank), in = plan.receives(exchange_rank);
  Tensor local = pack_pieces(producer_records, mine, sent, prototype, hidden);
  drop_records(producer_records, prototype);
  for (std::size_t k = 0; k < in.items.size(); ++k)
    out.items.push_back(piece_of(plan.items[static_cast<std::size_t>(in.items[k])], in.ranges[k]));
  out.rows = nn::all_to_all_single(local, in.splits, sent.splits, group);
  if (grad == ReceiverGrad::ReplicatedOverTp && plan.coordinates(exchange_rank).second != 0)
    out.rows = ReplicaCopyFn{}.apply({out.rows})[0];
  return out;
}

std::vector<EncoderFeature> unpack_records(const Tensor& rows,
                                           const std::vector<EncoderWorkItem>& received_items) {
  int64_t total = 0;
  for (const auto& it : received_items) {
    if (it.output_rows < 0)
      raise("unpack_records",
            fmt::format("item {} has negative output_rows {}", it.item_id, it.output_rows));
    if (__builtin_add_overflow(total, it.output_rows, &total))
      raise("unpack_records",
            fmt::format("the {} items' output_rows exceed 2^63", received_items.size()));
  }
  if (!rows.defined() || rows.dim() != 2)
    raise("unpack_records", fmt::format("rows must be [n, hidden], got {}", rows.str()));
  if (rows.size(0) != total)
    raise("unpack_records",
          fmt::format("rows has {} rows but the plan's {} received items total {} rows",
                      rows.size(0), received_items.size(), total));
  std::vector<int64_t> lengths;
  lengths.reserve(received_items.size());
  for (const auto& it : received_items) lengths.push_back(it.output_rows);
  std::vector<Tensor> pieces = split_rows(rows, lengths);
  std::vector<EncoderFeature> out;
  out.reserve(received_items.size());
  for (std::size_t k = 0; k < received_items.size(); ++k)
    out.push_back({received_items[k], std::move(pieces[k])});
  std::stable_sort(out.begin(), out.end(), [](const EncoderFeature& a, const EncoderFeature& b) {
    return std::tie(a.item.batch_index, a.item.decoder_token_start, a.item.item_id) <
           std::tie(b.item.batch_index, b.item.decoder_token_start, b.item.item_id);
  });
  return out;
}

std::vector<Tensor> split_rows(const Tensor& rows, const std::vector<int64_t>& lengths) {
  if (!rows.defined() || rows.dim() < 1)
    raise("split_rows", fmt::format("needs a tensor of rows, got {}",
                                    rows.defined() ? rows.str() : "an undefined tensor"));
  int64_t total = 0;
  for (int64_t n : lengths)
    if (n < 0 || __builtin_add_overflow(total, n, &total))
      raise("split_rows", fmt::format("bad block length {}", n));
  if (total != rows.size(0))
    raise("split_rows",
          fmt::format("blocks total {} rows but {} has {}", total, rows.str(), rows.size(0)));
  if (lengths.empty()) return {};
  return SplitRowsFn{{}, lengths}.apply({rows});
}

}  // namespace diffcomm::encoder_parallel
