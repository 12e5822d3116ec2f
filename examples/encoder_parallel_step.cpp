// A custom encoder-parallel training step written against the exchange API,
// on a simulated world of 4 ranks: decoder mesh cp 2 x tp 2 with sequence
// parallel, so every rank owns a distinct quarter of every sample.
//
//   plan_exchange       every rank plans from the same batch metadata
//   encoder             rank e computes bucket e: features = P @ W
//   route_features      rows travel to the ranks that own their tokens
//   unpack_records      received rows split back into one record per image
//   merge_into_decoder  records overwrite the text embeddings of the shard
//   loss, backward      loss_r = <E, U> + 0.5 |E|^2 over the rank's shard
//
// The encoder gradient dL/dW (summed over ranks, as a data-parallel trainer
// would) must equal a single-rank computation that never communicates:
//   L(W) = sum over images of <P_i W, U_i> + 0.5 |P_i W|^2 + (text terms).
// Exits 1 if it does not.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/distributed/mesh.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/sim/world.hpp"

namespace dc = diffcomm;
namespace ep = diffcomm::encoder_parallel;

constexpr int64_t kIn = 3;      // encoder input features per image token
constexpr int64_t kHidden = 4;  // feature width = decoder hidden size
// Encoder layout: 4 buckets (one per exchange rank), no encoder CP.
constexpr ep::EncoderLayout kEncoder{/*buckets=*/4, /*encoder_cp=*/1};

// ---- a hand-written batch: two samples of 16 tokens, three images ----------
ep::Batch tiny_batch() {
  ep::Batch batch;
  // ImageSpan: {token_start, tokens, patches (encoder cost), source_id}
  batch.samples.push_back({16, {{5, 6, 24, 0}}});                  // tokens 5..10
  batch.samples.push_back({16, {{1, 4, 16, 1}, {10, 6, 24, 2}}});  // 1..4, 10..15
  return batch;
}

// ---- deterministic data, the same on every rank and in the reference -------
dc::Tensor encoder_weight() {  // W [kIn, kHidden]
  std::vector<double> w;
  for (int64_t k = 0; k < kIn; ++k)
    for (int64_t h = 0; h < kHidden; ++h) w.push_back(0.1 * (k + 1) - 0.05 * h);
  return dc::from_vector(w, {kIn, kHidden}, dc::DType::Float64);
}
// Encoder input of the image at (sample, first token): [tokens, kIn] values.
std::vector<double> patches(int64_t sample, int64_t start, int64_t tokens) {
  std::vector<double> p;
  for (int64_t r = 0; r < tokens; ++r)
    for (int64_t k = 0; k < kIn; ++k)
      p.push_back(std::sin(1.0 + sample + 0.7 * start + 0.3 * r + k));
  return p;
}
double text(int64_t b, int64_t t, int64_t h) { return std::cos(b + 0.2 * t + 0.5 * h); }
double target(int64_t b, int64_t t, int64_t h) { return 0.01 * (t + 1) * (h + 1) - 0.1 * b; }

// Rows f(sample, token, 0..kHidden) for a list of (sample, token).
dc::Tensor rows_of(const std::vector<std::pair<int64_t, int64_t>>& tokens,
                   double (*f)(int64_t, int64_t, int64_t)) {
  std::vector<double> v;
  for (const auto& [b, t] : tokens)
    for (int64_t h = 0; h < kHidden; ++h) v.push_back(f(b, t, h));
  return dc::from_vector(v, {static_cast<int64_t>(tokens.size()), kHidden}, dc::DType::Float64);
}

// ---- the distributed step, run by every rank -------------------------------
struct RankOut {
  std::vector<double> grad;  // dL/dW summed over the world
  int64_t rows_received = 0, shard_rows = 0;
  double loss = 0;
};

