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
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/tensor/error.hpp"

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

// Y = L R where only one operand requires grad (the other is data or a
// frozen weight): the backward computes that operand's gradient alone, with
// the same products as matmul's backward (dL = dY R^T, dR = L^T dY), so the
// bits are matmul's. matmul's backward would also compute the other operand's
// gradient and transpose it, a third of the step's matmul work.
struct LinearFn : Function<LinearFn> {
  static constexpr const char* kName = "LinearBackward";
  enum Grad { kLeft, kRight };  // the operand that requires grad
  Grad grad = kLeft;
  Tensor saved;  // the other operand
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    saved = in[grad == kLeft ? 1 : 0];
    return {matmul(in[0], in[1])};  // detached inputs: records nothing
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    if (grad == kLeft) return {matmul(g[0], transpose(saved)), Tensor{}};
    return {Tensor{}, matmul(transpose(saved), g[0])};
  }
};

// <E, U> for the drawn positional rows U of this shard (data: no gradient).
// U is as large as the shard and is drawn again in the backward instead of
// being saved: in a simulated world every rank holds what it saves from
// forward to backward at once (issue 27: 85 MB of a 1024-rank step's peak).
// The draws are deterministic and the products are dot's (value <E, U>,
// gradient g U), so the bits are those of dot(E, U).
struct PositionalTermFn : Function<PositionalTermFn> {
  static constexpr const char* kName = "PositionalTermBackward";
  std::function<Tensor()> draw_u;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    return {dot(in[0], draw_u())};  // detached inputs: records nothing
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    return {scale(draw_u(), g[0].item())};
  }
};

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
// features, assembled on the bucket's first encoder-CP rank) and the
// prototype anchoring an empty send.
struct Encoded {
  std::vector<EncoderFeature> records;
  Tensor features;
};

