#include "diffcomm/encoder_parallel/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::encoder_parallel {
namespace {
constexpr int64_t kMaxExchangeSize = int64_t{1} << 24;

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

std::string span_text(const EncoderWorkItem& it) {
  return fmt::format("[{}, {})", it.decoder_token_start, it.decoder_token_start + it.output_rows);
}

// Two items that write the same tokens: the merge keeps one record's rows and
// the other still gets gradient for rows that never reach the loss. Sorted by
// start, any overlap shows up between neighbours; zero-row items write
// nothing and are skipped.
void check_no_overlap(const ExchangePlan& plan, int64_t sample, std::vector<int64_t> ids) {
  const auto& items = plan.items;
  std::erase_if(ids,
                [&](int64_t id) { return items[static_cast<std::size_t>(id)].output_rows == 0; });
  std::sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) {
    return std::pair(items[static_cast<std::size_t>(a)].decoder_token_start, a) <
           std::pair(items[static_cast<std::size_t>(b)].decoder_token_start, b);
  });
  for (std::size_t k = 1; k < ids.size(); ++k) {
    const EncoderWorkItem& prev = items[static_cast<std::size_t>(ids[k - 1])];
    const EncoderWorkItem& next = items[static_cast<std::size_t>(ids[k])];
    if (next.decoder_token_start < prev.decoder_token_start + prev.output_rows)
      raise(
          "ExchangePlan",
          fmt::format(
              "item {} (tokens {}) and item {} (tokens {}) of sample {} overlap; an image's tokens "
              "must belong to one item",
              prev.item_id, span_text(prev), next.item_id, span_text(next), sample));
  }
}

// Every owner of an item's tokens must receive it, or its rows in the decoder
// input silently keep their text embedding. owned[r]: rank r's ranges in this
// sample, computed once per sample.
void check_owners_reached(const ExchangePlan& plan, int64_t sample, const std::vector<int64_t>& ids,
                          const std::vector<Ranges>& owned) {
  for (int64_t id : ids) {
    const EncoderWorkItem& it = plan.items[static_cast<std::size_t>(id)];
    const auto& dst = plan.destinations[static_cast<std::size_t>(id)];
    const int64_t lo = it.decoder_token_start, hi = lo + it.output_rows;
    for (int r = 0; r < plan.exchange_size; ++r) {
      std::vector<std::string> mine;
      for (const auto& [b, e] : owned[static_cast<std::size_t>(r)])
        if (std::max(lo, b) < std::min(hi, e))
          mine.push_back(fmt::format("[{}, {})", std::max(lo, b), std::min(hi, e)));
      if (!mine.empty() && !std::binary_search(dst.begin(), dst.end(), r))
        raise(
            "ExchangePlan",
            fmt::format(
                "item {} (sample {}, tokens {}) has destinations [{}] but leaves out exchange rank "
                "{}, which owns tokens {} of it",
                id, sample, span_text(it), fmt::join(dst, ","), r, fmt::join(mine, " ")));
    }
  }
}

// The checks across items of one sample: no overlapping spans, every owner
// among the destinations. Items are grouped by sample so that each rank's
// owned ranges are computed once per sample, not once per item.
void check_samples(const ExchangePlan& plan) {
  std::vector<std::vector<int64_t>> by_sample(plan.seq_lens.size());
  for (const auto& it : plan.items)
    by_sample[static_cast<std::size_t>(it.batch_index)].push_back(it.item_id);
  std::vector<Ranges> owned(static_cast<std::size_t>(plan.exchange_size));
  for (std::size_t b = 0; b < by_sample.size(); ++b) {
    if (by_sample[b].empty()) continue;
    const auto sample = static_cast<int64_t>(b);
    check_no_overlap(plan, sample, by_sample[b]);
    for (int r = 0; r < plan.exchange_size; ++r)
      owned[static_cast<std::size_t>(r)] = plan.owned(sample, r);
    check_owners_reached(plan, sample, by_sample[b], owned);
  }
}
}  // namespace

std::string cp_layout_name(CpLayout layout) {
  return layout == CpLayout::Contiguous ? "contiguous" : "zigzag";
}

