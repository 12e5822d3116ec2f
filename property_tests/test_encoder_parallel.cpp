// Properties of the encoder-parallel exchange (DESIGN.md "Encoder-parallel
// feature exchange", "Gradient conventions in the exchange"):
//
//  1. Over random meshes (dp 1..2, cp 1..4, tp 1..4, SP on/off, contiguous or
//     zigzag CP; buckets x encoder_cp = the exchange group, encoder_cp any
//     divisor of it) and random batches, run_step on a simulated world gives
//     decoder inputs equal to the single-rank reference exactly and encoder
//     gradients within 1e-12 relative (float64).
//  2. On the same cases every rank computed the same plan as one computed
//     here, outside the world, and every exchange rank received exactly the
//     records the plan routes to it (in the A2A modes: the runs of each
//     item's tokens it owns), with the reference's feature rows. And the
//     exchange moves exactly the owner minimum: stats' total_bytes equals
//     owner_minimum_bytes equals a token-by-token count (issue 27 item 1).
//  3. Zero-row ranks take part in backward: batches of one sample with a
//     single 1..3-token image (or none), on the same random meshes, complete
//     (no Deadlock) and still match the reference on every rank.
//  4. unpack_records orders records by (batch_index, decoder_token_start,
//     item_id), keeps each record's own rows, and is differentiable.
//  5. ExchangePlan::validate accepts every plan_exchange plan, and refuses
//     one with a single random corruption (an item's span moved onto another
//     of its sample, an owner dropped from its destinations, a wrong
//     item_id, a destination out of range, a span past the sample's end)
//     with InvalidArgument naming the corrupted item.
//
// Batches. Image sizes are drawn from the real COCO val2017 sizes shipped in
// data/coco_val2017/image_sizes.csv (loaded once), and turned into decoder
// tokens by the Qwen2-VL rule (qwen2vl::image_tokens: 35..529 tokens over
// the 5000 images, median 345). To keep a case small each case also draws a token
// divisor s in {1, 4, 32}: an image has max(1, tokens / s) tokens and 4x as
// many patches (s = 1 keeps the real counts; larger s gives many small
// images, so some ranks get none and others get several). Each sample has
// 0..2 images separated by 0..g text tokens (g drawn per sample from
// {0, 1, 4, 16}; g = 0 makes images adjacent and samples possibly empty),
// and is padded to the mesh's required_seq_multiple. Images therefore
// straddle CP/SP ownership boundaries often (classified in the output).
//
// On failure the message carries the world seed and the whole case; the
// RapidCheck reproduce string replays it.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace {

namespace ep = encoder_parallel;

const std::vector<ep::ImageSize>& coco() {
  static const std::vector<ep::ImageSize> sizes =
      ep::load_image_sizes(ep::default_image_sizes_path());
  return sizes;
}

// ---------------------------------------------------------------- cases

// RapidCheck scales inRange by the test size (small values first); the mesh,
// the images and the batch shape are drawn uniformly at every size instead,
// and still shrink towards the lower bound.
template <class T>
T uniform(T lo, T hi_inclusive) {
  return *rc::gen::resize(rc::kNominalSize, rc::gen::inRange<T>(lo, hi_inclusive + 1));
}

bool coin() { return *rc::gen::resize(rc::kNominalSize, rc::gen::arbitrary<bool>()); }

struct StepCase {
  ep::StepConfig cfg;
  std::vector<ep::Batch> per_dp;
  uint64_t world_seed = 0;
  int64_t token_divisor = 1;
};

std::string describe_batch(const ep::Batch& b) {
  std::string s;
  for (const auto& smp : b.samples) {
    s += fmt::format(" S={}{{", smp.seq_len);
    for (const auto& im : smp.images)
      s += fmt::format("[{},{})p{}#{} ", im.token_start, im.token_start + im.tokens, im.patches,
                       im.source_id);
    s += "}";
  }
  return s;
}

