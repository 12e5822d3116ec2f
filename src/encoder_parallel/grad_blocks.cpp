// The encoder gradient's canonical blocks (header: grad_blocks.hpp).
#include "encoder_parallel/grad_blocks.hpp"

#include <algorithm>

namespace diffcomm::encoder_parallel::detail {
namespace {

// Every block of the bucket in order, with the row where it starts.
struct Placed {
  GradBlock block;
  int64_t row = 0;
};
std::vector<Placed> bucket_blocks(const ExchangePlan& plan, int bucket, int64_t block_rows) {
  std::vector<int64_t> first_block(plan.items.size() + 1, 0);  // ids: items in id order
  for (std::size_t i = 0; i < plan.items.size(); ++i)
    first_block[i + 1] = first_block[i] + blocks_of(plan.items[i].output_rows, block_rows);
  std::vector<Placed> out;
  int64_t row = 0;
  for (int64_t id : plan.buckets[static_cast<std::size_t>(bucket)]) {
    const int64_t rows = plan.items[static_cast<std::size_t>(id)].output_rows;
    for (int64_t b = 0; b * block_rows < rows; ++b) {
      const int64_t n = std::min(block_rows, rows - b * block_rows);
      out.push_back({{first_block[static_cast<std::size_t>(id)] + b, n}, row});
      row += n;
    }
  }
  return out;
}

}  // namespace

EncoderSlice encoder_slice(const ExchangePlan& plan, int bucket, int j, int encoder_cp,
                           int64_t block_rows) {
  const std::vector<Placed> all = bucket_blocks(plan, bucket, block_rows);
  const int64_t total = all.empty() ? 0 : all.back().row + all.back().block.rows;
  // The first block starting at or after rows * s / encoder_cp.
  auto first_at = [&](int s) {
    const int64_t want = total * s / encoder_cp;
    std::size_t k = 0;
    while (k < all.size() && all[k].row < want) ++k;
    return k;
  };
  const std::size_t lo = first_at(j), hi = j + 1 == encoder_cp ? all.size() : first_at(j + 1);
  EncoderSlice s;
  s.row_begin = lo < all.size() ? all[lo].row : total;
  s.row_end = hi < all.size() ? all[hi].row : total;
  for (std::size_t k = lo; k < hi; ++k) s.blocks.push_back(all[k].block);
  return s;
}

nn::ChunkIds block_table(const ExchangePlan& plan, int encoder_cp, int64_t block_rows) {
  nn::ChunkIds table;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b)
    for (int j = 0; j < encoder_cp; ++j) {
      table.emplace_back();
      for (const GradBlock& g :
           encoder_slice(plan, static_cast<int>(b), j, encoder_cp, block_rows).blocks)
        table.back().push_back(g.id);
    }
  return table;
}

}  // namespace diffcomm::encoder_parallel::detail
