// Unit tests of the encoder-parallel layer (DESIGN.md "Encoder-parallel
// feature exchange"): the training step against its single-rank reference in every mode,
// and a negative control: a step written here whose gradient convention can be
// chosen wrongly, which the tests must catch.
//
// Every expected value below is worked out by hand in the comment next to it,
// never taken from the code under test (fixtures.hpp: the shared inputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/encoder_parallel/contracts.hpp"
#include "diffcomm/encoder_parallel/exact_sum.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "fixtures.hpp"

namespace diffcomm {
namespace {

using namespace ep_testing;  // NOLINT(google-build-using-namespace)

// ============================================================ training step

std::vector<ep::StepRankResult> run_steps(const ep::StepConfig& cfg,
                                          const std::vector<ep::Batch>& per_dp,
                                          uint64_t world_seed = 3) {
  std::vector<ep::StepRankResult> out(static_cast<std::size_t>(cfg.world_size()));
  sim::WorldOptions o;
  o.ranks = cfg.world_size();
  o.seed = world_seed;
  sim::World world(o);
  world.run([&](sim::Rank& rk) {
    out[static_cast<std::size_t>(rk.rank())] = ep::run_step(rk.world(), cfg, per_dp);
  });
  return out;
}

ep::StepConfig step_config(int dp, const ep::DecoderMesh& m, const ep::EncoderLayout& e) {
  ep::StepConfig cfg;
  cfg.dp = dp;
  cfg.decoder = m;
  cfg.encoder = e;
  cfg.hidden = 4;
  cfg.in_features = 3;
  cfg.ffn = 12;
  cfg.ffn_blocks = 12;  // dX's canonical blocks: one per column, every tp in 1..4 holds whole ones
  cfg.seed = 99;
  return cfg;
}

TEST(TrainingStep, DesignExampleMatchesReferenceInEveryMode) {
  struct Case {
    ep::DecoderMesh mesh;
    ep::EncoderLayout enc;
    ep::FeatureExchangeMode mode;
  };
  const std::vector<Case> cases = {
      {mesh_of(1, 1, false), encoder_layout(1, 1), ep::FeatureExchangeMode::Local},
      {mesh_of(1, 2, false), encoder_layout(2, 1), ep::FeatureExchangeMode::TpVariableAllGather},
      {mesh_of(1, 4, true), encoder_layout(2, 2), ep::FeatureExchangeMode::TpVariableA2A},
      {mesh_of(2, 2, true), encoder_layout(4, 1), ep::FeatureExchangeMode::ParentVariableA2A},
      {mesh_of(2, 2, false), encoder_layout(1, 4), ep::FeatureExchangeMode::ParentVariableA2A},
      {mesh_of(2, 2, true, ep::CpLayout::Zigzag), encoder_layout(2, 2),
       ep::FeatureExchangeMode::ParentVariableA2A},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(ep::mode_name(c.mode) + " cp " + std::to_string(c.mesh.cp) + " tp " +
                 std::to_string(c.mesh.tp) + (c.mesh.sp ? " sp" : "") + " " +
                 ep::cp_layout_name(c.mesh.layout));
    const auto cfg = step_config(2, c.mesh, c.enc);
    const std::vector<ep::Batch> per_dp = {design_example(), five_images()};
    const auto ranks = run_steps(cfg, per_dp);
    const auto ref = ep::reference_step(cfg, per_dp);
    const auto chk = ep::check_step(cfg, per_dp, ranks, ref);
    EXPECT_TRUE(chk.passed);
    EXPECT_EQ(chk.forward_max_abs_diff, 0.0);
    EXPECT_LE(chk.grad_max_rel_diff, 1e-12);
    for (const auto& r : ranks) {
      EXPECT_EQ(r.mode, c.mode);
      EXPECT_EQ(
          r.plan_fingerprint,
          ranks[static_cast<std::size_t>(r.dp_rank * c.mesh.cp * c.mesh.tp)].plan_fingerprint);
    }
  }
}

// Issue 50: the same micro-batches on every mesh give the same gradient and
// loss bits (the step's sums are canonical), in float64 and float32, and
// they are the reference's bits (tolerance 0).
TEST(TrainingStep, EveryMeshGivesTheSameBits) {
  const std::vector<ep::Batch> per_dp = {design_example(), five_images()};
  const std::vector<std::pair<ep::DecoderMesh, ep::EncoderLayout>> meshes = {
      {mesh_of(1, 1, false), encoder_layout(1, 1)},
      {mesh_of(1, 2, false), encoder_layout(2, 1)},
      {mesh_of(1, 4, true), encoder_layout(2, 2)},
      {mesh_of(1, 4, false), encoder_layout(1, 4)},
      {mesh_of(2, 2, true), encoder_layout(4, 1)},
      {mesh_of(2, 2, false), encoder_layout(1, 4)},
      {mesh_of(2, 2, true, ep::CpLayout::Zigzag), encoder_layout(2, 2)},
  };
  for (const DType dt : {DType::Float64, DType::Float32}) {
    std::optional<std::vector<double>> grad;
    std::optional<double> loss;
    for (const auto& [mesh, enc] : meshes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " cp " + std::to_string(mesh.cp) + " tp " +
                   std::to_string(mesh.tp) + (mesh.sp ? " sp" : ""));
      auto cfg = step_config(2, mesh, enc);
      cfg.dtype = dt;
      cfg.grad_block_rows = 3;  // images of 4..12 rows: several blocks each
      const auto ranks = run_steps(cfg, per_dp);
      const auto chk = ep::check_step(cfg, per_dp, ranks, ep::reference_step(cfg, per_dp));
      EXPECT_TRUE(chk.passed);
      EXPECT_EQ(chk.grad_max_rel_diff, 0.0);
      EXPECT_EQ(chk.loss_rel_diff, 0.0);
      ep::ExactSum total;
      for (const auto& r : ranks) {
        total.add(ep::ExactSum::from_limbs(r.loss_limbs, r.loss_special));
        EXPECT_EQ(r.encoder_grad.to_vector(), ranks[0].encoder_grad.to_vector());
      }
      if (!grad) {
        grad = ranks[0].encoder_grad.to_vector();
        loss = total.value();
        continue;
      }
      EXPECT_EQ(ranks[0].encoder_grad.to_vector(), *grad);
      EXPECT_EQ(total.value(), *loss);
    }
  }
}

TEST(TrainingStep, DegenerateBatches) {
  // An empty micro-batch, a sample of length 0, a zero-token image, and an
  // image filling its whole sample, on meshes of every mode.
  ep::Batch empty;
  ep::Batch odd;
  odd.samples.push_back(sample(0, {}));
  odd.samples.push_back(sample(8, {span(2, 0, 0), span(4, 4, 16)}));
  odd.samples.push_back(sample(8, {span(0, 8, 32)}));
  for (const auto& m : {mesh_of(1, 1, false), mesh_of(1, 2, false), mesh_of(1, 4, true),
                        mesh_of(2, 2, true, ep::CpLayout::Zigzag), mesh_of(4, 1, false)}) {
    SCOPED_TRACE("cp " + std::to_string(m.cp) + " tp " + std::to_string(m.tp));
    const int n = m.cp > 1 ? m.cp * m.tp : m.tp;
    const auto cfg = step_config(2, m, encoder_layout(n, 1));
    const std::vector<ep::Batch> per_dp = {empty, odd};
    const auto ranks = run_steps(cfg, per_dp);
    const auto chk = ep::check_step(cfg, per_dp, ranks, ep::reference_step(cfg, per_dp));
    EXPECT_TRUE(chk.passed) << chk.forward_max_abs_diff << " " << chk.grad_max_rel_diff;
  }
}

// SP's all-gather in pieces (StepConfig::sp_chunks): a shard of n rows goes
// through min(sp_chunks, n) all-gathers, and one canonical reduce-scatter
// (an all_to_all_single) each in the backward, and every rank's encoder
// gradient, decoder input and loss are bit for bit those of one all-gather
// (each row's products and each element's canonical tree do not depend on
// the pieces; the loss is an exact sum).
TEST(TrainingStep, SpChunksSplitTheAllGatherAndKeepTheGradientBits) {
  const std::vector<ep::Batch> per_dp = {design_example(), five_images()};
  for (const auto& m : {mesh_of(1, 4, true), mesh_of(2, 2, true, ep::CpLayout::Zigzag)}) {
    SCOPED_TRACE("cp " + std::to_string(m.cp) + " tp " + std::to_string(m.tp));
    auto cfg = step_config(2, m, encoder_layout(2, 2));
    std::vector<ep::StepRankResult> whole;
    std::vector<uint64_t> gathers, all_to_alls;  // per rank, with one piece
    for (const int chunks : {1, 2, 3, 1000}) {
      SCOPED_TRACE("sp_chunks " + std::to_string(chunks));
      cfg.sp_chunks = chunks;
      std::vector<ep::StepRankResult> ranks(static_cast<std::size_t>(cfg.world_size()));
      sim::WorldOptions o;
      o.ranks = cfg.world_size();
      o.seed = 3;
      sim::World world(o);
      world.run([&](sim::Rank& rk) {
        const auto r = static_cast<std::size_t>(rk.rank());
        ranks[r] = ep::run_step(rk.world(), cfg, per_dp);
      });
      for (std::size_t r = 0; r < ranks.size(); ++r) {
        const int64_t rows = ranks[r].decoder_input.size(0);
        const auto pieces =
            static_cast<uint64_t>(std::max<int64_t>(1, std::min<int64_t>(chunks, rows)));
        const auto& stats = world.stats(static_cast<int>(r));
        EXPECT_EQ(stats.total("reduce_scatter_single").calls, 0u) << "rank " << r;
        if (chunks == 1) {
          gathers.push_back(stats.total("all_gather_single").calls);
          all_to_alls.push_back(stats.total("all_to_all_single").calls);
          continue;
        }
        EXPECT_EQ(stats.total("all_gather_single").calls, gathers[r] + pieces - 1)
            << "rank " << r << ", " << rows << " rows";
        EXPECT_EQ(stats.total("all_to_all_single").calls, all_to_alls[r] + pieces - 1)
            << "rank " << r;
      }
      EXPECT_TRUE(ep::check_step(cfg, per_dp, ranks, ep::reference_step(cfg, per_dp)).passed);
      if (chunks == 1) {
        whole = ranks;
        continue;
      }
      for (std::size_t r = 0; r < ranks.size(); ++r) {
        EXPECT_EQ(ranks[r].encoder_grad.to_vector(), whole[r].encoder_grad.to_vector())
            << "rank " << r;
        EXPECT_EQ(ranks[r].decoder_input.to_vector(), whole[r].decoder_input.to_vector());
        EXPECT_EQ(ranks[r].loss, whole[r].loss);
      }
    }
  }
}

TEST(TrainingStep, CheckStepDetectsAWrongGradientAndForward) {
  // check_step is the oracle of the properties: it must be able to fail.
  const auto cfg = step_config(1, mesh_of(1, 2, false), encoder_layout(2, 1));
  const std::vector<ep::Batch> per_dp = {five_images()};
  auto ranks = run_steps(cfg, per_dp);
  const auto ref = ep::reference_step(cfg, per_dp);
  ASSERT_TRUE(ep::check_step(cfg, per_dp, ranks, ref).passed);
  auto doubled = ranks;
  doubled[1].encoder_grad = scale(doubled[1].encoder_grad, 2.0);
  const auto bad = ep::check_step(cfg, per_dp, doubled, ref);
  EXPECT_FALSE(bad.passed);
  EXPECT_NEAR(bad.grad_max_rel_diff, 1.0, 1e-12);  // |2g - g| / max|g| on the worst element
  // Forward must be exact: one ulp off in one element fails.
  auto shifted = ranks;
  std::vector<double> v = ranks[0].decoder_input.to_vector();
  v[0] = std::nextafter(v[0], 1e300);
  shifted[0].decoder_input = from_vector(v, ranks[0].decoder_input.shape(), DType::Float64);
  EXPECT_FALSE(ep::check_step(cfg, per_dp, shifted, ref).passed);
}

TEST(TrainingStep, InconsistentConfigurationsRejected) {
  auto cfg = step_config(1, mesh_of(1, 2, false), encoder_layout(2, 1));
  const std::vector<ep::Batch> per_dp = {five_images()};
  // World of 3 ranks for dp 1 x cp 1 x tp 2.
  sim::WorldOptions o;
  o.ranks = 3;
  sim::World world(o);
  EXPECT_THROW(world.run([&](sim::Rank& rk) { ep::run_step(rk.world(), cfg, per_dp); }),
               InvalidArgument);
  cfg.ffn = 7;  // not a multiple of tp
  EXPECT_THROW(ep::reference_step(cfg, per_dp), InvalidArgument);
  cfg.ffn = 8;
  EXPECT_THROW(ep::reference_step(cfg, {}), InvalidArgument);  // 0 micro-batches for dp 1
  for (const int chunks : {0, -1, ep::kMaxSpChunks + 1}) {
    cfg.sp_chunks = chunks;
    EXPECT_THROW(ep::reference_step(cfg, per_dp), InvalidArgument) << chunks;
  }
}

// ============================================================ negative control
//
// A minimal distributed step written here, independent of run_step, in
// which the gradient convention can be chosen wrongly. Decoder without SP
// (Megatron): every TP rank of CP rank c holds the same shard E_c, enters
// the TP region by "copy to TP region" (identity forward, all-reduce of the
// input gradient over TP backward) and adds <E_c, U_t> to the loss, where
// U_t(b, tok, h) = (1 + t) (tok + 1 + h/4 + 10 b) depends on the TP rank t
// (a column-parallel term). The single-rank reference loss is
// sum_t <E, U_t>, so the gradient of the feature row of token tok is, in
// closed form,
//   dX(b, tok, h) = sum_t (1 + t) (tok + 1 + h/4 + 10 b)
//                 = tp (tp + 1) / 2 * (tok + 1 + h/4 + 10 b).
// After the copy's all-reduce every TP replica already holds this full
// gradient; summing the replicas again in the exchange (Partial) counts it
// tp times. ReplicatedOverTp (what receiver_grad_for says) gives it once.

double u_value(int t, int64_t b, int64_t tok, int64_t h) {
  return (1.0 + t) * (static_cast<double>(tok) + 1.0 + static_cast<double>(h) / 4.0 +
                      10.0 * static_cast<double>(b));
}

// Runs the step with the given convention; returns the gradient of every
// item's feature rows (by item id).
std::map<int64_t, std::vector<double>> replica_step(int cp, int tp, const ep::Batch& batch,
                                                    std::optional<ep::ReceiverGrad> convention) {
  const auto mesh = mesh_of(cp, tp, false);
  const int n = cp * tp;
  const auto plan = ep::plan_exchange(batch, mesh, encoder_layout(n, 1));
  std::vector<std::vector<ep::EncoderFeature>> recs(static_cast<std::size_t>(n));
  sim::WorldOptions o;
  o.ranks = n;
  o.seed = 17;
  sim::World world(o);
  world.run([&](sim::Rank& rk) {
    dist::DeviceMesh dm = rk.mesh({{"cp", cp}, {"tp", tp}});
    const int c = dm.coordinate("cp"), t = dm.coordinate("tp");
    const dist::ProcessGroup exchange =
        cp > 1 ? dm.group(std::vector<std::string>{"cp", "tp"}) : dm.group("tp");
    const int e = exchange.rank();
    auto& mine = recs[static_cast<std::size_t>(rk.rank())];
    mine = records_of(plan, e);
    Tensor proto = zeros({0, kHidden}, DType::Float64);
    proto.set_requires_grad(true);
    const auto grad_kind = convention.value_or(ep::receiver_grad_for(mesh.context(c, t)));
    const auto routed = ep::route_features(plan.mode, mine, proto, e, plan, exchange, grad_kind);
    const auto received = ep::unpack_records(routed.rows, routed.items);
    const ep::ShardLayout layout(plan, e);
    Tensor base = zeros({layout.rows(), kHidden}, DType::Float64);
    base.set_requires_grad(true);
    const Tensor E = ep::merge_into_decoder(base, received, layout, routed.rows);
    const Tensor X = nn::copy_to_tp_region(E, dm.group("tp"));
    std::vector<double> u;
    for (const auto& [b, tok] : layout.tokens())
      for (int64_t h = 0; h < kHidden; ++h) u.push_back(u_value(t, b, tok, h));
    const Tensor U = from_vector(u, {layout.rows(), kHidden}, DType::Float64);
    backward({dot(X, U)});
  });
  std::map<int64_t, std::vector<double>> g;
  for (const auto& mine : recs)
    for (const auto& f : mine) g[f.item.item_id] = f.rows.grad().to_vector();
  return g;
}

// Largest |got - factor * reference| / max |reference| over every item.
double rel_error(const std::map<int64_t, std::vector<double>>& got, const ep::Batch& batch, int tp,
                 double factor) {
  const auto plan = ep::plan_exchange(batch, mesh_of(1, 1, false), encoder_layout(1, 1));
  double worst = 0, ref_max = 0;
  for (const auto& it : plan.items) {
    const auto& g = got.at(it.item_id);
    EXPECT_EQ(static_cast<int64_t>(g.size()), it.output_rows * kHidden);
    for (int64_t r = 0; r < it.output_rows; ++r)
      for (int64_t h = 0; h < kHidden; ++h) {
        const double ref =
            tp * (tp + 1) / 2.0 *
            (static_cast<double>(it.decoder_token_start + r) + 1.0 + static_cast<double>(h) / 4.0 +
             10.0 * static_cast<double>(it.batch_index));
        ref_max = std::max(ref_max, std::abs(ref));
        worst =
            std::max(worst, std::abs(g[static_cast<std::size_t>(r * kHidden + h)] - factor * ref));
      }
  }
  return worst / ref_max;
}

TEST(NegativeControl, PartialOverTpReplicasCountsTheGradientTpTimes) {
  const ep::Batch batch = five_images();  // item 1 straddles the CP boundary at token 4
  struct Mesh {
    int cp, tp;
  };
  for (const Mesh m : {Mesh{1, 2}, Mesh{1, 3}, Mesh{2, 2}}) {
    SCOPED_TRACE("cp " + std::to_string(m.cp) + " tp " + std::to_string(m.tp));
    // The convention receiver_grad_for picks (ReplicatedOverTp): the reference.
    ASSERT_EQ(ep::receiver_grad_for(mesh_of(m.cp, m.tp, false).context(0, 0)),
              ep::ReceiverGrad::ReplicatedOverTp);
    const auto right = replica_step(m.cp, m.tp, batch, std::nullopt);
    EXPECT_LE(rel_error(right, batch, m.tp, 1.0), 1e-12);
    // The wrong one (Partial, the plain adjoint over replicas): tp times the
    // reference, so "equal to the reference within 1e-12" fails.
    const auto wrong = replica_step(m.cp, m.tp, batch, ep::ReceiverGrad::Partial);
    EXPECT_LE(rel_error(wrong, batch, m.tp, static_cast<double>(m.tp)), 1e-12);
    EXPECT_GE(rel_error(wrong, batch, m.tp, 1.0), 0.5);
  }
}

}  // namespace
}  // namespace diffcomm