std::string describe(const StepCase& c) {
  const auto& m = c.cfg.decoder;
  std::string s = fmt::format(
      "world_seed={} step_seed={} dtype={} grad_block_rows={} ffn_blocks={} dp={} cp={} tp={} "
      "sp={} "
      "sp_chunks={} layout={} buckets={} encoder_cp={} token_divisor={}",
      c.world_seed, c.cfg.seed, dtype_name(c.cfg.dtype), c.cfg.grad_block_rows, c.cfg.ffn_blocks,
      c.cfg.dp, m.cp, m.tp, m.sp, c.cfg.sp_chunks, ep::cp_layout_name(m.layout),
      c.cfg.encoder.buckets, c.cfg.encoder.encoder_cp, c.token_divisor);
  for (std::size_t d = 0; d < c.per_dp.size(); ++d)
    s += fmt::format(" | dp{}:{}", d, describe_batch(c.per_dp[d]));
  return s;
}

int exchange_size(const ep::DecoderMesh& m) { return m.cp > 1 ? m.cp * m.tp : m.tp; }

/// A random decoder mesh and an encoder layout consistent with its exchange
/// group (encoder_cp a divisor of it, buckets the quotient).
ep::StepConfig gen_config(int max_dp, int max_cp, int max_tp) {
  ep::StepConfig cfg;
  cfg.dp = uniform(1, max_dp);
  cfg.decoder.cp = uniform(1, max_cp);
  cfg.decoder.tp = uniform(1, max_tp);
  cfg.decoder.sp = coin();
  cfg.sp_chunks = uniform(1, 6);  // more pieces than a shard's rows included
  cfg.decoder.layout = coin() ? ep::CpLayout::Zigzag : ep::CpLayout::Contiguous;
  const int n = exchange_size(cfg.decoder);
  std::vector<int> divisors;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0) divisors.push_back(k);
  cfg.encoder.encoder_cp = *rc::gen::elementOf(divisors);
  cfg.encoder.buckets = n / cfg.encoder.encoder_cp;
  cfg.hidden = 4;
  cfg.in_features = 3;
  cfg.ffn = 12;                 // divisible by every tp in 1..4
  std::vector<int64_t> blocks;  // dX's column blocks: divide ffn, multiples of tp
  for (int64_t g = 1; g <= cfg.ffn; ++g)
    if (cfg.ffn % g == 0 && g % cfg.decoder.tp == 0) blocks.push_back(g);
  cfg.ffn_blocks = *rc::gen::elementOf(blocks);
  // Every dtype: the step's sums are canonical and the reference emulates
  // the dtype's roundings, so every one must match bit for bit.
  cfg.dtype = *rc::gen::element(DType::Float64, DType::Float32, DType::BFloat16, DType::Float16);
  cfg.grad_block_rows = *rc::gen::element<int64_t>(1, 3, 64, 1000);
  cfg.seed = *rc::gen::arbitrary<uint64_t>();
  return cfg;
}

/// One micro-batch: samples of text and COCO images (see the file comment).
ep::Batch gen_batch(const ep::DecoderMesh& mesh, int max_samples, int max_images,
                    int64_t token_divisor) {
  const int64_t multiple = ep::required_seq_multiple(mesh);
  ep::Batch batch;
  const int samples = uniform(1, max_samples);
  for (int s = 0; s < samples; ++s) {
    ep::Sample smp;
    const int images = uniform(0, max_images);
    const int64_t gap = *rc::gen::element<int64_t>(0, 1, 4, 16);
    int64_t pos = 0;
    for (int k = 0; k < images; ++k) {
      pos += uniform<int64_t>(0, gap);
      const auto& im = coco()[uniform<std::size_t>(0, coco().size() - 1)];
      ep::ImageSpan span;
      span.token_start = pos;
      span.tokens =
          std::max<int64_t>(1, ep::qwen2vl::image_tokens(im.height, im.width) / token_divisor);
      span.patches = 4 * span.tokens;
      span.source_id = im.image_id;
      smp.images.push_back(span);
      pos += span.tokens;
    }
    pos += uniform<int64_t>(0, gap);
    smp.seq_len = (pos + multiple - 1) / multiple * multiple;
    batch.samples.push_back(std::move(smp));
  }
  return batch;
}