int64_t required_seq_multiple(const DecoderMesh& mesh) {
  int64_t m = mesh.layout == CpLayout::Zigzag ? 2 * mesh.cp : mesh.cp;
  if (mesh.sp) m *= mesh.tp;
  return m;
}

std::vector<std::pair<int64_t, int64_t>> owned_ranges(int64_t seq_len, const DecoderMesh& mesh,
                                                      int cp_rank, int tp_rank) {
  if (mesh.cp < 1 || mesh.tp < 1 || cp_rank < 0 || cp_rank >= mesh.cp || tp_rank < 0 ||
      tp_rank >= mesh.tp)
    raise("owned_ranges", fmt::format("rank (cp {}, tp {}) outside mesh cp {} tp {}", cp_rank,
                                      tp_rank, mesh.cp, mesh.tp));
  if (seq_len < 0) raise("owned_ranges", fmt::format("sequence length {} is negative", seq_len));
  const int64_t cp = mesh.cp;
  std::vector<std::pair<int64_t, int64_t>> local;
  if (mesh.layout == CpLayout::Contiguous) {
    if (seq_len % cp != 0)
      raise(
          "owned_ranges",
          fmt::format("sequence length {} is not divisible by cp {} (contiguous CP)", seq_len, cp));
    const int64_t per = seq_len / cp;
    local.push_back({cp_rank * per, (cp_rank + 1) * per});
  } else {
    if (seq_len % (2 * cp) != 0)
      raise("owned_ranges",
            fmt::format("sequence length {} is not divisible by 2*cp = {} (zigzag CP)", seq_len,
                        2 * cp));
    const int64_t chunk = seq_len / (2 * cp);
    local.push_back({cp_rank * chunk, (cp_rank + 1) * chunk});
    local.push_back({(2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk});
  }
  if (!mesh.sp || mesh.tp == 1) return local;
  // Zigzag with SP: 2*cp*tp (required_seq_multiple). Splitting a CP rank's
  // two chunks over tp would also work for some shorter lengths (S = 6 on
  // cp 3, tp 2), but the contract, the batch builders and Megatron's rule
  // are 2*cp*tp; one rule, checked here.
  if (mesh.layout == CpLayout::Zigzag && seq_len % required_seq_multiple(mesh) != 0)
    raise("owned_ranges",
          fmt::format("sequence length {} is not divisible by 2*cp*tp = {} (zigzag CP with SP)",
                      seq_len, required_seq_multiple(mesh)));
  int64_t local_len = 0;
  for (auto& r : local) local_len += r.second - r.first;
  if (local_len % mesh.tp != 0)
    raise("owned_ranges",
          fmt::format("a CP rank's {} tokens (sequence length {}) are not divisible by tp {} (SP)",
                      local_len, seq_len, mesh.tp));
  const int64_t part = local_len / mesh.tp;
  // Walk the local sequence and keep positions [t*part, (t+1)*part).
  const int64_t want_begin = tp_rank * part, want_end = want_begin + part;
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t pos = 0;
  for (auto& [b, e] : local) {
    const int64_t len = e - b;
    const int64_t lo = std::max(pos, want_begin), hi = std::min(pos + len, want_end);
    if (lo < hi) out.push_back({b + (lo - pos), b + (hi - pos)});
    pos += len;
  }
  return out;
}

std::pair<int, int> ExchangePlan::coordinates(int exchange_rank) const {
  if (exchange_rank < 0 || exchange_rank >= exchange_size)
    raise("ExchangePlan",
          fmt::format("exchange rank {} outside [0, {})", exchange_rank, exchange_size));
  if (mode == FeatureExchangeMode::ParentVariableA2A)
    return {exchange_rank / decoder.tp, exchange_rank % decoder.tp};
  return {0, exchange_rank};
}

std::vector<std::pair<int64_t, int64_t>> ExchangePlan::owned(int64_t batch_index,
                                                             int exchange_rank) const {
  if (batch_index < 0 || batch_index >= static_cast<int64_t>(seq_lens.size()))
    raise("ExchangePlan",
          fmt::format("sample {} outside the batch of {}", batch_index, seq_lens.size()));
  const auto [c, t] = coordinates(exchange_rank);
  return owned_ranges(seq_lens[static_cast<std::size_t>(batch_index)], decoder, c, t);
}

namespace {

// The exchange group's size against the encoder layout (buckets x encoder_cp
// ranks fill it exactly).
void plan_sizes(ExchangePlan& plan, const DecoderMesh& decoder, const EncoderLayout& encoder) {
  const int64_t exchange_size = decoder.exchange_size();
  if (exchange_size > kMaxExchangeSize)
    raise("plan_exchange", fmt::format("an exchange group of {} ranks (cp {} x tp "
                                       "{}) is larger than {}",
                                       exchange_size, decoder.cp, decoder.tp, kMaxExchangeSize));
  plan.exchange_size = static_cast<int>(exchange_size);
  if (encoder.buckets < 1 || encoder.encoder_cp < 1)
    raise("plan_exchange", fmt::format("buckets {} and encoder_cp {} must be >= 1", encoder.buckets,
                                       encoder.encoder_cp));
  if (int64_t{encoder.buckets} * encoder.encoder_cp != plan.exchange_size)
    raise("plan_exchange",
          fmt::format("buckets x encoder_cp = {} x {} = {} but the {} exchange group has {} "
                      "ranks (cp {} x tp {})",
                      encoder.buckets, encoder.encoder_cp,
                      int64_t{encoder.buckets} * encoder.encoder_cp, mode_name(plan.mode),
                      plan.exchange_size, decoder.cp, decoder.tp));
}

// One item per image, its span validated against its sample, and every
// sample's length checked against the mesh (owned_ranges refuses).
void plan_items(ExchangePlan& plan, const Batch& batch, const DecoderMesh& decoder) {
  for (std::size_t b = 0; b < batch.samples.size(); ++b) {
    const Sample& s = batch.samples[b];
    if (s.seq_len < 0) raise("plan_exchange", fmt::format("sample {} has negative length", b));
    plan.seq_lens.push_back(s.seq_len);
    for (int r = 0; r < plan.exchange_size; ++r)
      owned_ranges(s.seq_len, decoder, plan.coordinates(r).first, plan.coordinates(r).second);
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const ImageSpan& im : s.images) {
      if (im.token_start < 0 || im.tokens < 0 || im.patches < 0 || im.token_start > s.seq_len ||
          im.tokens > s.seq_len - im.token_start)
        raise("plan_exchange",
              fmt::format("sample {} image at tokens [{}, {}) (patches {}) is outside the "
                          "sequence of {} tokens",
                          b, im.token_start, im.token_start + im.tokens, im.patches, s.seq_len));
      spans.push_back({im.token_start, im.token_start + im.tokens});
      EncoderWorkItem item;
      item.item_id = static_cast<int64_t>(plan.items.size());
      item.batch_index = static_cast<int64_t>(b);
      item.decoder_token_start = im.token_start;
      item.input_rows = im.patches;
      item.output_rows = im.tokens;
      plan.items.push_back(item);
    }
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second)
        raise("plan_exchange", fmt::format("sample {} has overlapping images at "
                                           "tokens [{}, {}) and [{}, {})",
                                           b, spans[i - 1].first, spans[i - 1].second,
                                           spans[i].first, spans[i].second));
  }
}

