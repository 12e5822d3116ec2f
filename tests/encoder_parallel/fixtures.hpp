#pragma once
// Shared inputs of the encoder-parallel unit tests (tests/encoder_parallel/):
// small hand-made batches and meshes whose plans the tests work out by hand,
// and the feature rows the exchange tests route. Every value here is a
// constructed input, never an expected result.
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace ep = encoder_parallel;
namespace qw = encoder_parallel::qwen2vl;

namespace ep_testing {

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

// Runs `what` and returns the message of the InvalidArgument it throws
// (fails the test when it throws nothing or something else).
inline std::string invalid_argument_message(const std::function<void()>& what) {
  try {
    what();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected InvalidArgument, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected InvalidArgument, nothing was thrown";
  return "";
}

inline ep::DecoderMesh mesh_of(int cp, int tp, bool sp,
                               ep::CpLayout layout = ep::CpLayout::Contiguous) {
  ep::DecoderMesh m;
  m.cp = cp;
  m.tp = tp;
  m.sp = sp;
  m.layout = layout;
  return m;
}

inline ep::ImageSpan span(int64_t start, int64_t tokens, int64_t patches) {
  ep::ImageSpan s;
  s.token_start = start;
  s.tokens = tokens;
  s.patches = patches;
  return s;
}

inline ep::Sample sample(int64_t seq_len, std::vector<ep::ImageSpan> images) {
  ep::Sample s;
  s.seq_len = seq_len;
  s.images = std::move(images);
  return s;
}

inline ep::EncoderLayout encoder_layout(int buckets, int ecp) {
  ep::EncoderLayout e;
  e.buckets = buckets;
  e.encoder_cp = ecp;
  return e;
}

// DESIGN's example: S = 16, one image on tokens 5..10 (6 rows).
inline ep::Batch design_example() {
  ep::Batch b;
  b.samples.push_back(sample(16, {span(5, 6, 24)}));
  return b;
}

// Five images over two samples of 8 tokens (patches 4, 12, 8, 8, 2):
//   sample 0: item 0 at [1,2) (p 4), item 1 at [3,6) (p 12)
//   sample 1: item 2 at [0,2) (p 8), item 3 at [4,6) (p 8), item 4 at [7,8) (p 2)
inline ep::Batch five_images() {
  ep::Batch b;
  b.samples.push_back(sample(8, {span(1, 1, 4), span(3, 3, 12)}));
  b.samples.push_back(sample(8, {span(0, 2, 8), span(4, 2, 8), span(7, 1, 2)}));
  return b;
}

// Zigzag cp 2 (S = 8, chunks of 2): rank 0 owns [0, 2) ++ [6, 8), rank 1
// [2, 4) ++ [4, 6). One image on tokens 1..6, made on rank 0.
inline ep::ExchangePlan zigzag_straddle() {
  ep::Batch b;
  b.samples.push_back(sample(8, {span(1, 6, 24)}));
  return ep::plan_exchange(b, mesh_of(2, 1, false, ep::CpLayout::Zigzag), encoder_layout(2, 1));
}

// ---- feature rows of the exchange tests

inline constexpr int64_t kHidden = 3;

// Feature value of (item, row, column): distinct and exact in float64.
inline double cell(int64_t item, int64_t r, int64_t h) {
  return 100.0 * static_cast<double>(item) + static_cast<double>(r) + static_cast<double>(h) / 8.0;
}

inline Tensor item_rows(const ep::EncoderWorkItem& it) {
  std::vector<double> v;
  for (int64_t r = 0; r < it.output_rows; ++r)
    for (int64_t h = 0; h < kHidden; ++h) v.push_back(cell(it.item_id, r, h));
  return from_vector(v, {it.output_rows, kHidden}, DType::Float64);
}

// The records exchange rank e produces: its bucket's items, as leaves.
inline std::vector<ep::EncoderFeature> records_of(const ep::ExchangePlan& plan, int e) {
  std::vector<ep::EncoderFeature> out;
  if (e % plan.encoder.encoder_cp != 0) return out;
  for (int64_t id : plan.buckets[static_cast<std::size_t>(e / plan.encoder.encoder_cp)]) {
    const auto& it = plan.items[static_cast<std::size_t>(id)];
    Tensor rows = item_rows(it);
    rows.set_requires_grad(true);
    out.push_back({it, rows});
  }
  return out;
}

}  // namespace ep_testing
}  // namespace diffcomm