StepCase gen_step_case() {
  StepCase c;
  c.cfg = gen_config(2, 4, 4);
  c.token_divisor = *rc::gen::element<int64_t>(1, 4, 32);
  for (int d = 0; d < c.cfg.dp; ++d)
    c.per_dp.push_back(gen_batch(c.cfg.decoder, 3, 2, c.token_divisor));
  c.world_seed = *rc::gen::arbitrary<uint64_t>();
  return c;
}

// ---------------------------------------------------------------- running

/// Runs run_step on every rank of a seeded world; RC_FAILs (naming the case)
/// if any rank throws — a Deadlock included.
std::vector<ep::StepRankResult> run_world(const StepCase& c) {
  std::vector<ep::StepRankResult> out(static_cast<std::size_t>(c.cfg.world_size()));
  sim::WorldOptions opt;
  opt.ranks = c.cfg.world_size();
  opt.seed = c.world_seed;
  opt.trace = false;
  sim::World world(opt);
  std::string error;
  try {
    world.run([&](sim::Rank& rk) {
      out[static_cast<std::size_t>(rk.rank())] = ep::run_step(rk.world(), c.cfg, c.per_dp);
    });
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) RC_FAIL(fmt::format("run_step threw [{}]: {}", describe(c), error));
  return out;
}

/// A received record: item id, first token, rows.
using Arrival = std::tuple<int64_t, int64_t, int64_t>;

/// The records the plan routes to exchange rank e, in transport order
/// (producer, then bucket order): every item whole in the all-gather mode,
/// the rank's own bucket in the local mode; in the A2A modes, for each item
/// whose destinations include e, each maximal run of its tokens that e owns
/// (row-level routing). Written from the plan's documented meaning, token by
/// token, not from ExchangePlan::sends/receives/owned_rows.
std::vector<Arrival> planned_arrivals(const ep::ExchangePlan& plan, int e) {
  std::vector<Arrival> out;
  const bool whole = plan.mode == ep::FeatureExchangeMode::TpVariableAllGather ||
                     plan.mode == ep::FeatureExchangeMode::Local;
  for (const auto& bucket : plan.buckets)
    for (int64_t id : bucket) {
      const auto& it = plan.items[static_cast<std::size_t>(id)];
      const auto& dst = plan.destinations[static_cast<std::size_t>(id)];
      if (whole) {
        out.emplace_back(id, it.decoder_token_start, it.output_rows);
        continue;
      }
      if (std::find(dst.begin(), dst.end(), e) == dst.end()) continue;
      const auto mine = plan.owned(it.batch_index, e);
      auto owns = [&](int64_t t) {
        return std::any_of(mine.begin(), mine.end(),
                           [&](const auto& r) { return r.first <= t && t < r.second; });
      };
      const int64_t end = it.decoder_token_start + it.output_rows;
      for (int64_t t = it.decoder_token_start; t < end; ++t)
        if (owns(t) && (t == it.decoder_token_start || !owns(t - 1)))
          out.emplace_back(id, t, 1);
        else if (owns(t))
          ++std::get<2>(out.back());
    }
  return out;
}

std::string arrivals_text(const std::vector<Arrival>& a) {
  std::string s;
  for (const auto& [id, t, n] : a) s += fmt::format(" {}@{}+{}", id, t, n);
  return s;
}

