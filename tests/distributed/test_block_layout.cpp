// dist::BlockLayout: offsets and lengths of each member's block, checked
// against hand-written values; overflow and negative splits refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "diffcomm/distributed/backend/block_layout.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {
namespace {

TEST(BlockLayout, UnevenSplitsScaledByTheUnit) {
  // splits 2, 0, 3 rows of 4 elements: blocks [0, 8), [8, 8), [8, 20).
  const BlockLayout l = BlockLayout::of(SplitList(std::vector<int64_t>{2, 0, 3}), 4);
  ASSERT_EQ(l.size(), 3U);
  EXPECT_EQ(l.offsets(), (std::vector<int64_t>{0, 8, 8}));
  EXPECT_EQ(l.lengths(), (std::vector<int64_t>{8, 0, 12}));
  EXPECT_EQ(l.total(), 20);
}

TEST(BlockLayout, EvenSplitsAreUniformAndNeedNoTable) {
  // 16384 members of 3 rows x 5 bytes: offset(p) = 15 p, computed, not stored.
  const BlockLayout l = BlockLayout::of(SplitList::uniform(16384, 3), 5);
  EXPECT_EQ(l.size(), 16384U);
  EXPECT_EQ(l.offset(16383), 245745);
  EXPECT_EQ(l.length(7), 15);
  EXPECT_EQ(l.total(), 245760);
  const BlockLayout u = BlockLayout::uniform(4, 6);
  EXPECT_EQ(u.offsets(), (std::vector<int64_t>{0, 6, 12, 18}));
  EXPECT_EQ(u.total(), 24);
  EXPECT_EQ(BlockLayout::uniform(0, 6).total(), 0);
}

TEST(BlockLayout, OverflowAndNegativeSplitsAreRefused) {
  constexpr int64_t kBig = std::numeric_limits<int64_t>::max() / 2 + 1;
  EXPECT_THROW(BlockLayout::of(SplitList(std::vector<int64_t>{kBig, kBig}), 1), InvalidArgument);
  EXPECT_THROW(BlockLayout::of(SplitList(std::vector<int64_t>{1, kBig}), 4), InvalidArgument);
  EXPECT_THROW(BlockLayout::of(SplitList(std::vector<int64_t>{1, -1}), 1), InvalidArgument);
  EXPECT_THROW(BlockLayout::uniform(3, kBig), InvalidArgument);
  EXPECT_THROW(BlockLayout::of(SplitList::uniform(2, 1), -1), InvalidArgument);
}

}  // namespace
}  // namespace diffcomm::dist
