#include "diffcomm/encoder_parallel/merge.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::encoder_parallel {

ShardLayout::ShardLayout(const ExchangePlan& plan, int exchange_rank) {
  for (std::size_t b = 0; b < plan.seq_lens.size(); ++b)
    for (const auto& [lo, hi] : plan.owned(static_cast<int64_t>(b), exchange_rank)) {
      ranges_.push_back({static_cast<int64_t>(b), lo, hi, rows_});
      for (int64_t t = lo; t < hi; ++t) tokens_.push_back({static_cast<int64_t>(b), t});
      rows_ += hi - lo;
    }
}

int64_t ShardLayout::row_of(int64_t batch_index, int64_t token) const {
  for (const auto& r : ranges_)
    if (r.batch_index == batch_index && token >= r.begin && token < r.end)
      return r.first_row + (token - r.begin);
  return -1;
}

namespace {

// A contiguous run: rows [rec_row, rec_row+len) of a record land on shard
// rows [shard_row, shard_row+len).
struct Run {
  std::size_t record;
  int64_t rec_row, shard_row, len;
};

struct MergeFn : Function<MergeFn> {
  static constexpr const char* kName = "MergeIntoDecoderBackward";
  std::vector<Run> runs;
  std::vector<Shape> record_shapes;
  bool has_anchor = false;
  bool base_grad = true;  // base requires grad (else its gradient is not built)
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    Tensor out = in[0].copy_data();
    for (const Run& r : runs)
      out.row_view(r.shard_row, r.len).copy_(in[1 + r.record].row_view(r.rec_row, r.len));
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const Tensor& g = grads[0];
    Tensor gbase = base_grad ? g.copy_data() : Tensor{};
    std::vector<Tensor> out;
    out.push_back(gbase);
    for (const Shape& s : record_shapes) out.push_back(zeros(s, g.dtype(), g.device()));
    if (has_anchor) out.push_back(Tensor{});
    for (const Run& r : runs) {
      out[1 + r.record].row_view(r.rec_row, r.len).copy_(g.row_view(r.shard_row, r.len));
      if (base_grad) gbase.row_view(r.shard_row, r.len).fill_(0.0);
    }
    return out;
  }
};

}  // namespace

Tensor merge_into_decoder(const Tensor& base, const std::vector<EncoderFeature>& records,
                          const ShardLayout& layout, const Tensor& anchor) {
  if (!base.defined() || base.dim() != 2 || base.size(0) != layout.rows())
    raise("merge_into_decoder",
          fmt::format("base is {}, expected [{}, hidden]", base.str(), layout.rows()));
  MergeFn fn;
  std::vector<Tensor> inputs{base};
  // Group shard ranges by sample once.
  for (std::size_t k = 0; k < records.size(); ++k) {
    const EncoderFeature& f = records[k];
    if (!f.rows.defined() || f.rows.dim() != 2 || f.rows.size(1) != base.size(1) ||
        f.rows.dtype() != base.dtype() || f.rows.size(0) != f.item.output_rows)
      raise("merge_into_decoder",
            fmt::format("record of item {} has rows {}, expected {}[{}, {}]", f.item.item_id,
                        f.rows.str(), dtype_name(base.dtype()), f.item.output_rows, base.size(1)));
    inputs.push_back(f.rows);
    fn.record_shapes.push_back(f.rows.shape());
    const int64_t lo = f.item.decoder_token_start, hi = lo + f.item.output_rows;
    // Walk the image's tokens; consecutive owned tokens map to consecutive rows.
    int64_t t = lo;
    while (t < hi) {
      const int64_t row = layout.row_of(f.item.batch_index, t);
      if (row < 0) {
        ++t;
        continue;
      }
      int64_t len = 1;
      while (t + len < hi && layout.row_of(f.item.batch_index, t + len) == row + len) ++len;
      fn.runs.push_back({k, t - lo, row, len});
      t += len;
    }
  }
  fn.has_anchor = anchor.defined();
  fn.base_grad = base.requires_grad();
  if (anchor.defined()) inputs.push_back(anchor);  // last input: no gradient of its own
  return std::move(fn).apply(inputs)[0];
}

}  // namespace diffcomm::encoder_parallel