/// Checks, on every rank: the plan fingerprint equals the plan computed here;
/// the received items are the planned arrivals; the routed rows of each
/// item equal the reference's feature rows at its tokens.
void check_plan_and_routing(const StepCase& c, const std::vector<ep::StepRankResult>& ranks,
                            const ep::StepReference& ref) {
  std::vector<ep::ExchangePlan> plans;
  for (const auto& b : c.per_dp)
    plans.push_back(ep::plan_exchange(b, c.cfg.decoder, c.cfg.encoder));
  const auto H = static_cast<std::size_t>(c.cfg.hidden);
  for (const auto& r : ranks) {
    const auto& plan = plans[static_cast<std::size_t>(r.dp_rank)];
    if (r.plan_fingerprint != plan.fingerprint())
      RC_FAIL(fmt::format("rank {} computed plan\n  {}\nbut the plan is\n  {}\n[{}]", r.rank,
                          r.plan_fingerprint, plan.fingerprint(), describe(c)));
    std::vector<Arrival> got;
    for (const auto& it : r.received_items)
      got.emplace_back(it.item_id, it.decoder_token_start, it.output_rows);
    const auto want = planned_arrivals(plan, r.exchange_rank);
    if (got != want)
      RC_FAIL(fmt::format("rank {} (exchange rank {}) received [{}], the plan routes [{}] [{}]",
                          r.rank, r.exchange_rank, arrivals_text(got), arrivals_text(want),
                          describe(c)));
    const auto rows = r.routed_rows.to_vector();
    std::size_t at = 0;
    for (const auto& it : r.received_items) {
      const auto& emb = ref.embeddings[static_cast<std::size_t>(r.dp_rank)]
                                      [static_cast<std::size_t>(it.batch_index)];
      const auto len = static_cast<std::size_t>(it.output_rows) * H;
      if (at + len > rows.size() ||
          !std::equal(rows.begin() + static_cast<std::ptrdiff_t>(at),
                      rows.begin() + static_cast<std::ptrdiff_t>(at + len),
                      emb.begin() + static_cast<std::ptrdiff_t>(
                                        static_cast<std::size_t>(it.decoder_token_start) * H)))
        RC_FAIL(
            fmt::format("rank {}: routed rows of item {} differ from the reference features "
                        "[{}]",
                        r.rank, it.item_id, describe(c)));
      at += len;
    }
    if (at != rows.size())
      RC_FAIL(fmt::format("rank {}: {} routed values for items totalling {} [{}]", r.rank,
                          rows.size(), at, describe(c)));
  }
}

void check_reference(const StepCase& c, const std::vector<ep::StepRankResult>& ranks,
                     const ep::StepReference& ref) {
  const ep::StepCheck chk = ep::check_step(c.cfg, c.per_dp, ranks, ref);
  if (chk.forward_max_abs_diff != 0.0 || chk.grad_max_rel_diff != 0.0 || chk.loss_rel_diff != 0.0 ||
      !chk.passed)
    RC_FAIL(fmt::format(
        "distributed step != single-rank reference: forward max |diff| {}, encoder grad max rel "
        "diff {}, loss rel diff {} (want 0, 0, 0) [{}]",
        chk.forward_max_abs_diff, chk.grad_max_rel_diff, chk.loss_rel_diff, describe(c)));
  // Bits, not only values: every rank's gradient holds the reference's bytes.
  for (const auto& r : ranks) {
    const Tensor want = from_vector(ref.encoder_grad, r.encoder_grad.shape(), c.cfg.dtype);
    if (std::memcmp(want.data_ptr(), r.encoder_grad.data_ptr(), want.nbytes()) != 0)
      RC_FAIL(fmt::format("rank {}: encoder gradient bytes differ from the reference [{}]", r.rank,
                          describe(c)));
  }
}

void classify(const StepCase& c, const std::vector<ep::StepRankResult>& ranks) {
  bool straddles = false, empty_sample = false;
  for (const auto& b : c.per_dp) {
    const auto plan = ep::plan_exchange(b, c.cfg.decoder, c.cfg.encoder);
    for (const auto& d : plan.destinations) straddles = straddles || d.size() > 1;
    for (const auto& s : b.samples) empty_sample = empty_sample || s.images.empty();
  }
  bool zero_row_rank = false;
  for (const auto& r : ranks) zero_row_rank = zero_row_rank || r.routed_rows.size(0) == 0;
  RC_CLASSIFY(straddles, "image on several owners");
  RC_CLASSIFY(empty_sample, "sample without image");
  RC_CLASSIFY(zero_row_rank, "rank receiving no rows");
  RC_TAG(ep::mode_name(ranks.front().mode));
}

// ---------------------------------------------------------------- properties