// Buckets: longest processing time first, each item to the least-loaded
// bucket (by input rows); a bucket's items in id order.
void plan_buckets(ExchangePlan& plan, const EncoderLayout& encoder) {
  std::vector<int64_t> order(plan.items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return plan.items[static_cast<std::size_t>(a)].input_rows >
           plan.items[static_cast<std::size_t>(b)].input_rows;
  });
  std::vector<int64_t> load(static_cast<std::size_t>(encoder.buckets), 0);
  plan.buckets.assign(static_cast<std::size_t>(encoder.buckets), {});
  plan.bucket_of.assign(plan.items.size(), 0);
  for (int64_t id : order) {
    const auto b =
        static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[b] += plan.items[static_cast<std::size_t>(id)].input_rows;
    plan.buckets[b].push_back(id);
    plan.bucket_of[static_cast<std::size_t>(id)] = static_cast<int>(b);
  }
  for (auto& bucket : plan.buckets) std::sort(bucket.begin(), bucket.end());
}

// Destinations: the exchange ranks whose tokens intersect the span.
// Owned ranges once per (sample, rank), not per item: a long Qwen3-VL video
// is tens of thousands of items of one sample.
void plan_destinations(ExchangePlan& plan) {
  plan.destinations.assign(plan.items.size(), {});
  std::vector<Ranges> owned(static_cast<std::size_t>(plan.exchange_size));
  int64_t owned_sample = -1;
  for (const auto& item : plan.items) {
    if (item.batch_index != owned_sample) {
      owned_sample = item.batch_index;
      for (int r = 0; r < plan.exchange_size; ++r)
        owned[static_cast<std::size_t>(r)] = plan.owned(owned_sample, r);
    }
    const int64_t lo = item.decoder_token_start, hi = lo + item.output_rows;  // <= seq_len
    for (int r = 0; r < plan.exchange_size; ++r)
      for (const auto& [b, e] : owned[static_cast<std::size_t>(r)])
        if (std::max(lo, b) < std::min(hi, e)) {
          plan.destinations[static_cast<std::size_t>(item.item_id)].push_back(r);
          break;
        }
  }
}

}  // namespace

