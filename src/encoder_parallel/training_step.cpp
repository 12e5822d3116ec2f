#include "diffcomm/encoder_parallel/training_step.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/distributed/mesh.hpp"
#include "diffcomm/encoder_parallel/exact_sum.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"
#include "diffcomm/nn/canonical_linear.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/tensor/error.hpp"
#include "encoder_parallel/grad_blocks.hpp"
#include "encoder_parallel/step_data.hpp"

namespace diffcomm::encoder_parallel {
namespace {

using detail::Drawn;
using detail::Synthetic;

// Rows (sample, token) of per-sample [seq_len, hidden] tables, as a tensor.
// Written straight into the tensor, converted as from_vector converts.
Tensor gather_rows(const std::vector<std::pair<int64_t, int64_t>>& tokens,
                   const std::function<const std::vector<double>&(int64_t)>& table, int64_t hidden,
                   DType dtype) {
  Tensor out = empty({static_cast<int64_t>(tokens.size()), hidden}, dtype);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(out.data_ptr());
    int64_t cur = -1;  // tokens come in runs of one sample: look its table up once per run
    const double* tab = nullptr;
    for (const auto& [b, t] : tokens) {
      if (b != cur) {
        tab = table(b).data();
        cur = b;
      }
      const double* row = tab + t * hidden;
      for (int64_t h = 0; h < hidden; ++h) *p++ = static_cast<T>(static_cast<compute_t<T>>(row[h]));
    }
  });
  return out;
}

// Rows (sample, token) drawn one at a time, [tokens, hidden], converted as
// gather_rows converts.
Tensor draw_rows(const std::vector<std::pair<int64_t, int64_t>>& tokens,
                 const std::function<std::vector<double>(int64_t, int64_t)>& row, int64_t hidden,
                 DType dtype) {
  Tensor out = empty({static_cast<int64_t>(tokens.size()), hidden}, dtype);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(out.data_ptr());
    for (const auto& [b, t] : tokens)
      for (const double v : row(b, t)) *p++ = static_cast<T>(static_cast<compute_t<T>>(v));
  });
  return out;
}

// Rows of a shard of `rows` in `chunks` pieces as equal as they come (the
// first rows % chunks one longer), never an empty piece: fewer pieces when
// the shard has fewer rows, one (empty) piece for an empty shard.
std::vector<int64_t> sp_chunk_rows(int64_t rows, int chunks) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(chunks, rows));
  std::vector<int64_t> pieces(static_cast<std::size_t>(n), rows / n);
  for (int64_t i = 0; i < rows % n; ++i) ++pieces[static_cast<std::size_t>(i)];
  return pieces;
}

// One rank's view of the step, fixed before the encoder runs: what every
// phase below reads. The phases hold their tensors in their own scope, so
// what a rank keeps across a collective is only what the graph needs (in a
// simulated world every rank is parked in some collective while the others
// run, so what a rank holds there is multiplied by the world size).
struct RankContext {
  const StepConfig& cfg;
  const Synthetic& syn;
  const ExchangePlan& plan;
  const dist::ProcessGroup& exchange;  // the exchange's group
  int dp_rank;
  int tp_rank;
  int e;  // rank in the exchange group
};

// The encoder's output on this rank: the records it produces (its bucket's
// features, assembled on the bucket's first encoder-CP rank), the prototype
// anchoring an empty send, and where the backward leaves this rank's blocks'
// partial dW.
struct Encoded {
  std::vector<EncoderFeature> records;
  Tensor features;
  std::shared_ptr<Tensor> block_grads;
};