RC_GTEST_PROP(EncoderParallel, DistributedStepEqualsSingleRankReference, ()) {
  const StepCase c = gen_step_case();
  RC_LOG() << describe(c) << "\n";
  const auto ranks = run_world(c);
  const auto ref = ep::reference_step(c.cfg, c.per_dp);
  check_reference(c, ranks, ref);
  classify(c, ranks);
}

RC_GTEST_PROP(EncoderParallel, PlanIdenticalOnEveryRankAndRowsArriveWherePlanned, ()) {
  // Same cases: every rank's plan fingerprint equals the plan computed here
  // from the batch alone; each exchange rank received the planned items, in
  // transport order, carrying the reference's feature rows.
  const StepCase c = gen_step_case();
  RC_LOG() << describe(c) << "\n";
  const auto ranks = run_world(c);
  check_plan_and_routing(c, ranks, ep::reference_step(c.cfg, c.per_dp));
}

/// Rows the producer does not own, counted token by token over every owner
/// (owned_ranges directly): the owner minimum, independently of the planner.
uint64_t owner_rows_by_token(const ep::ExchangePlan& plan) {
  uint64_t rows = 0;
  for (const auto& it : plan.items) {
    const int producer = plan.producer(plan.bucket_of[static_cast<std::size_t>(it.item_id)]);
    const int64_t len = plan.seq_lens[static_cast<std::size_t>(it.batch_index)];
    for (int r = 0; r < plan.exchange_size; ++r) {
      if (r == producer) continue;
      const int c =
          plan.mode == ep::FeatureExchangeMode::ParentVariableA2A ? r / plan.decoder.tp : 0;
      const int t =
          plan.mode == ep::FeatureExchangeMode::ParentVariableA2A ? r % plan.decoder.tp : r;
      for (const auto& [lo, hi] : ep::owned_ranges(len, plan.decoder, c, t))
        for (int64_t k = it.decoder_token_start; k < it.decoder_token_start + it.output_rows; ++k)
          rows += (lo <= k && k < hi) ? 1 : 0;
    }
  }
  return rows;
}

RC_GTEST_PROP(EncoderParallel, ExchangeMovesExactlyTheOwnerMinimum, ()) {
  // Row-level routing: every row crosses once to each rank owning its token
  // and never elsewhere, so the bytes the send path moves (stats, from
  // sends()) equal the owner minimum, which equals a token-by-token count.
  const StepCase c = gen_step_case();
  RC_LOG() << describe(c) << "\n";
  for (const auto& b : c.per_dp) {
    const auto plan = ep::plan_exchange(b, c.cfg.decoder, c.cfg.encoder);
    const auto st = plan.stats(c.cfg.hidden, DType::Float64);
    const uint64_t row_bytes = static_cast<uint64_t>(c.cfg.hidden) * 8;
    const uint64_t by_token = owner_rows_by_token(plan) * row_bytes;
    if (st.total_bytes != st.owner_minimum_bytes || st.owner_minimum_bytes != by_token)
      RC_FAIL(fmt::format("total {} B, owner_minimum {} B, token-by-token count {} B [{}]",
                          st.total_bytes, st.owner_minimum_bytes, by_token, describe(c)));
  }
  RC_TAG(ep::mode_name(ep::select_feature_exchange(c.cfg.decoder.context(0, 0))));
}

