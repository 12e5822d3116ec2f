#pragma once
// The encoder gradient's canonical chunks (docs/semantics.md, "The training
// step, exact"): every image's feature rows cut into blocks of `block_rows`
// rows, numbered over the micro-batch in item order. A block's partial dW is
// one matmul over its rows, and dW is canonical_sum's tree over the blocks,
// so the bits depend on the data alone, not on which encoder rank computed
// which block.
#include <cstdint>
#include <vector>

#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"

namespace diffcomm::encoder_parallel::detail {

struct GradBlock {
  int64_t id = 0;    ///< within the micro-batch
  int64_t rows = 0;  ///< 1..block_rows
};

/// Blocks of an item with `rows` feature rows: ceil(rows / block_rows).
inline int64_t blocks_of(int64_t rows, int64_t block_rows) {
  return (rows + block_rows - 1) / block_rows;
}

/// What encoder rank (bucket, j) of encoder_cp computes: the row range
/// [row_begin, row_end) of its bucket's rows (items concatenated in bucket
/// order), and the blocks in it, in order. Every encoder-CP slice holds whole
/// blocks: slice j starts at the first block boundary at or after
/// rows * j / encoder_cp.
struct EncoderSlice {
  int64_t row_begin = 0, row_end = 0;
  std::vector<GradBlock> blocks;
};
EncoderSlice encoder_slice(const ExchangePlan& plan, int bucket, int j, int encoder_cp,
                           int64_t block_rows);

/// chunk_ids for canonical_all_reduce_v over the exchange group: row e lists
/// the block ids exchange rank e (bucket e / encoder_cp, slice e % encoder_cp)
/// holds.
nn::ChunkIds block_table(const ExchangePlan& plan, int encoder_cp, int64_t block_rows);

}  // namespace diffcomm::encoder_parallel::detail