// F = P W, whose backward gives each block's partial dW = P_b^T dF_b (one
// matmul over the block's rows), [blocks, in, hidden], instead of their sum.
// The partials leave through block_grads, not as W's gradient: W's gradient
// is their canonical sum with every other rank's blocks (run_step). A
// per-block copy of W as the leaf would say the same in autograd's terms, at
// a copy of W per block held by every rank through the step.
struct BlockLinearFn : Function<BlockLinearFn> {
  static constexpr const char* kName = "BlockLinearBackward";
  std::function<Tensor()> draw_p;  // [rows, in] data, drawn forward and again backward
  std::vector<int64_t> blocks;     // rows per block
  std::shared_ptr<Tensor> block_grads;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    return {matmul(draw_p(), in[0])};  // detached inputs: records nothing
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    const Tensor P = draw_p();
    const int64_t I = P.size(1), H = g[0].size(1);
    Tensor out = empty({static_cast<int64_t>(blocks.size()), I, H}, g[0].dtype());
    int64_t row = 0;
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      const int64_t n = blocks[b];
      out.row_view(static_cast<int64_t>(b), 1)
          .copy_(matmul(transpose(P.row_view(row, n)), g[0].row_view(row, n))
                     .view_as_shape({1, I, H}));
      row += n;
    }
    *block_grads = out;
    return {Tensor{}};  // W's share arrives by block_grads
  }
};

// Rows [lo, hi) of bucket b's encoder inputs (its items' patches
// concatenated in bucket order), [hi - lo, in_features].
Tensor bucket_rows(const RankContext& rc, int bucket, int64_t lo, int64_t hi) {
  const StepConfig& cfg = rc.cfg;
  std::vector<double> rows;
  rows.reserve(static_cast<std::size_t>((hi - lo) * cfg.in_features));
  int64_t at = 0;  // first row of the item
  for (int64_t id : rc.plan.buckets[static_cast<std::size_t>(bucket)]) {
    const int64_t n = rc.plan.items[static_cast<std::size_t>(id)].output_rows;
    const int64_t a = std::max(lo, at), b = std::min(hi, at + n);
    if (a < b) {
      const Drawn p = rc.syn.patches(rc.dp_rank, id, n);
      rows.insert(rows.end(), p->begin() + (a - at) * cfg.in_features,
                  p->begin() + (b - at) * cfg.in_features);
    }
    at += n;
  }
  return from_vector(rows, {hi - lo, cfg.in_features}, cfg.dtype);
}

// ---- encoder: bucket b computed by its encoder-CP ranks, assembled on the producer
Encoded encode(const RankContext& rc, const Tensor& W) {
  const StepConfig& cfg = rc.cfg;
  const ExchangePlan& plan = rc.plan;
  const int ecp = cfg.encoder.encoder_cp;
  const int bucket = rc.e / ecp, j = rc.e % ecp;
  const auto& items = plan.buckets[static_cast<std::size_t>(bucket)];
  // Encoder-CP slices hold whole gradient blocks (grad_blocks.hpp).
  auto slice = [&](int k) {
    return detail::encoder_slice(plan, bucket, k, ecp, cfg.grad_block_rows);
  };
  const detail::EncoderSlice mine = slice(j);
  const int64_t lo = mine.row_begin, hi = mine.row_end;
  Encoded out;
  out.block_grads = std::make_shared<Tensor>();  // set by the backward
  std::vector<int64_t> block_rows;
  for (const auto& b : mine.blocks) block_rows.push_back(b.rows);
  // P (this rank's slice of the inputs) is drawn again by the backward
  // rather than kept: held from forward to backward by every rank at once,
  // it was 9 % of the 1024-rank step's peak (the draws are deterministic).
  out.features = BlockLinearFn{{},
                               [&rc, bucket, lo, hi] { return bucket_rows(rc, bucket, lo, hi); },
                               block_rows,
                               out.block_grads}
                     .apply({W})[0];
  if (ecp > 1) {
    auto enc_group = rc.exchange.split(bucket, j, {ecp},
                                       fmt::format("{}.encoder_cp{}", rc.exchange.name(), bucket));
    dist::Splits outs(static_cast<std::size_t>(ecp), 0), ins(static_cast<std::size_t>(ecp), 0);
    ins[0] = hi - lo;
    if (j == 0)
      for (int k = 0; k < ecp; ++k) {
        const detail::EncoderSlice s = k == 0 ? mine : slice(k);
        outs[static_cast<std::size_t>(k)] = s.row_end - s.row_begin;
      }
    out.features = nn::all_to_all_single(out.features, outs, ins, *enc_group);
  }
  if (j == 0) {
    std::vector<int64_t> lengths;
    for (int64_t id : items)
      lengths.push_back(plan.items[static_cast<std::size_t>(id)].output_rows);
    std::vector<Tensor> rows = split_rows(out.features, lengths);
    for (std::size_t k = 0; k < items.size(); ++k)
      out.records.push_back({plan.items[static_cast<std::size_t>(items[k])], std::move(rows[k])});
  }
  return out;
}