ExchangePlan plan_exchange(const Batch& batch, const DecoderMesh& decoder,
                           const EncoderLayout& encoder) {
  ExchangePlan plan;
  plan.decoder = decoder;
  plan.encoder = encoder;
  plan.mode = select_feature_exchange(decoder.context(0, 0));
  plan_sizes(plan, decoder, encoder);
  plan_items(plan, batch, decoder);
  plan_buckets(plan, encoder);
  plan_destinations(plan);
  return plan;
}

void ExchangePlan::validate() const {
  if (decoder.cp < 1 || decoder.tp < 1)
    raise("ExchangePlan",
          fmt::format("decoder cp {} and tp {} must be >= 1", decoder.cp, decoder.tp));
  if (decoder.layout != CpLayout::Contiguous && decoder.layout != CpLayout::Zigzag)
    raise("ExchangePlan",
          fmt::format("decoder layout {} is not a CpLayout", static_cast<int>(decoder.layout)));
  const FeatureExchangeMode want = select_feature_exchange(decoder.context(0, 0));
  if (mode != want)
    raise("ExchangePlan",
          fmt::format("mode {} but the decoder mesh (cp {}, tp {}, sp {}) needs {}",
                      mode_name(mode), decoder.cp, decoder.tp, decoder.sp, mode_name(want)));
  const int64_t group = decoder.exchange_size();  // mode == want: the mode's group
  if (group > kMaxExchangeSize)
    raise("ExchangePlan",
          fmt::format("an exchange group of {} ranks is larger than {}", group, kMaxExchangeSize));
  if (exchange_size != group)
    raise("ExchangePlan", fmt::format("exchange_size {} but the {} exchange group has {} ranks",
                                      exchange_size, mode_name(mode), group));
  if (encoder.buckets < 1 || encoder.encoder_cp < 1 ||
      int64_t{encoder.buckets} * encoder.encoder_cp != exchange_size)
    raise("ExchangePlan", fmt::format("buckets x encoder_cp = {} x {} must be >= 1 each and equal "
                                      "exchange_size {}",
                                      encoder.buckets, encoder.encoder_cp, exchange_size));
  for (std::size_t b = 0; b < seq_lens.size(); ++b) {
    if (seq_lens[b] < 0)
      raise("ExchangePlan", fmt::format("seq_lens[{}] = {} is negative", b, seq_lens[b]));
    try {
      for (int r = 0; r < exchange_size; ++r)
        owned_ranges(seq_lens[b], decoder, coordinates(r).first, coordinates(r).second);
    } catch (const InvalidArgument& e) {
      raise("ExchangePlan", fmt::format("seq_lens[{}]: {}", b, e.what()));
    }
  }
  const std::size_t n = items.size();
  for (std::size_t i = 0; i < n; ++i) {
    const EncoderWorkItem& it = items[i];
    if (it.item_id != static_cast<int64_t>(i))
      raise("ExchangePlan",
            fmt::format("items[{}].item_id is {}; plans are keyed by position, so item ids "
                        "must be 0..{} in order",
                        i, it.item_id, n - 1));
    if (it.batch_index < 0 || it.batch_index >= static_cast<int64_t>(seq_lens.size()))
      raise("ExchangePlan",
            fmt::format("item {} has batch_index {} outside the {} sample(s) of seq_lens", i,
                        it.batch_index, seq_lens.size()));
    const int64_t len = seq_lens[static_cast<std::size_t>(it.batch_index)];
    if (it.input_rows < 0 || it.output_rows < 0)
      raise("ExchangePlan", fmt::format("item {} has input_rows {} and output_rows {} (need >= 0)",
                                        i, it.input_rows, it.output_rows));
    if (it.decoder_token_start < 0 || it.decoder_token_start > len ||
        it.output_rows > len - it.decoder_token_start)
      raise("ExchangePlan",
            fmt::format("item {} spans tokens [{}, {} + {}) outside sample {} of {} tokens", i,
                        it.decoder_token_start, it.decoder_token_start, it.output_rows,
                        it.batch_index, len));
  }
  if (buckets.size() != static_cast<std::size_t>(encoder.buckets))
    raise("ExchangePlan",
          fmt::format("{} bucket lists for encoder.buckets = {}", buckets.size(), encoder.buckets));
  if (bucket_of.size() != n)
    raise("ExchangePlan",
          fmt::format("bucket_of has {} entries for {} items", bucket_of.size(), n));
  std::vector<int> seen(n, 0);
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    int64_t rows = 0;
    for (int64_t id : buckets[b]) {
      if (id < 0 || id >= static_cast<int64_t>(n))
        raise("ExchangePlan", fmt::format("bucket {} lists item {} outside [0, {})", b, id, n));
      const auto k = static_cast<std::size_t>(id);
      if (seen[k]++)
        raise("ExchangePlan", fmt::format("item {} appears more than once in the buckets", id));
      if (bucket_of[k] != static_cast<int>(b))
        raise("ExchangePlan", fmt::format("item {} is in bucket {} but bucket_of[{}] = {}", id, b,
                                          id, bucket_of[k]));
      if (__builtin_add_overflow(rows, items[k].output_rows, &rows))
        raise("ExchangePlan", fmt::format("the rows of bucket {} exceed 2^63", b));
    }
  }
  for (std::size_t i = 0; i < n; ++i)
    if (!seen[i]) raise("ExchangePlan", fmt::format("item {} is in no bucket", i));
  if (destinations.size() != n)
    raise("ExchangePlan",
          fmt::format("destinations has {} lists for {} items", destinations.size(), n));
  for (std::size_t i = 0; i < n; ++i) {
    const auto& d = destinations[i];
    for (std::size_t k = 0; k < d.size(); ++k) {
      if (d[k] < 0 || d[k] >= exchange_size)
        raise("ExchangePlan",
              fmt::format("item {} has destination {} outside [0, {})", i, d[k], exchange_size));
      if (k > 0 && d[k] <= d[k - 1])
        raise("ExchangePlan",
              fmt::format("destinations of item {} are not ascending and distinct: [{}]", i,
                          fmt::join(d, ",")));
    }
  }
  check_samples(*this);
}