RC_GTEST_PROP(EncoderParallel, ZeroRowRanksTakePartInBackward, ()) {
  // One sample with a single tiny image (1..3 tokens) or none at all: most
  // ranks produce and receive nothing, yet every rank must enter every
  // forward and backward collective.
  StepCase c;
  c.cfg = gen_config(2, 4, 4);
  c.world_seed = *rc::gen::arbitrary<uint64_t>();
  const int64_t multiple = ep::required_seq_multiple(c.cfg.decoder);
  for (int d = 0; d < c.cfg.dp; ++d) {
    ep::Batch b;
    ep::Sample s;
    if (uniform(0, 3) != 0) {
      ep::ImageSpan span;
      span.tokens = uniform<int64_t>(1, 3);
      span.patches = 4 * span.tokens;
      span.token_start = uniform<int64_t>(0, 2 * multiple - 1);
      s.images.push_back(span);
      s.seq_len = span.token_start + span.tokens;
    } else {
      s.seq_len = uniform<int64_t>(0, 2 * multiple - 1);
    }
    s.seq_len = (s.seq_len + multiple - 1) / multiple * multiple;
    b.samples.push_back(std::move(s));
    c.per_dp.push_back(std::move(b));
  }
  RC_LOG() << describe(c) << "\n";
  const auto ranks = run_world(c);  // a Deadlock would fail here
  int zero_rows = 0;
  for (const auto& r : ranks) zero_rows += r.routed_rows.size(0) == 0 ? 1 : 0;
  RC_CLASSIFY(zero_rows > 0, "some rank received no rows");
  const auto ref = ep::reference_step(c.cfg, c.per_dp);
  check_reference(c, ranks, ref);
  check_plan_and_routing(c, ranks, ref);
  // A rank that received no rows still got the complete encoder gradient
  // (it took part in backward and in the final all-reduce).
  for (const auto& r : ranks)
    if (r.encoder_grad.to_vector() != ranks.front().encoder_grad.to_vector())
      RC_FAIL(
          fmt::format("rank {} ended with a different encoder gradient [{}]", r.rank, describe(c)));
}

// ---------------------------------------------------------------- validate

/// Whether `msg` names item `id` as "item <id>" (not "item <id>0").
bool names_item(const std::string& msg, int64_t id) {
  const std::string want = fmt::format("item {}", id);
  for (auto at = msg.find(want); at != std::string::npos; at = msg.find(want, at + 1)) {
    const auto end = at + want.size();
    if (end == msg.size() || !std::isdigit(static_cast<unsigned char>(msg[end]))) return true;
  }
  return false;
}

enum class Corruption { Overlap, DropOwner, ItemId, DestinationRange, SpanPastEnd };

const char* corruption_name(Corruption c) {
  switch (c) {
    case Corruption::Overlap: return "overlapping span";
    case Corruption::DropOwner: return "owner left out of destinations";
    case Corruption::ItemId: return "bad item_id";
    case Corruption::DestinationRange: return "destination out of range";
    case Corruption::SpanPastEnd: return "span past the sample's end";
  }
  return "?";
}

/// Moves an item j to a start where it overlaps another item k of its
/// sample (still inside the sample). Returns false when no sample has two
/// items.
bool make_overlap(ep::ExchangePlan& plan, int64_t* j) {
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (j, k), same sample
  for (const auto& a : plan.items)
    for (const auto& b : plan.items)
      if (a.item_id != b.item_id && a.batch_index == b.batch_index)
        pairs.push_back({a.item_id, b.item_id});
  if (pairs.empty()) return false;
  const auto [jj, k] = *rc::gen::elementOf(pairs);
  auto& it = plan.items[static_cast<std::size_t>(jj)];
  const auto& other = plan.items[static_cast<std::size_t>(k)];
  const int64_t len = plan.seq_lens[static_cast<std::size_t>(it.batch_index)];
  // Both have >= 1 row; any start in [lo, hi] overlaps `other` and fits.
  const int64_t lo = std::max<int64_t>(0, other.decoder_token_start - it.output_rows + 1);
  const int64_t hi =
      std::min(other.decoder_token_start + other.output_rows - 1, len - it.output_rows);
  it.decoder_token_start = uniform(lo, hi);
  *j = jj;
  return true;
}

