// BlockLayout (see block_layout.hpp).
#include "diffcomm/distributed/backend/block_layout.hpp"

#include <fmt/format.h>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {
namespace {

// a x b, refusing negative factors and int64 overflow; `what` names the product.
int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r))
    raise("block layout", fmt::format("{} ({} x {}) is negative or overflows int64", what, a, b));
  return r;
}

}  // namespace

BlockLayout BlockLayout::uniform(std::size_t n, int64_t block) {
  (void)checked_mul(static_cast<int64_t>(n), block, "the total of n blocks");
  BlockLayout l;
  l.n_ = n;
  l.block_ = block;
  return l;
}

BlockLayout BlockLayout::of(const SplitList& splits, int64_t unit) {
  if (splits.is_uniform())
    return uniform(splits.size(), checked_mul(splits.uniform_value(), unit, "a block"));
  BlockLayout l;
  l.n_ = splits.size();
  l.offsets_.resize(l.n_ + 1, 0);
  for (std::size_t p = 0; p < l.n_; ++p) {
    const int64_t len = checked_mul(splits[p], unit, "a block");
    if (__builtin_add_overflow(l.offsets_[p], len, &l.offsets_[p + 1]))
      raise("block layout", fmt::format("the offset of block {} overflows int64", p + 1));
  }
  return l;
}

std::vector<int64_t> BlockLayout::lengths() const {
  std::vector<int64_t> v(n_);
  for (std::size_t p = 0; p < n_; ++p) v[p] = length(p);
  return v;
}

std::vector<int64_t> BlockLayout::offsets() const {
  std::vector<int64_t> v(n_);
  for (std::size_t p = 0; p < n_; ++p) v[p] = offset(p);
  return v;
}

}  // namespace diffcomm::dist