void train_step(dc::sim::Rank& rank, const ep::Batch& batch, const ep::DecoderMesh& decoder,
                RankOut& out) {
  // Mesh {cp, tp}, TP fastest. The exchange runs over the CP x TP parent group.
  dc::dist::DeviceMesh mesh(rank.world(), {{"cp", decoder.cp}, {"tp", decoder.tp}});
  const dc::dist::ProcessGroup exchange = mesh.group(std::vector<std::string>{"cp", "tp"});
  const ep::MeshContext ctx = decoder.context(mesh.coordinate("cp"), mesh.coordinate("tp"));
  const int e = exchange.rank();

  // Every rank computes the same plan from the same metadata.
  const ep::ExchangePlan plan = ep::plan_exchange(batch, decoder, kEncoder);

  // Encoder: this rank produces bucket e. A rank with no images gets a
  // [0, kHidden] `features` that still depends on W, so it still takes part
  // in the backward collective.
  dc::Tensor W = encoder_weight();
  W.set_requires_grad(true);
  std::vector<double> p;
  int64_t rows = 0;
  for (int64_t id : plan.buckets[static_cast<std::size_t>(e)]) {
    const ep::EncoderWorkItem& it = plan.items[static_cast<std::size_t>(id)];
    const auto pi = patches(it.batch_index, it.decoder_token_start, it.output_rows);
    p.insert(p.end(), pi.begin(), pi.end());
    rows += it.output_rows;
  }
  const dc::Tensor features = dc::matmul(dc::from_vector(p, {rows, kIn}, dc::DType::Float64), W);
  std::vector<ep::EncoderFeature> records;
  int64_t at = 0;
  for (int64_t id : plan.buckets[static_cast<std::size_t>(e)]) {
    const ep::EncoderWorkItem& it = plan.items[static_cast<std::size_t>(id)];
    records.push_back({it, dc::narrow(features, at, it.output_rows)});
    at += it.output_rows;
  }

  // Exchange: with SP every receiver owns distinct tokens -> Partial gradients.
  const ep::RoutedFeatures routed = ep::route_features(plan.mode, records, features, e, plan,
                                                       exchange, ep::receiver_grad_for(ctx));
  const std::vector<ep::EncoderFeature> received = ep::unpack_records(routed.rows, routed.items);

  // Decoder input of this rank's shard: text embeddings, image rows merged in.
  const ep::ShardLayout layout(plan, e);
  const dc::Tensor base = rows_of(layout.tokens(), text);
  const dc::Tensor E = ep::merge_into_decoder(base, received, layout, routed.rows);
  const dc::Tensor U = rows_of(layout.tokens(), target);
  const dc::Tensor loss = dc::add(dc::dot(E, U), dc::scale(dc::dot(E, E), 0.5));
  dc::backward({loss});  // every rank: the exchange's backward is a collective

  dc::Tensor g = W.grad().defined() ? W.grad().copy_data() : dc::zeros_like(W);
  dc::dist::all_reduce(rank.world(), g);  // sum the replicas' partial gradients
  out.grad = g.to_vector();
  out.rows_received = routed.rows.size(0);
  out.shard_rows = layout.rows();
  out.loss = loss.item();
}

// ---- the single-rank computation: no mesh, no exchange ---------------------
std::vector<double> reference_grad(const ep::Batch& batch) {
  dc::Tensor W = encoder_weight();
  W.set_requires_grad(true);
  dc::Tensor loss;
  for (std::size_t b = 0; b < batch.samples.size(); ++b)
    for (const ep::ImageSpan& im : batch.samples[b].images) {
      const auto sample = static_cast<int64_t>(b);
      const dc::Tensor P = dc::from_vector(patches(sample, im.token_start, im.tokens),
                                           {im.tokens, kIn}, dc::DType::Float64);
      const dc::Tensor F = dc::matmul(P, W);
      std::vector<std::pair<int64_t, int64_t>> tokens;
      for (int64_t t = im.token_start; t < im.token_start + im.tokens; ++t)
        tokens.push_back({sample, t});
      const dc::Tensor term =
          dc::add(dc::dot(F, rows_of(tokens, target)), dc::scale(dc::dot(F, F), 0.5));
      loss = loss.defined() ? dc::add(loss, term) : term;
    }
  dc::backward({loss});
  return W.grad().to_vector();
}

int main() {
  const ep::Batch batch = tiny_batch();
  ep::DecoderMesh decoder;
  decoder.cp = 2;
  decoder.tp = 2;
  decoder.sp = true;
  decoder.layout = ep::CpLayout::Contiguous;

  const ep::ExchangePlan plan = ep::plan_exchange(batch, decoder, kEncoder);
  std::printf("mode %s\n", ep::mode_name(plan.mode).c_str());
  for (const ep::EncoderWorkItem& it : plan.items) {
    std::printf("image %lld (sample %lld, tokens %lld..%lld): bucket %d -> ranks",
                static_cast<long long>(it.item_id), static_cast<long long>(it.batch_index),
                static_cast<long long>(it.decoder_token_start),
                static_cast<long long>(it.decoder_token_start + it.output_rows - 1),
                plan.bucket_of[static_cast<std::size_t>(it.item_id)]);
    for (int d : plan.destinations[static_cast<std::size_t>(it.item_id)]) std::printf(" %d", d);
    std::printf("\n");
  }

  dc::sim::WorldOptions options;
  options.ranks = decoder.cp * decoder.tp;
  options.seed = 7;
  dc::sim::World world(options);
  std::vector<RankOut> outs(static_cast<std::size_t>(options.ranks));
  world.run([&](dc::sim::Rank& rank) {
    train_step(rank, batch, decoder, outs[static_cast<std::size_t>(rank.rank())]);
  });

  const std::vector<double> ref = reference_grad(batch);
  double ref_max = 0;
  for (double v : ref) ref_max = std::max(ref_max, std::abs(v));
  bool ok = ref_max > 0;
  for (std::size_t r = 0; r < outs.size(); ++r) {
    if (outs[r].grad.size() != ref.size()) {
      std::printf("rank %zu: dW has %zu values, expected %zu\n", r, outs[r].grad.size(),
                  ref.size());
      ok = false;
      continue;
    }
    double worst = 0;
    for (std::size_t i = 0; i < ref.size(); ++i)
      worst = std::max(worst, std::abs(outs[r].grad[i] - ref[i]));
    const double rel = worst / ref_max;
    ok = ok && rel <= 1e-12;
    std::printf("rank %zu: received %lld rows, shard %lld rows, loss %.6f, dW rel diff %.2e\n", r,
                static_cast<long long>(outs[r].rows_received),
                static_cast<long long>(outs[r].shard_rows), outs[r].loss, rel);
  }
  std::printf("encoder gradient %s the single-rank computation\n", ok ? "matches" : "DIFFERS from");
  return ok ? 0 : 1;
}
