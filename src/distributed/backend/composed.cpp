// Deterministic reductions from all_to_all_single + rank-ordered
// accumulation (see composed.hpp).
#include "diffcomm/distributed/backend/composed.hpp"

#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/backend/block_layout.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/distributed/reduce_op.hpp"

namespace diffcomm::dist {
namespace {

Tensor flat(const Tensor& t) { return t.view_as_shape({t.numel()}); }

// Block j of `numel` elements for member j: the first numel % n blocks get
// one element more.
Splits even_blocks(int64_t numel, int n) {
  Splits s(static_cast<std::size_t>(n), numel / n);
  for (int64_t j = 0; j < numel % n; ++j) s[static_cast<std::size_t>(j)] += 1;
  return s;
}

// Offset of member j's block in a flat buffer of `counts` blocks.
int64_t block_offset(const Splits& counts, int j) {
  int64_t at = 0;
  for (int k = 0; k < j; ++k) at += counts[static_cast<std::size_t>(k)];
  return at;
}

// Sends block j of `in` (counts[j] elements) to member j, then reduces the N
// blocks received, in group-rank order, into `out` (counts[rank] elements;
// it may be the own block of `in` itself). Over a transport that
// skips_own_block(), the own block is read where it is in `in` instead of
// being copied into `received` first: one memcpy of 1/N of the data less,
// the same operands in the same order (the same bits).
void reduce_scatter_blocks(Backend& b, const Call& parent, const Tensor& in, const Splits& counts,
                           const Tensor& out) {
  const int n = parent.group_size;
  const int64_t mine = counts[static_cast<std::size_t>(parent.rank)];
  Tensor received = empty({n * mine}, parent.dtype, in.device());
  Call a2a = parent.step(OpType::AllToAllSingle);
  a2a.inputs = {in};
  a2a.outputs = {received};
  a2a.input_splits = counts;
  a2a.output_splits = Splits(static_cast<std::size_t>(n), mine);
  a2a.own_block_placed = b.skips_own_block();
  b.all_to_all_single(a2a);
  std::vector<Tensor> blocks;
  blocks.reserve(static_cast<std::size_t>(n));
  for (int s = 0; s < n; ++s)
    blocks.push_back(s == parent.rank && a2a.own_block_placed
                         ? in.row_view(block_offset(counts, s), mine)
                         : received.row_view(s * mine, mine));
  reduce_into(out, blocks, parent.reduce_op);
}

}  // namespace

void composed_all_reduce(Backend& b, Call& c) {
  // In place (inputs[0] is outputs[0]) or out of place (all_reduce_into):
  // the blocks are sent before anything is written into the output.
  // Over a transport that skips_own_block(), this member's reduced block is
  // written straight into its place in the output (the all-to-all has
  // finished reading the input by then) and gathered from there: no
  // separate block, no copy of it into the output.
  const Tensor t = flat(c.outputs[0]);
  const Splits counts = even_blocks(t.numel(), c.group_size);
  const int64_t own = counts[static_cast<std::size_t>(c.rank)];
  const bool placed = b.skips_own_block();
  Tensor mine =
      placed ? t.row_view(block_offset(counts, c.rank), own) : empty({own}, c.dtype, t.device());
  reduce_scatter_blocks(b, c, flat(c.inputs[0]), counts, mine);
  Call gather = c.step(OpType::AllGatherV);
  gather.inputs = {mine};
  gather.outputs = {t};
  gather.output_splits = counts;
  gather.own_block_placed = placed;
  b.all_gather_v(gather);
}

void composed_reduce(Backend& b, Call& c) {
  const Tensor t = flat(c.outputs[0]);
  const int n = c.group_size;
  const Splits counts = even_blocks(t.numel(), n);
  const auto me = static_cast<std::size_t>(c.rank);
  Tensor mine = empty({counts[me]}, c.dtype, t.device());
  reduce_scatter_blocks(b, c, t, counts, mine);
  // Every member sends its reduced block to dst; only dst receives.
  const bool is_dst = c.rank == c.root;
  Call to_dst = c.step(OpType::AllToAllSingle);
  to_dst.inputs = {mine};
  to_dst.outputs = {is_dst ? t : empty({0}, c.dtype, t.device())};
  Splits to_root(static_cast<std::size_t>(n), 0);
  to_root[static_cast<std::size_t>(c.root)] = counts[me];
  to_dst.input_splits = std::move(to_root);
  to_dst.output_splits = is_dst ? counts : Splits(static_cast<std::size_t>(n), 0);
  b.all_to_all_single(to_dst);
}

void composed_reduce_scatter(Backend& b, Call& c) {
  const Tensor out = flat(c.outputs[0]);
  const int n = c.group_size;
  const int64_t m = out.numel();
  // The list form's blocks are separate tensors: pack them once.
  Tensor packed = empty({n * m}, c.dtype, out.device());
  for (int s = 0; s < n; ++s)
    packed.row_view(s * m, m).copy_(flat(c.inputs[static_cast<size_t>(s)]));
  reduce_scatter_blocks(b, c, packed, Splits(static_cast<std::size_t>(n), m), out);
}

void composed_reduce_scatter_single(Backend& b, Call& c) {
  const Tensor out = flat(c.outputs[0]);
  reduce_scatter_blocks(b, c, flat(c.inputs[0]),
                        Splits(static_cast<std::size_t>(c.group_size), out.numel()), out);
}

void composed_reduce_scatter_v(Backend& b, Call& c) {
  const BlockLayout blocks = BlockLayout::of(c.input_splits, c.inputs[0].row_numel());
  reduce_scatter_blocks(b, c, flat(c.inputs[0]), blocks.lengths(), flat(c.outputs[0]));
}

void ComposedReductions::forward(Call& c) {
  void (*compose)(Backend&, Call&) = nullptr;
  switch (c.op) {
    case OpType::AllReduce: compose = composed_all_reduce; break;
    case OpType::Reduce: compose = composed_reduce; break;
    case OpType::ReduceScatter: compose = composed_reduce_scatter; break;
    case OpType::ReduceScatterSingle: compose = composed_reduce_scatter_single; break;
    case OpType::ReduceScatterV: compose = composed_reduce_scatter_v; break;
    default: return inner().run(c);
  }
  inner().run_composed(c, [&] { compose(inner(), c); });
}

std::shared_ptr<Backend> ComposedReductions::rewrap(std::shared_ptr<Backend> inner_split) {
  return std::make_shared<ComposedReductions>(std::move(inner_split));
}

Tensor scaled(const Tensor& t, double alpha) { return diffcomm::scale(t.detach(), alpha); }

}  // namespace diffcomm::dist