// ---- exchange, unpack, merge: the decoder's input E for this rank's shard
Tensor exchange_and_merge(const RankContext& rc, Encoded encoded, const ShardLayout& layout,
                          bool keep_routed_rows, StepRankResult& res) {
  const StepConfig& cfg = rc.cfg;
  const ExchangePlan& plan = rc.plan;
  // `features` is the prototype: on a rank that produces nothing it is the
  // [0, hidden] output of the encoder-CP assembly, and anchoring the empty
  // send on it keeps that collective's backward reachable here too. Both
  // are moved in: the records are views of features, backward needs
  // neither (the encoder node keeps P, the split keeps row counts), and
  // route_features frees them once packed, before its collective parks
  // this rank.
  const MeshContext ctx = cfg.decoder.context(res.cp_rank, res.tp_rank);
  RoutedFeatures routed =
      route_features(plan.mode, std::move(encoded.records), std::move(encoded.features), rc.e, plan,
                     rc.exchange, cfg.receiver_grad.value_or(receiver_grad_for(ctx)));
  if (keep_routed_rows) res.routed_rows = routed.rows.detach();
  res.received_items = routed.items;
  std::vector<EncoderFeature> received = unpack_records(routed.rows, routed.items);
  // The text embeddings are data here: E = merge(base, routed rows)
  // requires grad on every rank through the routed rows (the exchange of
  // features of W, an empty anchored send included), so every rank's
  // decoder graph is differentiable without them. As a leaf requiring grad
  // they would stay in the graph, a shard-sized buffer at every later
  // collective, for a gradient nothing reads.
  Tensor base;
  {
    // The drawn tables are only read by gather_rows: this rank's handles
    // are dropped before the next collective yields. Held across the step,
    // every rank kept its own copy whenever the bounded memo had evicted
    // its dp slice's tables, and the memo evicts more the more dp slices
    // interleave (memory per rank grew with N).
    std::map<int64_t, Drawn> text_cache;
    auto text_of = [&](int64_t b) -> const std::vector<double>& {
      auto it = text_cache.find(b);
      if (it == text_cache.end())
        it = text_cache
                 .emplace(b, rc.syn.text(rc.dp_rank, b, plan.seq_lens[static_cast<std::size_t>(b)]))
                 .first;
      return *it->second;
    };
    base = gather_rows(layout.tokens(), text_of, cfg.hidden, cfg.dtype);
  }
  Tensor E = merge_into_decoder(base, received, layout, routed.rows);
  res.decoder_input = E.detach();
  // The merge copied what it needs; the routed rows (the exchange's largest
  // buffer), the received records and base are freed on return.
  return E;
}

// Adds a[i] * b[i] for every i to the exact sum (values read in place).
void add_products(ExactSum& acc, const Tensor& a, const Tensor& b, double factor = 1.0) {
  dispatch_dtype(a.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(a.data_ptr());
    const T* y = static_cast<const T*>(b.data_ptr());
    const int64_t n = a.numel();
    for (int64_t i = 0; i < n; ++i)
      acc.add(factor * (static_cast<double>(static_cast<compute_t<T>>(x[i])) *
                        static_cast<double>(static_cast<compute_t<T>>(y[i]))));
  });
}