/// Applies `kind` to a plan with at least one item; returns the corrupted
/// item and the text the refusal must contain besides naming it.
std::pair<int64_t, std::string> corrupt(ep::ExchangePlan& plan, Corruption kind) {
  const auto n = static_cast<int64_t>(plan.items.size());
  const int64_t j = uniform<int64_t>(0, n - 1);
  auto& it = plan.items[static_cast<std::size_t>(j)];
  auto& dst = plan.destinations[static_cast<std::size_t>(j)];
  const int64_t len = plan.seq_lens[static_cast<std::size_t>(it.batch_index)];
  switch (kind) {
    case Corruption::Overlap: {
      int64_t moved = -1;
      make_overlap(plan, &moved);  // the caller checked that it is possible
      return {moved, "overlap"};
    }
    case Corruption::DropOwner: {
      // plan_exchange's destinations are exactly the owners; >= 1 per item.
      const auto k = uniform<std::size_t>(0, dst.size() - 1);
      const int r = dst[k];
      dst.erase(dst.begin() + static_cast<std::ptrdiff_t>(k));
      return {j, fmt::format("leaves out exchange rank {},", r)};
    }
    case Corruption::ItemId:
      it.item_id = *rc::gen::distinctFrom(rc::gen::inRange<int64_t>(-3, n + 3), j);
      return {j, fmt::format("items[{}].item_id is {}", j, it.item_id)};
    case Corruption::DestinationRange:
      if (coin()) {
        dst.insert(dst.begin(), -uniform(1, 3));
        return {j, fmt::format("destination {} outside", dst.front())};
      }
      dst.push_back(plan.exchange_size + uniform(0, 3));
      return {j, fmt::format("destination {} outside", dst.back())};
    case Corruption::SpanPastEnd:
      if (coin())
        it.output_rows = len - it.decoder_token_start + uniform<int64_t>(1, 3);
      else
        it.decoder_token_start = len - it.output_rows + uniform<int64_t>(1, 3);
      return {j, "outside sample"};
  }
  return {j, ""};
}

RC_GTEST_PROP(EncoderParallel, ValidateRefusesEveryCorruptedPlanNamingTheItem, ()) {
  // A random valid plan (the meshes and batches above) validates; after one
  // random corruption validate() throws InvalidArgument naming the item
  // ("item <id>", or "items[<i>]" for a wrong id) and what is wrong.
  const ep::StepConfig cfg = gen_config(1, 4, 4);
  const int64_t divisor = *rc::gen::element<int64_t>(1, 4, 32);
  const ep::Batch batch = gen_batch(cfg.decoder, 3, 3, divisor);
  ep::ExchangePlan plan = ep::plan_exchange(batch, cfg.decoder, cfg.encoder);
  const std::string where =
      fmt::format("cp={} tp={} sp={} layout={} buckets={} encoder_cp={} |{}", cfg.decoder.cp,
                  cfg.decoder.tp, cfg.decoder.sp, ep::cp_layout_name(cfg.decoder.layout),
                  cfg.encoder.buckets, cfg.encoder.encoder_cp, describe_batch(batch));
  try {
    plan.validate();
  } catch (const InvalidArgument& e) {
    RC_FAIL(fmt::format("plan_exchange's plan does not validate: {} [{}]", e.what(), where));
  }
  if (plan.items.empty()) {
    RC_TAG("no items: nothing to corrupt");
    return;
  }
  std::vector<Corruption> kinds{Corruption::DropOwner, Corruption::ItemId,
                                Corruption::DestinationRange, Corruption::SpanPastEnd};
  std::vector<int> per_sample(plan.seq_lens.size(), 0);
  bool two_in_a_sample = false;  // an overlap needs two items in one sample
  for (const auto& it : plan.items)
    two_in_a_sample |= ++per_sample[static_cast<std::size_t>(it.batch_index)] == 2;
  if (two_in_a_sample) kinds.push_back(Corruption::Overlap);
  const Corruption kind = *rc::gen::elementOf(kinds);
  RC_TAG(corruption_name(kind));
  const auto [item, text] = corrupt(plan, kind);
  std::string msg;
  try {
    plan.validate();
  } catch (const InvalidArgument& e) {
    msg = e.what();
  }
  const std::string named =
      kind == Corruption::ItemId ? fmt::format("items[{}]", item) : fmt::format("item {}", item);
  if (msg.empty() || msg.find(text) == std::string::npos ||
      (kind != Corruption::ItemId && !names_item(msg, item)))
    RC_FAIL(
        fmt::format("{} of item {}: validate() {}; want InvalidArgument naming {} and '{}' [{}]",
                    corruption_name(kind), item, msg.empty() ? "accepted the plan" : "said: " + msg,
                    named, text, where));
}