std::vector<std::pair<int64_t, int64_t>> ExchangePlan::owned_rows(int64_t item,
                                                                  int exchange_rank) const {
  const EncoderWorkItem& it = items[static_cast<std::size_t>(item)];
  const int64_t lo = it.decoder_token_start, hi = lo + it.output_rows;
  std::vector<std::pair<int64_t, int64_t>> rows;
  // owned() is in local order; zigzag's two chunks are ascending, and an SP
  // part of them too, so the intersections come out ascending.
  for (const auto& [b, e] : owned(it.batch_index, exchange_rank)) {
    const int64_t from = std::max(lo, b) - lo, to = std::min(hi, e) - lo;
    if (from >= to) continue;
    if (!rows.empty() && rows.back().second == from)
      rows.back().second = to;  // one piece, not two, for adjacent chunks
    else
      rows.push_back({from, to});
  }
  return rows;
}

namespace {

// The pieces of item `id` that exchange rank q gets: the whole item to every
// rank in the all-gather mode, else the rows q owns when q is a destination.
std::vector<std::pair<int64_t, int64_t>> pieces_for(const ExchangePlan& plan, int64_t id, int q) {
  const EncoderWorkItem& it = plan.items[static_cast<std::size_t>(id)];
  if (plan.mode == FeatureExchangeMode::TpVariableAllGather) return {{0, it.output_rows}};
  const std::vector<int>& d = plan.destinations[static_cast<std::size_t>(id)];
  if (!std::binary_search(d.begin(), d.end(), q)) return {};  // ascending (validate)
  return plan.owned_rows(id, q);
}

void add_pieces(Transfer& t, int64_t id, const std::vector<std::pair<int64_t, int64_t>>& pieces,
                int peer) {
  for (const auto& r : pieces) {
    t.splits[static_cast<std::size_t>(peer)] += r.second - r.first;
    t.items.push_back(id);
    t.ranges.push_back(r);
  }
}

}  // namespace

