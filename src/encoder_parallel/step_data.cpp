// The training step's synthetic data and configuration check (header:
// step_data.hpp).
#include "encoder_parallel/step_data.hpp"

#include <fmt/format.h>

#include <cmath>
#include <deque>
#include <mutex>
#include <unordered_map>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::encoder_parallel::detail {

// ------------------------------------------------------------ synthetic data
// Every rank and the reference draw the same numbers from (seed, purpose,
// indices), rounded to the step's dtype.
namespace {

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

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

Drawn Synthetic::W() const {
  return draw(mix(cfg.seed, 1), static_cast<std::size_t>(cfg.in_features * cfg.hidden),
              1.0 / std::sqrt(static_cast<double>(cfg.in_features)), cfg.dtype);
}

Drawn Synthetic::A() const {
  return draw(mix(cfg.seed, 2), static_cast<std::size_t>(cfg.hidden * cfg.ffn),
              1.0 / std::sqrt(static_cast<double>(cfg.hidden)), cfg.dtype);
}

Drawn Synthetic::patches(int d, int64_t item_id, int64_t tokens) const {
  return draw(
      mix(mix(cfg.seed, 3), static_cast<uint64_t>(d) * 1000003ull + static_cast<uint64_t>(item_id)),
      static_cast<std::size_t>(tokens * cfg.in_features), 1.0, cfg.dtype);
}

Drawn Synthetic::text(int d, int64_t b, int64_t seq_len) const {
  return draw(
      mix(mix(cfg.seed, 4), static_cast<uint64_t>(d) * 1000003ull + static_cast<uint64_t>(b)),
      static_cast<std::size_t>(seq_len * cfg.hidden), 1.0, cfg.dtype);
}

// Row t of sample b's positional table U, [hidden] values. Each row is
// its own stream: a rank draws only its shard's rows, and draws them again
// in the backward (the linear's dx_addend), where a whole sample's table, evicted
// from the memo by then, cost the 1024-rank step 17 % of its time.
std::vector<double> Synthetic::u_row(int d, int64_t b, int64_t t) const {
  return draw_fresh(
      mix(mix(mix(cfg.seed, 5), static_cast<uint64_t>(d) * 1000003ull + static_cast<uint64_t>(b)),
          static_cast<uint64_t>(t)),
      static_cast<std::size_t>(cfg.hidden), 1.0, cfg.dtype);
}

// Sample b's whole table [seq_len, hidden], row by row (the reference).
std::vector<double> Synthetic::u(int d, int64_t b, int64_t seq_len) const {
  std::vector<double> table;
  table.reserve(static_cast<std::size_t>(seq_len * cfg.hidden));
  for (int64_t t = 0; t < seq_len; ++t) {
    const std::vector<double> row = u_row(d, b, t);
    table.insert(table.end(), row.begin(), row.end());
  }
  return table;
}

void validate_step(const StepConfig& cfg, const std::vector<Batch>& per_dp) {
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

}  // namespace diffcomm::encoder_parallel::detail