RC_GTEST_PROP(EncoderParallel, UnpackOrdersByBatchStartItemId, ()) {
  // Random received items in a random transport order: unique ids, batch
  // indices and starts from small ranges (ties in (batch, start) included),
  // 0..3 rows each.
  const int n = uniform(0, 8);
  const int64_t hidden = uniform<int64_t>(1, 3);
  std::vector<int64_t> ids(static_cast<std::size_t>(n));
  for (int k = 0; k < n; ++k) ids[static_cast<std::size_t>(k)] = 3 * k + uniform<int64_t>(0, 2);
  const auto keys =
      *rc::gen::container<std::vector<int>>(static_cast<std::size_t>(n), rc::gen::inRange(0, 100));
  std::vector<std::size_t> order(static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
  std::vector<ep::EncoderWorkItem> items;
  int64_t total = 0;
  for (std::size_t k : order) {
    ep::EncoderWorkItem it;
    it.item_id = ids[k];
    it.batch_index = uniform<int64_t>(0, 2);
    it.decoder_token_start = uniform<int64_t>(0, 3);
    it.output_rows = uniform<int64_t>(0, 3);
    it.input_rows = 4 * it.output_rows;
    total += it.output_rows;
    items.push_back(it);
  }
  // Transport row j holds j + c/10 in column c.
  std::vector<double> v;
  for (int64_t j = 0; j < total; ++j)
    for (int64_t col = 0; col < hidden; ++col)
      v.push_back(static_cast<double>(j) + static_cast<double>(col) / 10.0);
  Tensor rows = from_vector(v, {total, hidden}, DType::Float64);
  rows.set_requires_grad(true);
  const auto recs = ep::unpack_records(rows, items);
  RC_ASSERT(recs.size() == items.size());
  // Sorted by (batch_index, decoder_token_start, item_id), strictly (ids unique).
  for (std::size_t k = 1; k < recs.size(); ++k) {
    const auto& a = recs[k - 1].item;
    const auto& b = recs[k].item;
    RC_ASSERT(std::tie(a.batch_index, a.decoder_token_start, a.item_id) <
              std::tie(b.batch_index, b.decoder_token_start, b.item_id));
  }
  // Each record is its item with its own transport rows.
  std::vector<int64_t> first_row(items.size());
  int64_t at = 0;
  for (std::size_t k = 0; k < items.size(); ++k) {
    first_row[k] = at;
    at += items[k].output_rows;
  }
  Tensor loss = scale(sum(rows), 0.0);
  for (std::size_t k = 0; k < recs.size(); ++k) {
    const auto pos = static_cast<std::size_t>(std::find(items.begin(), items.end(), recs[k].item) -
                                              items.begin());
    RC_ASSERT(pos < items.size());
    const auto want =
        std::vector<double>(v.begin() + first_row[pos] * hidden,
                            v.begin() + (first_row[pos] + items[pos].output_rows) * hidden);
    RC_ASSERT(recs[k].rows.to_vector() == want);
    loss = add(loss, scale(sum(recs[k].rows), static_cast<double>(recs[k].item.item_id + 1)));
  }
  // Differentiable: d loss / d rows = item_id + 1 on each item's rows.
  const auto g = grad({loss}, {rows})[0].to_vector();
  for (std::size_t k = 0; k < items.size(); ++k)
    for (int64_t j = first_row[k]; j < first_row[k] + items[k].output_rows; ++j)
      for (int64_t col = 0; col < hidden; ++col)
        RC_ASSERT(g[static_cast<std::size_t>(j * hidden + col)] ==
                  static_cast<double>(items[k].item_id + 1));
  // A row count that disagrees with the items is refused with both counts.
  bool refused = false;
  try {
    ep::unpack_records(zeros({total + 1, hidden}, DType::Float64), items);
  } catch (const InvalidArgument& e) {
    refused = std::string(e.what()).find(std::to_string(total + 1)) != std::string::npos &&
              std::string(e.what()).find(std::to_string(total)) != std::string::npos;
  }
  RC_ASSERT(refused);
}

}  // namespace
}  // namespace diffcomm