Transfer ExchangePlan::sends(int src) const {
  Transfer t;
  t.splits.assign(static_cast<std::size_t>(exchange_size), 0);
  if (src % encoder.encoder_cp != 0) return t;  // produces no bucket
  const std::vector<int64_t>& mine = buckets[static_cast<std::size_t>(src / encoder.encoder_cp)];
  for (int q = 0; q < exchange_size; ++q)
    for (int64_t id : mine) add_pieces(t, id, pieces_for(*this, id, q), q);
  return t;
}

Transfer ExchangePlan::receives(int dst) const {
  Transfer t;
  t.splits.assign(static_cast<std::size_t>(exchange_size), 0);
  for (int b = 0; b < encoder.buckets; ++b)
    for (int64_t id : buckets[static_cast<std::size_t>(b)])
      add_pieces(t, id, pieces_for(*this, id, dst), producer(b));
  return t;
}

namespace {

// Rows of every item's tokens counted once per owner other than the item's
// producer, from the owned ranges alone: the floor for any exchange. It
// deliberately does not read sends(), destinations or owned_rows, so that
// stats().total_bytes == owner_minimum_bytes checks the send path.
uint64_t owner_minimum_rows(const ExchangePlan& plan) {
  std::vector<std::vector<int64_t>> by_sample(plan.seq_lens.size());
  for (const auto& it : plan.items)
    by_sample[static_cast<std::size_t>(it.batch_index)].push_back(it.item_id);
  uint64_t rows = 0;
  std::vector<Ranges> owned(static_cast<std::size_t>(plan.exchange_size));
  for (std::size_t b = 0; b < by_sample.size(); ++b) {
    if (by_sample[b].empty()) continue;
    for (int r = 0; r < plan.exchange_size; ++r)
      owned[static_cast<std::size_t>(r)] = plan.owned(static_cast<int64_t>(b), r);
    for (int64_t id : by_sample[b]) {
      const EncoderWorkItem& it = plan.items[static_cast<std::size_t>(id)];
      const int producer = plan.producer(plan.bucket_of[static_cast<std::size_t>(id)]);
      const int64_t lo = it.decoder_token_start, hi = lo + it.output_rows;
      for (int r = 0; r < plan.exchange_size; ++r)
        for (const auto& [first, last] : owned[static_cast<std::size_t>(r)])
          if (r != producer && std::max(lo, first) < std::min(hi, last))
            rows += static_cast<uint64_t>(std::min(hi, last) - std::max(lo, first));
    }
  }
  return rows;
}

}  // namespace