// The decoder's inputs: one per SP chunk (the shard's rows in sp_chunks
// pieces, one all-gather each: a rank holds one piece's gathered rows, and
// backward one piece's input gradient, instead of the whole [tp x shard]);
// the shard itself otherwise.
std::vector<Tensor> decoder_inputs(const StepConfig& cfg, const Tensor& E) {
  if (cfg.decoder.tp == 1 || !cfg.decoder.sp) return {E};
  const std::vector<int64_t> pieces = sp_chunk_rows(E.size(0), cfg.sp_chunks);
  if (pieces.size() == 1) return {E};
  return split_rows(E, pieces);
}

// ---- decoder (Megatron-style TP / SP, canonical input gradient) and loss:
// the graph's loss. The reported loss is res.loss_partials, the exact sum of
// the loss's terms on this rank (the positional terms on the rank that
// counts them: TP rank 0 without SP, every rank with SP).
Tensor decode_and_loss(const RankContext& rc, Tensor E, const ShardLayout& layout,
                       const dist::ProcessGroup& tp_group, StepRankResult& res) {
  const StepConfig& cfg = rc.cfg;
  const int tp = cfg.decoder.tp;
  const bool sp = tp > 1 && cfg.decoder.sp;
  const Drawn a_drawn = rc.syn.A();
  const std::vector<double>& a = *a_drawn;
  const int64_t cols = cfg.ffn / tp;
  std::vector<double> a_cols;
  for (int64_t r = 0; r < cfg.hidden; ++r)
    for (int64_t c = rc.tp_rank * cols; c < (rc.tp_rank + 1) * cols; ++c)
      a_cols.push_back(a[static_cast<std::size_t>(r * cfg.ffn + c)]);
  const Tensor A_t = from_vector(a_cols, {cfg.hidden, cols}, cfg.dtype);
  std::vector<Tensor> X = decoder_inputs(cfg, E);
  // The positional term <E, U>: its gradient U is not a node of the graph
  // but the linear's dx_addend, added to dX after the canonical sum, so
  // every TP replica's E gets U + dX (Megatron's copy_to_tp_region gives
  // each replica that sum through its all-reduce) while, without SP, each
  // replica draws only the 1/tp of U it reduces. U's rows are drawn when
  // needed and dropped at once (issue 27: in a simulated world every rank
  // holds what it keeps across a collective).
  const std::vector<std::pair<int64_t, int64_t>>& tokens = layout.tokens();
  auto draw_u = [&rc, &tokens](int64_t first_row, int64_t rows) {
    const std::vector<std::pair<int64_t, int64_t>> some(tokens.begin() + first_row,
                                                        tokens.begin() + first_row + rows);
    const int d = rc.dp_rank;
    return draw_rows(
        some, [&](int64_t b, int64_t t) { return rc.syn.u_row(d, b, t); }, rc.cfg.hidden,
        rc.cfg.dtype);
  };
  // The loss's terms on this rank: e.u where it is counted (every SP rank
  // owns its rows; without SP, TP rank 0 counts the replicas' rows).
  ExactSum loss_terms;
  if (sp || rc.tp_rank == 0) add_products(loss_terms, E, draw_u(0, E.size(0)));
  const int64_t H = cfg.hidden;
  // Each piece's gathered rows are freed inside the linear: its backward
  // needs A_t only. The loss sums the pieces' |Y|^2.
  Tensor yy;
  int64_t first_row = 0;  // of the piece, in the shard
  for (Tensor& piece : X) {
    // U's elements [begin, begin + count) of this piece, flattened [rows, H].
    auto u_elements = [draw_u, first_row, H](int64_t begin, int64_t count) {
      const int64_t r0 = begin / H, r1 = (begin + count + H - 1) / H;
      const Tensor rows = draw_u(first_row + r0, r1 - r0);
      return rows.view_as_shape({(r1 - r0) * H}).row_view(begin - r0 * H, count).copy_data();
    };
    const int64_t rows = piece.size(0);
    const Tensor Y = nn::canonical_column_parallel_linear(piece, A_t, tp_group, sp,
                                                          cfg.ffn / cfg.ffn_blocks, u_elements);
    first_row += rows;
    piece = Tensor{};
    add_products(loss_terms, Y, Y, 0.5);
    const Tensor yy_piece = dot(Y, Y);
    yy = yy.defined() ? add(yy, yy_piece) : yy_piece;
  }
  X.clear();
  res.loss_limbs = loss_terms.limbs();
  res.loss_special = loss_terms.special();
  res.loss = loss_terms.value();
  // In float16 the graph's scalar overflows (|Y|^2 > 65504 on the default
  // mesh), while its gradient (Y) does not depend on that value.
  return scale(yy, 0.5);  // the dot nodes keep what their backward needs
}

}  // namespace

