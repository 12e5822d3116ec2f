// Fuzzes plan construction and the exchange: a small batch and decoder /
// encoder layout from the input, plan_exchange, then (optionally) one field
// of the plan overwritten as a hand-built plan would, then route_features +
// unpack_records on a simulated world of the exchange group's size. Every
// failure must be a diffcomm::Error (InvalidArgument for a bad plan), and a
// successful run must deliver exactly the plan's rows to every rank.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "fuzz_input.hpp"

namespace ep = diffcomm::encoder_parallel;
using diffcomm::DType;
using diffcomm::Tensor;

namespace {

void corrupt(ep::ExchangePlan& p, diffcomm::fuzz::Input& in) {
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(in.range(0, n - 1)); };
  switch (in.range(0, 9)) {
    case 0:
      if (!p.items.empty()) p.items[pick(p.items.size())].item_id = in.range(-2, 200);
      break;
    case 1:
      if (!p.items.empty()) p.items[pick(p.items.size())].output_rows = in.any();
      break;
    case 2:
      if (!p.items.empty()) p.items[pick(p.items.size())].decoder_token_start = in.any();
      break;
    case 3:
      if (!p.items.empty()) p.items[pick(p.items.size())].batch_index = in.range(-2, 5);
      break;
    case 4:
      if (!p.destinations.empty())
        p.destinations[pick(p.destinations.size())].push_back(static_cast<int>(in.range(-2, 9)));
      break;
    case 5:
      if (!p.buckets.empty()) p.buckets[pick(p.buckets.size())].push_back(in.range(-2, 20));
      break;
    case 6:
      if (!p.bucket_of.empty()) p.bucket_of[pick(p.bucket_of.size())] = in.range(-2, 9);
      break;
    case 7: p.exchange_size = static_cast<int>(in.range(-2, 9)); break;
    case 8: p.encoder.encoder_cp = static_cast<int>(in.range(-2, 5)); break;
    default:
      if (!p.seq_lens.empty()) p.seq_lens[pick(p.seq_lens.size())] = in.range(-2, 100);
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  diffcomm::fuzz::Input in(data, size);
  ep::DecoderMesh mesh;
  mesh.cp = static_cast<int>(in.range(1, 2));
  mesh.tp = static_cast<int>(in.range(1, 2));
  mesh.sp = in.flag();
  mesh.layout = in.flag() ? ep::CpLayout::Zigzag : ep::CpLayout::Contiguous;
  const int exchange = mesh.cp > 1 ? mesh.cp * mesh.tp : mesh.tp;
  ep::EncoderLayout enc;
  enc.encoder_cp = static_cast<int>(in.range(1, exchange));
  enc.buckets = exchange / enc.encoder_cp;
  if (in.flag()) enc.buckets = static_cast<int>(in.range(0, 4));
  ep::Batch batch;
  const auto samples = in.range(0, 3);
  for (int64_t s = 0; s < samples; ++s) {
    ep::Sample smp;
    smp.seq_len = in.range(0, 48);
    for (auto k = in.range(0, 3); k > 0; --k) {
      ep::ImageSpan im;
      im.token_start = in.range(0, 48);
      im.tokens = in.range(0, 16);
      im.patches = 4 * im.tokens;
      smp.images.push_back(im);
    }
    batch.samples.push_back(smp);
  }
  ep::ExchangePlan plan;
  try {
    plan = ep::plan_exchange(batch, mesh, enc);
  } catch (const diffcomm::InvalidArgument&) {
    return 0;
  }
  plan.validate();  // a plan_exchange result is valid by construction
  const bool corrupted = in.flag();
  if (corrupted) corrupt(plan, in);
  try {
    plan.validate();
  } catch (const diffcomm::InvalidArgument&) {
    if (!corrupted) std::abort();
  }
  constexpr int64_t kHidden = 2;
  diffcomm::sim::WorldOptions o;
  o.ranks = exchange;
  o.seed = static_cast<uint64_t>(in.range(0, 1000));
  diffcomm::sim::World world(o);
  std::vector<int64_t> received(static_cast<std::size_t>(exchange), -1);
  try {
    world.run([&](diffcomm::sim::Rank& rk) {
      const int q = rk.rank();
      std::vector<ep::EncoderFeature> mine;
      const int ecp = std::max(1, plan.encoder.encoder_cp);
      if (q % ecp == 0 && q / ecp < static_cast<int>(plan.buckets.size()))
        for (int64_t id : plan.buckets[static_cast<std::size_t>(q / ecp)])
          if (id >= 0 && id < static_cast<int64_t>(plan.items.size())) {
            const auto& it = plan.items[static_cast<std::size_t>(id)];
            if (it.output_rows < 0 || it.output_rows > 64) continue;
            mine.push_back(
                {it, diffcomm::full({it.output_rows, kHidden}, id + 1.0, DType::Float64)});
          }
      const Tensor proto = diffcomm::zeros({0, kHidden}, DType::Float64);
      const auto routed = ep::route_features(plan.mode, mine, proto, q, plan, rk.world(),
                                             ep::ReceiverGrad::Partial);
      const auto records = ep::unpack_records(routed.rows, routed.items);
      int64_t rows = 0;
      for (const auto& r : records) {
        rows += r.rows.size(0);
        for (double v : r.rows.to_vector())
          if (v != static_cast<double>(r.item.item_id + 1)) std::abort();
      }
      received[static_cast<std::size_t>(q)] = rows;
    });
  } catch (const diffcomm::Error&) {
    return 0;
  }
  // Success: the plan was valid and each rank got the rows the plan sends it.
  plan.validate();
  // Every item whole in the all-gather and local modes; in the A2A modes
  // (row-level routing) a destination gets the rows of the tokens it owns.
  for (int q = 0; q < exchange; ++q) {
    int64_t want = 0;
    for (std::size_t i = 0; i < plan.items.size(); ++i) {
      const auto& it = plan.items[i];
      const auto& d = plan.destinations[i];
      if (plan.mode == ep::FeatureExchangeMode::TpVariableAllGather ||
          plan.mode == ep::FeatureExchangeMode::Local) {
        want += it.output_rows;
        continue;
      }
      if (std::find(d.begin(), d.end(), q) == d.end()) continue;
      const int64_t lo = it.decoder_token_start, hi = lo + it.output_rows;
      for (const auto& [b, e] : plan.owned(it.batch_index, q))
        want += std::max<int64_t>(0, std::min(hi, e) - std::max(lo, b));
    }
    if (received[static_cast<std::size_t>(q)] != want) std::abort();
  }
  return 0;
}
