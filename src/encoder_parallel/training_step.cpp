#include "diffcomm/encoder_parallel/training_step.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

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

namespace diffcomm::encoder_parallel {
namespace {

// ------------------------------------------------------------ synthetic data
// Every rank and the reference draw the same numbers from (seed, purpose,
// indices), rounded to the step's dtype.
uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<double> draw_fresh(uint64_t seed, std::size_t count, double scale, DType dtype) {
  Generator gen(seed);
  std::vector<double> v;
  v.reserve(count);  // (not zero-filled first)
  for (std::size_t i = 0; i < count; ++i) v.push_back(scale * gen.normal());
  // Round to dtype so distributed and reference start from the same values
  // (float64: already exact, no round trip through a tensor).
  if (dtype == DType::Float64) return v;
  return from_vector(v, {static_cast<int64_t>(count)}, dtype).to_vector();
}

// Every rank of a simulated world (and the reference) asks for the same
// draws: W and A on every rank, text/u/patches on every rank of a dp slice.
// Drawing them per rank made `sweep` spend half its time in the generator and
// gave each rank its own copies. A draw is a pure function of its arguments,
// so a small process-wide memo returns the identical values, drawn once and
// shared. Bounded (oldest out first) so memory stays flat in the number of
// ranks and seeds; the mutex covers thread ranks (python's sim.run).
using Drawn = std::shared_ptr<const std::vector<double>>;
Drawn draw(uint64_t seed, std::size_t count, double scale, DType dtype) {
  struct Entry {
    std::size_t count;
    double scale;
    DType dtype;
    Drawn values;
  };
  constexpr std::size_t kBudget = std::size_t{2} << 20;  // doubles kept (16 MiB)
  static std::mutex mu;
  static std::unordered_map<uint64_t, Entry> memo;  // by seed
  static std::deque<uint64_t> order;                // oldest first
  static std::size_t held = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = memo.find(seed);
    if (it != memo.end() && it->second.count == count && it->second.scale == scale &&
        it->second.dtype == dtype)
      return it->second.values;
  }
  auto values = std::make_shared<const std::vector<double>>(draw_fresh(seed, count, scale, dtype));
  std::lock_guard<std::mutex> lock(mu);
  // Too big, or a seed already held with other parameters: not kept.
  if (count > kBudget || memo.count(seed) != 0) return values;
  while (!order.empty() && held + count > kBudget) {
    auto old = memo.find(order.front());
    held -= old->second.count;
    memo.erase(old);
    order.pop_front();
  }
  memo.emplace(seed, Entry{count, scale, dtype, values});
  order.push_back(seed);
  held += count;
  return values;
}

struct Synthetic {
  const StepConfig& cfg;
  Drawn W() const {
    return draw(mix(cfg.seed, 1), static_cast<std::size_t>(cfg.in_features * cfg.hidden),
                1.0 / std::sqrt(static_cast<double>(cfg.in_features)), cfg.dtype);
  }
  Drawn A() const {
    return draw(mix(cfg.seed, 2), static_cast<std::size_t>(cfg.hidden * cfg.ffn),
                1.0 / std::sqrt(static_cast<double>(cfg.hidden)), cfg.dtype);
  }
  Drawn patches(int d, int64_t item_id, int64_t tokens) const {
    return draw(mix(mix(cfg.seed, 3),
                    static_cast<uint64_t>(d) * 1000003ull + static_cast<uint64_t>(item_id)),
                static_cast<std::size_t>(tokens * cfg.in_features), 1.0, cfg.dtype);
  }
  Drawn text(int d, int64_t b, int64_t seq_len) const {
    return draw(
        mix(mix(cfg.seed, 4), static_cast<uint64_t>(d) * 1000003ull + static_cast<uint64_t>(b)),
        static_cast<std::size_t>(seq_len * cfg.hidden), 1.0, cfg.dtype);
  }
  // Row t of sample b's positional table U, [hidden] values. Each row is
  // its own stream: a rank draws only its shard's rows, and draws them again
  // in the backward (PositionalTermFn), where a whole sample's table, evicted
  // from the memo by then, cost the 1024-rank step 17 % of its time.
  std::vector<double> u_row(int d, int64_t b, int64_t t) const {
    return draw_fresh(
        mix(mix(mix(cfg.seed, 5), static_cast<uint64_t>(d) * 1000003ull + static_cast<uint64_t>(b)),
            static_cast<uint64_t>(t)),
        static_cast<std::size_t>(cfg.hidden), 1.0, cfg.dtype);
  }
  // Sample b's whole table [seq_len, hidden], row by row (the reference).
  std::vector<double> u(int d, int64_t b, int64_t seq_len) const {
    std::vector<double> table;
    table.reserve(static_cast<std::size_t>(seq_len * cfg.hidden));
    for (int64_t t = 0; t < seq_len; ++t) {
      const std::vector<double> row = u_row(d, b, t);
      table.insert(table.end(), row.begin(), row.end());
    }
    return table;
  }
};

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

// out[j] = out[j] + a[0] B[0, j] + a[1] B[1, j] + ... + a[k-1] B[k-1, j]
// (left to right) for j < n; a[p] is a[p * lda], B[p, j] is b[p * ldb + j].
// The reference's sums are all of this form. Blocks of 16 outputs keep their
// accumulators in registers across p as 8 two-lane vectors (independent add
// chains; GCC/Clang vector extensions, plain SSE2 on x86-64): each lane is
// a separate multiply then add, and every output still sees its terms in
// increasing p, so the bits are those of the plain loop.
void accumulate_rows(const double* a, int64_t lda, int64_t k, const double* b, int64_t ldb,
                     double* out, int64_t n) {
  using v2d = double __attribute__((vector_size(16)));
  constexpr int kVecs = 8, kBlock = 2 * kVecs;
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    v2d acc[kVecs];
    std::memcpy(acc, out + j, sizeof acc);
    for (int64_t p = 0; p < k; ++p) {
      const double ap = a[p * lda];
      const v2d av = {ap, ap};
      const double* bp = b + p * ldb + j;
      for (int q = 0; q < kVecs; ++q) {
        v2d bv;
        std::memcpy(&bv, bp + 2 * q, sizeof bv);
        acc[q] += av * bv;
      }
    }
    std::memcpy(out + j, acc, sizeof acc);
  }
  for (; j < n; ++j) {
    double acc = out[j];
    for (int64_t p = 0; p < k; ++p) acc += a[p * lda] * b[p * ldb + j];
    out[j] = acc;
  }
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

void validate(const StepConfig& cfg, const std::vector<Batch>& per_dp) {
  if (cfg.dp < 1 || cfg.decoder.cp < 1 || cfg.decoder.tp < 1)
    raise("training step",
          fmt::format("dp {}, cp {}, tp {} must be >= 1", cfg.dp, cfg.decoder.cp, cfg.decoder.tp));
  if (cfg.hidden < 1 || cfg.in_features < 1 || cfg.ffn < 1 || cfg.ffn % cfg.decoder.tp != 0)
    raise("training step",
          fmt::format("hidden {}, in_features {} must be >= 1 and ffn {} a positive multiple of "
                      "tp {}",
                      cfg.hidden, cfg.in_features, cfg.ffn, cfg.decoder.tp));
  if (!is_floating(cfg.dtype))
    raise("training step", fmt::format("dtype {} is not floating point", dtype_name(cfg.dtype)));
  if (cfg.ffn_blocks < 1 || cfg.ffn % cfg.ffn_blocks != 0 || cfg.ffn_blocks % cfg.decoder.tp != 0)
    raise("training step",
          fmt::format("ffn_blocks {} must divide ffn {} and be a multiple of tp {}: dX is the "
                      "canonical sum of ffn_blocks column blocks and each TP rank holds whole "
                      "blocks (pick a multiple of tp that divides ffn)",
                      cfg.ffn_blocks, cfg.ffn, cfg.decoder.tp));
  if (cfg.grad_block_rows < 1)
    raise("training step", fmt::format("grad_block_rows {} must be >= 1", cfg.grad_block_rows));
  if (cfg.sp_chunks < 1 || cfg.sp_chunks > kMaxSpChunks)
    raise("training step",
          fmt::format("sp_chunks {} is outside [1, {}]", cfg.sp_chunks, kMaxSpChunks));
  if (static_cast<int>(per_dp.size()) != cfg.dp)
    raise("training step", fmt::format("{} micro-batches for dp {}", per_dp.size(), cfg.dp));
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

std::pair<double, double> tolerance(DType dtype) {
  (void)dtype;  // every dtype: the step's sums are canonical, its reference exact
  return {0.0, 0.0};
}

StepRankResult run_step(const dist::ProcessGroup& world, const StepConfig& cfg,
                        const std::vector<Batch>& per_dp, bool keep_routed_rows) {
  validate(cfg, per_dp);
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

namespace {

// Rounds float64 values to the step's dtype and back, in place, converting as
// tensors convert (T from compute_t<T>): the value a T tensor holds.
using Rounder = void (*)(double*, std::size_t);
template <class T>
void round_as(double* v, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<double>(
        static_cast<compute_t<T>>(static_cast<T>(static_cast<compute_t<T>>(v[i]))));
}
Rounder rounder_for(DType dtype) {
  Rounder r = nullptr;
  dispatch_dtype(dtype, [&](auto tag) { r = &round_as<typename decltype(tag)::type>; });
  return r;
}

// The canonical tree (docs/semantics.md), written out for the reference:
// rows [m][n]; with m rows left, row i becomes row i + row i + floor(m/2)
// for i < floor(m/2), rounded to the dtype as a tensor add rounds, and the
// odd row out moves after them. m == 0 gives zeros.
std::vector<double> tree_sum(std::vector<double> rows, int64_t m, int64_t n, Rounder round) {
  if (m == 0) return std::vector<double>(static_cast<std::size_t>(n), 0.0);
  while (m > 1) {
    const int64_t h = m / 2;
    for (int64_t i = 0; i < h * n; ++i)
      rows[static_cast<std::size_t>(i)] += rows[static_cast<std::size_t>(i + h * n)];
    round(rows.data(), static_cast<std::size_t>(h * n));
    if (m % 2 == 1) std::copy_n(rows.begin() + 2 * h * n, n, rows.begin() + h * n);
    m = h + m % 2;
  }
  rows.resize(static_cast<std::size_t>(n));
  return rows;
}

}  // namespace

StepReference reference_step(const StepConfig& cfg, const std::vector<Batch>& per_dp) {
  validate(cfg, per_dp);
  const Synthetic syn{cfg};
  const Drawn W_drawn = syn.W(), A_drawn = syn.A();
  const double* const W = W_drawn->data();
  const double* const A = A_drawn->data();
  const int64_t H = cfg.hidden, I = cfg.in_features, Fn = cfg.ffn, B = cfg.grad_block_rows;
  const int64_t G = cfg.ffn_blocks, w = Fn / G;  // dX's column blocks, w columns each
  const Rounder round = rounder_for(cfg.dtype);
  // Every value below is what the step's tensors hold: each sum is a plain
  // loop in float64 (0, then + a_p b_p in increasing p, as matmul sums)
  // rounded to the dtype once, each tree addition rounded. The loops are
  // arranged so that independent elements are computed side by side.
  // At = A^T ([ffn, hidden]).
  std::vector<double> At(static_cast<std::size_t>(Fn * H));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < Fn; ++c)
      At[static_cast<std::size_t>(c * H + h)] = A[static_cast<std::size_t>(h * Fn + c)];
  StepReference ref;
  ExactSum loss;
  std::vector<double> y(static_cast<std::size_t>(Fn)), leaves(static_cast<std::size_t>(G * H));
  std::vector<double> F, micro_batches;
  for (int d = 0; d < cfg.dp; ++d) {
    const Batch& batch = per_dp[static_cast<std::size_t>(d)];
    ref.embeddings.emplace_back();
    std::vector<double> blocks;  // [blocks of this micro-batch, I * H], in id order
    int64_t item_id = 0;
    for (std::size_t b = 0; b < batch.samples.size(); ++b) {
      const Sample& s = batch.samples[b];
      std::vector<double> E = *syn.text(d, static_cast<int64_t>(b), s.seq_len);
      const std::vector<double> U_table = syn.u(d, static_cast<int64_t>(b), s.seq_len);
      const double* const U = U_table.data();
      struct Img {
        int64_t start, tokens;
        Drawn P;
      };
      std::vector<Img> imgs;
      for (const ImageSpan& im : s.images) {
        Img img{im.token_start, im.tokens, syn.patches(d, item_id++, im.tokens)};
        F.assign(static_cast<std::size_t>(im.tokens * H), 0.0);  // F = P W
        const double* const P = img.P->data();
        for (int64_t r = 0; r < im.tokens; ++r)
          accumulate_rows(P + r * I, 1, I, W, H, F.data() + r * H, H);
        round(F.data(), F.size());
        std::copy(F.begin(), F.end(), E.begin() + im.token_start * H);
        imgs.push_back(std::move(img));
      }
      // The loss's terms, and dE = U + dX on image rows (the only ones dW
      // reads): dX = the tree over the column blocks of y_b A[:, b]^T.
      std::vector<double> dE(E.size());
      std::vector<char> image_row(static_cast<std::size_t>(s.seq_len), 0);
      for (const Img& img : imgs) std::fill_n(image_row.begin() + img.start, img.tokens, char{1});
      for (int64_t t = 0; t < s.seq_len; ++t) {
        const double* const e = &E[static_cast<std::size_t>(t * H)];
        const double* const u = U + t * H;
        std::fill(y.begin(), y.end(), 0.0);
        accumulate_rows(e, 1, H, A, Fn, y.data(), Fn);  // y = e A
        round(y.data(), y.size());
        for (int64_t h = 0; h < H; ++h) {
          loss.add(e[h] * u[h]);
          ref.loss_scale += std::abs(e[h] * u[h]);
        }
        for (int64_t c = 0; c < Fn; ++c) {
          const double term =
              0.5 * (y[static_cast<std::size_t>(c)] * y[static_cast<std::size_t>(c)]);
          loss.add(term);
          ref.loss_scale += term;
        }
        if (image_row[static_cast<std::size_t>(t)] == 0) continue;
        std::fill(leaves.begin(), leaves.end(), 0.0);
        for (int64_t g = 0; g < G; ++g)  // leaf g = sum over its w columns c of y_c A[:, c]
          accumulate_rows(y.data() + g * w, 1, w, At.data() + g * w * H, H, leaves.data() + g * H,
                          H);
        round(leaves.data(), leaves.size());
        const std::vector<double> back = tree_sum(leaves, G, H, round);
        double* const de = dE.data() + t * H;
        for (int64_t h = 0; h < H; ++h) de[h] = u[h] + back[static_cast<std::size_t>(h)];
        round(de, static_cast<std::size_t>(H));
      }
      // Each block's dW = P_b^T dE_b, in id order (images in order, blocks
      // of B rows).
      for (const Img& img : imgs) {
        const double* const P = img.P->data();
        for (int64_t r0 = 0; r0 < img.tokens; r0 += B) {
          const int64_t n = std::min(B, img.tokens - r0);
          const std::size_t at = blocks.size();
          blocks.resize(at + static_cast<std::size_t>(I * H), 0.0);
          double* const out = blocks.data() + at;
          for (int64_t k = 0; k < I; ++k)  // out[k, :] = sum over rows r of P[r, k] dE[r, :]
            accumulate_rows(P + r0 * I + k, I, n, dE.data() + (img.start + r0) * H, H, out + k * H,
                            H);
          round(out, static_cast<std::size_t>(I * H));
        }
      }
      ref.embeddings.back().push_back(std::move(E));
    }
    const auto nb = static_cast<int64_t>(blocks.size()) / (I * H);
    const std::vector<double> dW_d = tree_sum(std::move(blocks), nb, I * H, round);
    micro_batches.insert(micro_batches.end(), dW_d.begin(), dW_d.end());
  }
  ref.encoder_grad = tree_sum(std::move(micro_batches), cfg.dp, I * H, round);
  ref.loss = loss.value();
  return ref;
}

StepCheck check_step(const StepConfig& cfg, const std::vector<Batch>& per_dp,
                     const std::vector<StepRankResult>& ranks, const StepReference& ref) {
  (void)per_dp;
  StepCheck chk;
  double ref_max = 0;
  for (double v : ref.encoder_grad) ref_max = std::max(ref_max, std::abs(v));
  ExactSum total;
  for (const auto& r : ranks) {
    total.add(ExactSum::from_limbs(r.loss_limbs, r.loss_special));
    const auto got = r.decoder_input.to_vector();
    for (std::size_t k = 0; k < r.shard_tokens.size(); ++k) {
      const auto [b, t] = r.shard_tokens[k];
      const auto& row =
          ref.embeddings[static_cast<std::size_t>(r.dp_rank)][static_cast<std::size_t>(b)];
      for (int64_t h = 0; h < cfg.hidden; ++h)
        chk.forward_max_abs_diff = std::max(
            chk.forward_max_abs_diff,
            std::abs(got[k * static_cast<std::size_t>(cfg.hidden) + static_cast<std::size_t>(h)] -
                     row[static_cast<std::size_t>(t * cfg.hidden + h)]));
    }
    const auto g = r.encoder_grad.to_vector();
    double worst = 0;
    for (std::size_t i = 0; i < g.size(); ++i)
      worst = std::max(worst, std::abs(g[i] - ref.encoder_grad[i]));
    chk.grad_max_rel_diff = std::max(chk.grad_max_rel_diff, ref_max > 0 ? worst / ref_max : worst);
  }
  // Relative to the sum of the terms' magnitudes, not to the loss itself:
  // the e.u terms can cancel the 0.5 y^2 ones, and rounding is relative to
  // the terms (a near-zero loss of a tiny image gave 1.25e-11 "relative"
  // from ordinary float64 rounding, a rare false failure).
  const double loss = total.value();
  chk.loss_rel_diff =
      std::abs(loss - ref.loss) / std::max({ref.loss_scale, std::abs(ref.loss), 1e-300});
  const auto [fwd_tol, grad_tol] = tolerance(cfg.dtype);
  chk.passed = chk.forward_max_abs_diff <= fwd_tol && chk.grad_max_rel_diff <= grad_tol &&
               chk.loss_rel_diff <= grad_tol;
  return chk;
}

}  // namespace diffcomm::encoder_parallel