StepRankResult run_step(const dist::ProcessGroup& world, const StepConfig& cfg,
                        const std::vector<Batch>& per_dp, bool keep_routed_rows) {
  detail::validate_step(cfg, per_dp);
  if (world.size() != cfg.world_size())
    raise("training step",
          fmt::format("world has {} ranks but dp x cp x tp = {}", world.size(), cfg.world_size()));
  dist::DeviceMesh mesh(world, {{"dp", cfg.dp}, {"cp", cfg.decoder.cp}, {"tp", cfg.decoder.tp}});
  StepRankResult res;
  res.rank = world.rank();
  res.dp_rank = mesh.coordinate("dp");
  res.cp_rank = mesh.coordinate("cp");
  res.tp_rank = mesh.coordinate("tp");
  const Batch& batch = per_dp[static_cast<std::size_t>(res.dp_rank)];
  const ExchangePlan plan = plan_exchange(batch, cfg.decoder, cfg.encoder);
  res.mode = plan.mode;
  res.plan_fingerprint = plan.fingerprint();
  const dist::ProcessGroup exchange = plan.mode == FeatureExchangeMode::ParentVariableA2A
                                          ? mesh.group(std::vector<std::string>{"cp", "tp"})
                                          : mesh.group("tp");
  res.exchange_rank = exchange.rank();
  const Synthetic syn{cfg};
  const RankContext rc{cfg, syn, plan, exchange, res.dp_rank, res.tp_rank, exchange.rank()};
  const ShardLayout layout(plan, rc.e);
  res.shard_tokens = layout.tokens();

  // The step's tensors live in this scope only, and only the blocks'
  // partial gradients cross the reductions.
  Tensor partials;
  {
    Tensor W = from_vector(*syn.W(), {cfg.in_features, cfg.hidden}, cfg.dtype);
    W.set_requires_grad(true);
    Encoded encoded = encode(rc, W);
    const std::shared_ptr<Tensor> block_grads = encoded.block_grads;
    Tensor E = exchange_and_merge(rc, std::move(encoded), layout, keep_routed_rows, res);
    Tensor loss = decode_and_loss(rc, std::move(E), layout, mesh.group("tp"), res);
    // The backward, without accumulating a .grad() into every leaf (the
    // text embeddings' gradient would be one more shard-sized buffer held
    // to the end); same engine, same order, same collectives as backward().
    // Its result is W's share outside the blocks: none (BlockLinearFn).
    (void)grad({loss}, {W});
    partials = *block_grads;
    if (!partials.defined()) partials = zeros({0, cfg.in_features, cfg.hidden}, cfg.dtype);
  }  // every tensor of the step is freed here, before the reductions yield
  // dW = the canonical tree over the dp micro-batches of the canonical tree
  // over each micro-batch's blocks (grad_blocks.hpp): the same bits for
  // every mesh and the single-rank reference.
  const Tensor micro_batch = nn::canonical_all_reduce_v(
      partials, detail::block_table(plan, cfg.encoder.encoder_cp, cfg.grad_block_rows), exchange);
  partials = Tensor{};
  res.encoder_grad = nn::canonical_all_reduce(
      micro_batch.view_as_shape({1, cfg.in_features, cfg.hidden}), mesh.group("dp"));
  return res;
}

}  // namespace diffcomm::encoder_parallel