// ---- encoder: bucket b computed by its encoder-CP ranks, assembled on the producer
Encoded encode(const RankContext& rc, const Tensor& W) {
  const StepConfig& cfg = rc.cfg;
  const ExchangePlan& plan = rc.plan;
  const int ecp = cfg.encoder.encoder_cp;
  const int bucket = rc.e / ecp, j = rc.e % ecp;
  const auto& items = plan.buckets[static_cast<std::size_t>(bucket)];
  int64_t R = 0;
  std::vector<double> p_all;
  for (int64_t id : items) {
    const auto& it = plan.items[static_cast<std::size_t>(id)];
    const Drawn p = rc.syn.patches(rc.dp_rank, id, it.output_rows);
    p_all.insert(p_all.end(), p->begin(), p->end());
    R += it.output_rows;
  }
  auto slice_lo = [&](int k) { return R * k / ecp; };
  const int64_t lo = slice_lo(j), hi = slice_lo(j + 1);
  // P holds this rank's slice; the rows drawn are not kept across collectives.
  Tensor P = from_vector(std::vector<double>(p_all.begin() + lo * cfg.in_features,
                                             p_all.begin() + hi * cfg.in_features),
                         {hi - lo, cfg.in_features}, cfg.dtype);
  std::vector<double>().swap(p_all);
  Encoded out;
  out.features = LinearFn{{}, LinearFn::kRight, {}}.apply({P, W})[0];
  if (ecp > 1) {
    auto enc_group = rc.exchange.split(bucket, j, {ecp},
                                       fmt::format("{}.encoder_cp{}", rc.exchange.name(), bucket));
    dist::Splits outs(static_cast<std::size_t>(ecp), 0), ins(static_cast<std::size_t>(ecp), 0);
    ins[0] = hi - lo;
    if (j == 0)
      for (int k = 0; k < ecp; ++k)
        outs[static_cast<std::size_t>(k)] = slice_lo(k + 1) - slice_lo(k);
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

// sum_i a[i] * b[i] accumulated in float64, read in place (to_vector would
// copy both operands per call).
double dot64(const Tensor& a, const Tensor& b) {
  double acc = 0;
  dispatch_dtype(a.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(a.data_ptr());
    const T* y = static_cast<const T*>(b.data_ptr());
    const int64_t n = a.numel();
    for (int64_t i = 0; i < n; ++i)
      acc += static_cast<double>(static_cast<compute_t<T>>(x[i])) *
             static_cast<double>(static_cast<compute_t<T>>(y[i]));
  });
  return acc;
}

// The decoder's inputs (one per SP chunk; one without SP) and the left
// operand of the positional term (undefined on ranks without one).
std::pair<std::vector<Tensor>, Tensor> decoder_inputs(const StepConfig& cfg, const Tensor& E,
                                                      int tp_rank,
                                                      const dist::ProcessGroup& tp_group) {
  if (cfg.decoder.tp == 1) return {{E}, E};
  if (cfg.decoder.sp) {
    // The shard's rows in sp_chunks pieces, one all-gather each: a rank
    // holds one piece's gathered rows (and, backward, one piece's input
    // gradient at its reduce-scatter) instead of the whole [tp x shard].
    // Every TP rank holds the same shard rows, so the pieces agree.
    const std::vector<int64_t> pieces = sp_chunk_rows(E.size(0), cfg.sp_chunks);
    if (pieces.size() == 1) return {{E}, E};
    return {split_rows(E, pieces), E};
  }
  Tensor x = nn::copy_to_tp_region(E, tp_group);
  return {{x}, tp_rank == 0 ? x : Tensor{}};
}

// ---- decoder (Megatron-style TP / SP) and loss: the graph's loss; the
// reported value (res.loss) is accumulated in float64.
Tensor decode_and_loss(const RankContext& rc, Tensor E, const ShardLayout& layout,
                       const dist::ProcessGroup& tp_group, StepRankResult& res) {
  const StepConfig& cfg = rc.cfg;
  const int tp = cfg.decoder.tp;
  const Drawn a_drawn = rc.syn.A();
  const std::vector<double>& a = *a_drawn;
  const int64_t cols = cfg.ffn / tp;
  std::vector<double> a_cols;
  for (int64_t r = 0; r < cfg.hidden; ++r)
    for (int64_t c = rc.tp_rank * cols; c < (rc.tp_rank + 1) * cols; ++c)
      a_cols.push_back(a[static_cast<std::size_t>(r * cfg.ffn + c)]);
  const Tensor A_t = from_vector(a_cols, {cfg.hidden, cols}, cfg.dtype);
  auto [X, pos_lhs] = decoder_inputs(cfg, E, rc.tp_rank, tp_group);
  // The positional term <pos_lhs, U>. U's rows are drawn without a
  // collective and dropped at once (PositionalTermFn draws them again in
  // the backward, so this lambda captures only what outlives the step's
  // backward: rc's referents and layout). Recorded before the decoder's
  // linear, its backward runs after the SP reduce-scatters, so no rank holds
  // its shard-sized gradient across them.
  auto draw_u = [&rc, &layout] {
    const int d = rc.dp_rank;
    return draw_rows(
        layout.tokens(), [&](int64_t b, int64_t t) { return rc.syn.u_row(d, b, t); }, rc.cfg.hidden,
        rc.cfg.dtype);
  };
  Tensor eu;
  if (pos_lhs.defined()) eu = PositionalTermFn{{}, draw_u}.apply({pos_lhs})[0];
  // Each piece's gathered rows are freed before the next all-gather: the
  // linear's backward needs A_t only. The loss sums the pieces' |Y|^2.
  std::vector<Tensor> Y;
  Tensor yy;
  for (Tensor& piece : X) {
    if (tp > 1 && cfg.decoder.sp) piece = nn::all_gather_single(piece, tp_group);
    Y.push_back(LinearFn{{}, LinearFn::kLeft, {}}.apply({piece, A_t})[0]);
    piece = Tensor{};
    const Tensor yy_piece = dot(Y.back(), Y.back());
    yy = yy.defined() ? add(yy, yy_piece) : yy_piece;
  }
  X.clear();
  Tensor loss = scale(yy, 0.5);
  if (eu.defined()) loss = add(loss, eu);
  // In float16 the graph's scalar overflows (|Y|^2 > 65504 on the default
  // mesh), while its gradient (Y, U) does not depend on that value.
  if (cfg.dtype == DType::Float64) {  // the graph's dots are these very sums
    res.loss = 0.5 * yy.item() + (eu.defined() ? eu.item() : 0.0);
  } else {
    double yy64 = 0;
    for (const Tensor& y : Y) yy64 += dot64(y, y);
    res.loss = 0.5 * yy64 + (pos_lhs.defined() ? dot64(pos_lhs, draw_u()) : 0.0);
  }
  return loss;  // Y, pos_lhs and E: the dot nodes keep what their backward needs
}

}  // namespace

std::pair<double, double> tolerance(DType dtype) {
  switch (dtype) {
    case DType::Float64: return {0.0, 1e-12};
    case DType::Float32: return {1e-5, 1e-4};
    default: return {1e-2, 5e-2};
  }
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

  // The step's tensors live in this scope only, and only the gradient
  // crosses the final all-reduce.
  Tensor g;
  {
    Tensor W = from_vector(*syn.W(), {cfg.in_features, cfg.hidden}, cfg.dtype);
    W.set_requires_grad(true);
    Tensor E = exchange_and_merge(rc, encode(rc, W), layout, keep_routed_rows, res);
    Tensor loss = decode_and_loss(rc, std::move(E), layout, mesh.group("tp"), res);
    // dW alone, without accumulating a .grad() into every leaf (the text
    // embeddings' gradient would be one more shard-sized buffer held to the
    // end); same engine, same order, same collectives as backward().
    g = grad({loss}, {W})[0].copy_data();
  }  // every tensor of the step is freed here, before the all-reduce yields
  dist::all_reduce(world, g, dist::ReduceOp::Sum);
  res.encoder_grad = g;
  return res;
}

