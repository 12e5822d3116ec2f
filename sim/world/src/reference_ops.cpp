// The data move of each primitive on the simulated world (see
// reference_ops.hpp): one function per op, dispatched by move_data.
#include "reference_ops.hpp"

#include <algorithm>
#include <cstring>

#include "diffcomm/distributed/backend/block_layout.hpp"
#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/reduce_op.hpp"

namespace diffcomm::sim::detail {

using dist::Call;
using dist::OpType;

void move_data(Calls& c) {
  switch (c[0]->op) {
    case OpType::Barrier:
    case OpType::NewGroup: break;
    case OpType::AllReduce: move_all_reduce(c); break;
    case OpType::Broadcast: move_broadcast(c); break;
    case OpType::Reduce: move_reduce(c); break;
    case OpType::AllGather: move_all_gather(c); break;
    case OpType::AllGatherSingle: move_all_gather_single(c); break;
    case OpType::AllGatherV: move_all_gather_v(c); break;
    case OpType::Gather: move_gather(c); break;
    case OpType::Scatter: move_scatter(c); break;
    case OpType::ReduceScatter: move_reduce_scatter(c); break;
    case OpType::ReduceScatterSingle: move_reduce_scatter_single(c); break;
    case OpType::ReduceScatterV: move_reduce_scatter_v(c); break;
    case OpType::AllToAll: break;  // move_all_to_all(), from the members' tables
    case OpType::AllToAllSingle: move_all_to_all_single(c); break;
    case OpType::Send:
    case OpType::Recv: move_send_recv(c); break;
  }
}

void move_all_reduce(const Calls& c) {
  // Reduced block by block into every member's output at once
  // (reduce_into's list form): each input and output byte is touched
  // once, as a memcpy of the same buffers would.
  const std::size_t n = c.size();
  std::vector<Tensor> ins, outs;
  ins.reserve(n);
  outs.reserve(n);
  for (auto* ci : c) {
    ins.push_back(ci->inputs[0]);
    outs.push_back(ci->outputs[0]);
  }
  dist::reduce_into(outs, ins, c[0]->reduce_op);
}

void move_broadcast(const Calls& c) {
  const std::size_t n = c.size();
  const auto src = static_cast<std::size_t>(c[0]->root);
  for (std::size_t i = 0; i < n; ++i)
    if (i != src) c[i]->outputs.writable(0).copy_(c[src]->inputs[0]);
}

void move_reduce(const Calls& c) {
  // Straight into the root's buffer (reduce_into handles aliasing).
  std::vector<Tensor> ins;
  ins.reserve(c.size());
  for (auto* ci : c) ins.push_back(ci->inputs[0]);
  dist::reduce_into(c[static_cast<std::size_t>(c[0]->root)]->outputs[0], ins, c[0]->reduce_op);
}

void move_all_gather(const Calls& c) {
  const std::size_t n = c.size();
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t s = 0; s < n; ++s) c[i]->outputs.writable(s).copy_(c[s]->inputs[0]);
}

void move_all_gather_single(const Calls& c) {
  const std::size_t n = c.size();
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t rows = c[i]->inputs[0].size(0);
    for (std::size_t s = 0; s < n; ++s)
      c[i]->outputs[0].row_view(static_cast<int64_t>(s) * rows, rows).copy_(c[s]->inputs[0]);
  }
}

void move_all_gather_v(const Calls& c) {
  const std::size_t n = c.size();
  for (std::size_t i = 0; i < n; ++i) {
    const auto rows = dist::BlockLayout::of(c[i]->output_splits, 1);
    for (std::size_t s = 0; s < n; ++s)
      if (s != i || !c[i]->own_block_placed)
        c[i]->outputs[0].row_view(rows.offset(s), rows.length(s)).copy_(c[s]->inputs[0]);
  }
}

void move_gather(const Calls& c) {
  const std::size_t n = c.size();
  const auto dst = static_cast<std::size_t>(c[0]->root);
  for (std::size_t s = 0; s < n; ++s) c[dst]->outputs.writable(s).copy_(c[s]->inputs[0]);
}

void move_scatter(const Calls& c) {
  const std::size_t n = c.size();
  const auto src = static_cast<std::size_t>(c[0]->root);
  for (std::size_t i = 0; i < n; ++i) c[i]->outputs.writable(0).copy_(c[src]->inputs[i]);
}

void move_reduce_scatter(const Calls& c) {
  const std::size_t n = c.size();
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<Tensor> ins;
    for (auto* cs : c) ins.push_back(cs->inputs[i]);
    dist::reduce_into(c[i]->outputs[0], ins, c[0]->reduce_op);
  }
}

void move_reduce_scatter_single(const Calls& c) {
  const std::size_t n = c.size();
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t rows = c[i]->outputs[0].size(0);
    std::vector<Tensor> ins;
    for (auto* cs : c) ins.push_back(cs->inputs[0].row_view(static_cast<int64_t>(i) * rows, rows));
    dist::reduce_into(c[i]->outputs[0], ins, c[0]->reduce_op);
  }
}

void move_reduce_scatter_v(const Calls& c) {
  // Block i of every member's input, for i = 0..N-1 in order: each
  // member's offset is a running cursor (N-sized state, as in
  // move_all_to_all_single), not a layout per member.
  const std::size_t n = c.size();
  std::vector<int64_t> cursor(n, 0);  // rows
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<Tensor> ins;
    for (std::size_t s = 0; s < n; ++s) {
      const int64_t rows = c[s]->input_splits[i];
      ins.push_back(c[s]->inputs[0].row_view(cursor[s], rows));
      cursor[s] += rows;
    }
    dist::reduce_into(c[i]->outputs[0], ins, c[0]->reduce_op);
  }
}