PlanStats ExchangePlan::stats(int64_t hidden, DType dtype) const {
  validate();
  if (hidden < 0) raise("ExchangePlan::stats", fmt::format("hidden {} < 0", hidden));
  PlanStats st;
  const auto n = static_cast<std::size_t>(exchange_size);
  uint64_t row_bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(hidden), element_size(dtype), &row_bytes))
    raise("ExchangePlan::stats", fmt::format("hidden {} overflows a row", hidden));
  // Every byte count below is at most (n^2 + n) * total rows * row_bytes.
  uint64_t total_rows = 0, bound = 0;
  bool overflow = false;
  for (const auto& item : items)
    overflow |=
        __builtin_add_overflow(total_rows, static_cast<uint64_t>(item.output_rows), &total_rows);
  if (overflow || __builtin_mul_overflow(total_rows, row_bytes, &bound) ||
      __builtin_mul_overflow(bound, static_cast<uint64_t>(n) * (n + 1), &bound) ||
      bound > static_cast<uint64_t>(INT64_MAX))
    raise("ExchangePlan::stats", fmt::format("{} rows of {} bytes over {} ranks exceed 2^63 bytes",
                                             total_rows, row_bytes, n));
  std::map<std::pair<int, int>, int64_t> rows;  // (src, dst) -> rows, as route_features sends
  for (int b = 0; b < encoder.buckets; ++b) {
    const int src = producer(b);
    const Transfer t = sends(src);
    for (int d = 0; d < exchange_size; ++d)
      if (t.splits[static_cast<std::size_t>(d)] != 0)
        rows[{src, d}] = t.splits[static_cast<std::size_t>(d)];
  }
  st.rows_sent.assign(n, 0);
  st.rows_received.assign(n, 0);
  for (const auto& [k, r] : rows) {
    if (r == 0) continue;
    st.pairs.push_back({k.first, k.second, r, static_cast<uint64_t>(r) * row_bytes});
    if (k.first != k.second) {
      st.total_bytes += static_cast<uint64_t>(r) * row_bytes;
      st.rows_sent[static_cast<std::size_t>(k.first)] += r;
      st.rows_received[static_cast<std::size_t>(k.second)] += r;
    }
  }
  int64_t max_rows = 0;
  for (const auto& bucket : buckets) {
    int64_t r = 0, p = 0;
    for (int64_t id : bucket) {
      r += items[static_cast<std::size_t>(id)].output_rows;
      p += items[static_cast<std::size_t>(id)].input_rows;
    }
    max_rows = std::max(max_rows, r);
    st.bucket_patches.push_back(p);
  }
  st.padded_all_gather_bytes =
      static_cast<uint64_t>(n) * (n - 1) * static_cast<uint64_t>(max_rows) * row_bytes;
  st.owner_minimum_bytes = owner_minimum_rows(*this) * row_bytes;
  const double total = std::accumulate(st.bucket_patches.begin(), st.bucket_patches.end(), 0.0);
  const double mean = total / static_cast<double>(st.bucket_patches.size());
  const double mx =
      static_cast<double>(*std::max_element(st.bucket_patches.begin(), st.bucket_patches.end()));
  st.encoder_imbalance = mean > 0 ? mx / mean : 1.0;
  return st;
}

std::string ExchangePlan::fingerprint() const {
  validate();
  std::string s = fmt::format("mode={} cp={} tp={} sp={} layout={} buckets={} ecp={} n={} seq=[{}]",
                              mode_name(mode), decoder.cp, decoder.tp, decoder.sp,
                              cp_layout_name(decoder.layout), encoder.buckets, encoder.encoder_cp,
                              exchange_size, fmt::join(seq_lens, ","));
  for (const auto& it : items)
    s += fmt::format(" item{}(b{} t{} in{} out{} bucket{} dst[{}])", it.item_id, it.batch_index,
                     it.decoder_token_start, it.input_rows, it.output_rows,
                     bucket_of[static_cast<std::size_t>(it.item_id)],
                     fmt::join(destinations[static_cast<std::size_t>(it.item_id)], ","));
  return s;
}

}  // namespace diffcomm::encoder_parallel