StepReference reference_step(const StepConfig& cfg, const std::vector<Batch>& per_dp) {
  validate(cfg, per_dp);
  const Synthetic syn{cfg};
  const Drawn W_drawn = syn.W(), A_drawn = syn.A();
  const double* const W = W_drawn->data();
  const double* const A = A_drawn->data();
  const int64_t H = cfg.hidden, I = cfg.in_features, Fn = cfg.ffn;
  // Every sum below keeps the order of the plain loops it replaced (each
  // element: 0, then + a_p b_p in increasing p), so the bits are the same;
  // the loops are only arranged so that independent elements are computed
  // side by side (vectorizable) instead of one long add chain at a time.
  // At = A^T ([ffn, hidden]): back[h] = sum_c y[c] A[h, c] runs over c for all
  // h at once, reading At's rows contiguously.
  std::vector<double> At(static_cast<std::size_t>(Fn * H));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < Fn; ++c)
      At[static_cast<std::size_t>(c * H + h)] = A[static_cast<std::size_t>(h * Fn + c)];
  // Rounds to the step's dtype (identity in float64).
  auto round = [&](std::vector<double>& v) {
    if (cfg.dtype != DType::Float64)
      v = from_vector(v, {static_cast<int64_t>(v.size())}, cfg.dtype).to_vector();
  };
  StepReference ref;
  ref.encoder_grad.assign(static_cast<std::size_t>(I * H), 0.0);
  double* const dW = ref.encoder_grad.data();
  std::vector<double> y(static_cast<std::size_t>(Fn)), back(static_cast<std::size_t>(H));
  std::vector<double> F;
  for (int d = 0; d < cfg.dp; ++d) {
    const Batch& batch = per_dp[static_cast<std::size_t>(d)];
    ref.embeddings.emplace_back();
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
        // F = P W, accumulated in float64 in the order of the inner index.
        F.assign(static_cast<std::size_t>(im.tokens * H), 0.0);
        const double* const P = img.P->data();
        for (int64_t r = 0; r < im.tokens; ++r)
          accumulate_rows(P + r * I, 1, I, W, H, F.data() + r * H, H);
        round(F);
        std::copy(F.begin(), F.end(), E.begin() + im.token_start * H);
        imgs.push_back(std::move(img));
      }
      // loss and dE = U + (E A) A^T; dE only on image rows, the only ones
      // dW reads (text rows contribute to the loss alone).
      std::vector<double> dE(E.size());
      std::vector<char> image_row(static_cast<std::size_t>(s.seq_len), 0);
      for (const Img& img : imgs) std::fill_n(image_row.begin() + img.start, img.tokens, char{1});
      for (int64_t t = 0; t < s.seq_len; ++t) {
        const double* const e = &E[static_cast<std::size_t>(t * H)];
        const double* const u = U + t * H;
        const double* const yy = y.data();
        const double* const bk = back.data();
        std::fill(y.begin(), y.end(), 0.0);
        accumulate_rows(e, 1, H, A, Fn, y.data(), Fn);  // y = e A
        for (int64_t h = 0; h < H; ++h) {
          const double term = e[h] * u[h];
          ref.loss += term;
          ref.loss_scale += std::abs(term);
        }
        for (int64_t c = 0; c < Fn; ++c) {
          const double term = 0.5 * yy[c] * yy[c];
          ref.loss += term;
          ref.loss_scale += term;
        }
        if (image_row[static_cast<std::size_t>(t)] == 0) continue;
        std::fill(back.begin(), back.end(), 0.0);
        accumulate_rows(yy, 1, Fn, At.data(), H, back.data(), H);  // back = y A^T
        double* const de = dE.data() + t * H;
        for (int64_t h = 0; h < H; ++h) de[h] = u[h] + bk[h];
      }
      // dW += P^T dE over each image's rows
      for (const Img& img : imgs) {
        const double* const P = img.P->data();
        for (int64_t k = 0; k < I; ++k)  // dW[k, :] += sum over rows r of P[r, k] dE[r, :]
          accumulate_rows(P + k, I, img.tokens, dE.data() + img.start * H, H, dW + k * H, H);
      }
      ref.embeddings.back().push_back(std::move(E));
    }
  }
  return ref;
}

StepCheck check_step(const StepConfig& cfg, const std::vector<Batch>& per_dp,
                     const std::vector<StepRankResult>& ranks, const StepReference& ref) {
  (void)per_dp;
  StepCheck chk;
  double ref_max = 0;
  for (double v : ref.encoder_grad) ref_max = std::max(ref_max, std::abs(v));
  double loss = 0;
  for (const auto& r : ranks) {
    loss += r.loss;
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
  chk.loss_rel_diff =
      std::abs(loss - ref.loss) / std::max({ref.loss_scale, std::abs(ref.loss), 1e-300});
  const auto [fwd_tol, grad_tol] = tolerance(cfg.dtype);
  chk.passed = chk.forward_max_abs_diff <= fwd_tol && chk.grad_max_rel_diff <= grad_tol &&
               chk.loss_rel_diff <= std::max(grad_tol, 1e-12);
  return chk;
}

}  // namespace diffcomm::encoder_parallel