void move_all_to_all_single(const Calls& c) {
  // Offsets are prefix sums kept as running cursors, once per
  // collective (not a dist::BlockLayout per member: N tables of N + 1
  // offsets at once): the sender's in its own loop, each receiver's in
  // `cursor` (senders go in order s = 0..N-1, so cursor[j] is the
  // prefix sum of receiver j's output_splits up to s). N-sized state
  // per collective, not N offset tables of N+1 (4 GiB at 16384 ranks);
  // destination pointers resolved once, not per block.
  const std::size_t n = c.size();
  const auto row_bytes = static_cast<int64_t>(c[0]->inputs[0].row_numel()) *
                         static_cast<int64_t>(element_size(c[0]->dtype));
  std::vector<char*> dst(n);
  std::vector<int64_t> cursor(n, 0);  // bytes
  for (std::size_t j = 0; j < n; ++j) dst[j] = static_cast<char*>(c[j]->outputs[0].data_ptr());
  for (std::size_t s = 0; s < n; ++s) {
    const char* src = static_cast<const char*>(c[s]->inputs[0].data_ptr());
    const dist::SplitList& in_splits = c[s]->input_splits;
    int64_t in_at = 0;  // bytes
    for (std::size_t j = 0; j < n; ++j) {
      const int64_t bytes = in_splits[j] * row_bytes;
      if (bytes == 0) continue;
      // Receiver j's output_splits[s] equals in_splits[j] (compared
      // before any data moves), so the sender's split advances both.
      if (j != s || !c[s]->own_block_placed)
        std::memcpy(dst[j] + cursor[j], src + in_at, static_cast<std::size_t>(bytes));
      in_at += bytes;
      cursor[j] += bytes;
    }
  }
}

void move_send_recv(const Calls& c) { c[1]->outputs.writable(0).copy_(c[0]->inputs[0]); }

// all_to_all's row of member `slot`, read from its own lists on arrival
// (one pass over its tensors while the funnel's checks left them in cache;
// reading every member's N tensors again at the rendezvous, for the
// compare and then for the move, were two passes over all N^2 tensors,
// hundreds of MB at 1024 ranks). Block sizes use the call's dtype: the
// funnel checked that every tensor has it. Rows of members that called
// something else, or lists of another length, are not written: compare()
// rejects those calls before reading any row.
void fill_all_to_all_row(Rendezvous& rv, std::size_t slot, const Call& call) {
  const std::size_t n = rv.calls.size();
  if (call.inputs.size() != n || call.outputs.size() != n) return;
  auto& t = rv.a2a;
  t.resize(n * n);
  const std::size_t esize = element_size(call.dtype);
  auto bytes_of = [&](const Shape& s) {
    std::size_t e = esize;
    for (int64_t d : s) e *= static_cast<std::size_t>(d);
    return e;
  };
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t k = slot * n + i;
    const Tensor& in = call.inputs[i];
    const Tensor& out = call.outputs[i];
    if (!in.defined() || !out.defined()) {  // compare() reports it
      t.in_code[k] = t.out_code[k] = 0;
      t.src[k] = nullptr;
      t.dst[k] = nullptr;
      t.len[k] = 0;
      continue;
    }
    const Shape& si = in.shape();
    const Shape& so = out.shape();
    t.in_code[k] = dist::shape_code(si);
    t.out_code[k] = dist::shape_code(so);
    t.len[k] = bytes_of(si);
    t.src[k] = t.len[k] != 0 ? static_cast<const char*>(in.data_ptr()) : nullptr;
    t.dst[k] = bytes_of(so) != 0 ? static_cast<char*>(out.data_ptr()) : nullptr;
  }
}

// The N^2 blocks moved from the members' tables, receiver by receiver in
// sender order. Shapes and dtypes were compared before any data moves, so
// a block's size is its input's.
// The senders' entries for a panel of kPanel receivers are first gathered
// into a receiver-major buffer (each sender row read once per panel, a
// few cache lines), so the moves read it in order: reading the senders'
// rows in receiver order took a new page for every block at 1024 ranks.
// The order of the moves is unchanged (receiver by receiver, senders in
// order).
void move_all_to_all(Rendezvous& rv) {
  const std::size_t n = rv.calls.size();
  const auto& t = rv.a2a;
  constexpr std::size_t kPanel = 64;
  struct Block {
    const char* from;
    std::size_t len;
  };
  std::vector<Block> panel(std::min(n, kPanel) * n);
  for (std::size_t i0 = 0; i0 < n; i0 += kPanel) {
    const std::size_t width = std::min(n, i0 + kPanel) - i0;
    for (std::size_t s = 0; s < n; ++s)
      for (std::size_t r = 0; r < width; ++r)
        panel[r * n + s] = {t.src[s * n + i0 + r], t.len[s * n + i0 + r]};
    for (std::size_t r = 0; r < width; ++r)
      for (std::size_t s = 0; s < n; ++s) {
        const Block& b = panel[r * n + s];
        char* to = t.dst[(i0 + r) * n + s];
        if (b.len != 0 && to != b.from) std::memmove(to, b.from, b.len);
      }
  }
}

}  // namespace diffcomm::sim::detail
