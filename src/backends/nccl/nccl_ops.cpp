// NcclBackend's primitives: each maps to the NCCL call(s) it wraps, enqueued
// on the group's stream inside run() (nccl_backend.hpp), which gives the
// device, the stream, the ordering with the caller and CPU staging. The
// funnel (dist/collectives.cpp) has validated every Call.
#include <fmt/ranges.h>

#include <algorithm>

#include "diffcomm/distributed/backend/block_layout.hpp"
#include "nccl_backend.hpp"

namespace diffcomm::nccl::impl {

void NcclBackend::barrier(Call& c) {
  run(c, [&](Call& d) {
    if (!barrier_buf_.defined()) {
      barrier_buf_ = empty({1}, DType::Int32, Device::cuda(device_));
      DIFFCOMM_CUDA_CHECK(cudaMemsetAsync(barrier_buf_.data_ptr(), 0, sizeof(int32_t), stream()),
                          &d);
    }
    DIFFCOMM_NCCL_CHECK(ncclAllReduce(barrier_buf_.data_ptr(), barrier_buf_.data_ptr(), 1,
                                      ncclInt32, ncclSum, comm_, stream()),
                        &d);
  });
  // A barrier returns once every member has entered: wait for it.
  const DeviceGuard guard(device_);
  wait(&c);
}

void NcclBackend::all_reduce(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& t = d.outputs[0];
    if (t.numel() == 0) return;
    DIFFCOMM_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), count(t), nccl_type(d.dtype),
                                      red_op(d), comm_, stream()),
                        &d);
    finish_avg(d, t);
  });
}

void NcclBackend::broadcast(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& t = d.outputs[0];
    if (t.numel() == 0) return;
    DIFFCOMM_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), count(t), nccl_type(d.dtype),
                                      d.root, comm_, stream()),
                        &d);
  });
}

void NcclBackend::reduce(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& t = d.outputs[0];
    if (t.numel() == 0) return;
    // recvbuff is only written on the root: the others keep their input.
    DIFFCOMM_NCCL_CHECK(ncclReduce(t.data_ptr(), t.data_ptr(), count(t), nccl_type(d.dtype),
                                   red_op(d), d.root, comm_, stream()),
                        &d);
    if (rank_ == d.root) finish_avg(d, t);
  });
}

void NcclBackend::all_gather(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& in = d.inputs[0];
    if (in.numel() == 0) return;
    if (consecutive(d.outputs)) {
      DIFFCOMM_NCCL_CHECK(ncclAllGather(in.data_ptr(), d.outputs[0].data_ptr(), count(in),
                                        nccl_type(d.dtype), comm_, stream()),
                          &d);
      return;
    }
    Tensor tmp = scratch(static_cast<int64_t>(size_) * in.numel(), d.dtype);
    DIFFCOMM_NCCL_CHECK(ncclAllGather(in.data_ptr(), tmp.data_ptr(), count(in), nccl_type(d.dtype),
                                      comm_, stream()),
                        &d);
    for (int s = 0; s < size_; ++s)
      copy_async(d.outputs[static_cast<std::size_t>(s)].data_ptr(), at(tmp, s * in.numel()),
                 in.nbytes(), &d);
    // tmp is freed in stream order on the group's stream, after the op.
  });
}

void NcclBackend::all_gather_single(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& in = d.inputs[0];
    if (in.numel() == 0) return;
    DIFFCOMM_NCCL_CHECK(ncclAllGather(in.data_ptr(), d.outputs[0].data_ptr(), count(in),
                                      nccl_type(d.dtype), comm_, stream()),
                        &d);
  });
}

void NcclBackend::all_gather_v(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& in = d.inputs[0];
    const Tensor& out = d.outputs[0];
    const auto blocks = dist::BlockLayout::of(d.output_splits, in.row_numel());
    {
      Group group(this, &d);
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const auto pi = static_cast<std::size_t>(p);
        DIFFCOMM_NCCL_CHECK(
            ncclSend(in.data_ptr(), count(in), nccl_type(d.dtype), p, comm_, stream()), &d);
        DIFFCOMM_NCCL_CHECK(
            ncclRecv(at(out, blocks.offset(pi)), static_cast<std::size_t>(blocks.length(pi)),
                     nccl_type(d.dtype), p, comm_, stream()),
            &d);
      }
      group.end();
    }
    copy_async(at(out, blocks.offset(static_cast<std::size_t>(rank_))), in.data_ptr(), in.nbytes(),
               &d);
  });
}

void NcclBackend::gather(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& in = d.inputs[0];
    const bool root = rank_ == d.root;
    if (native_) {
#if DIFFCOMM_NCCL_HEADER_HAS_2_28
      if (in.numel() == 0) return;
      if (!root) {  // recvbuff is not used off the root
        DIFFCOMM_NCCL_CHECK(ncclGather(in.data_ptr(), in.data_ptr(), count(in), nccl_type(d.dtype),
                                       d.root, comm_, stream()),
                            &d);
        return;
      }
      if (consecutive(d.outputs)) {
        DIFFCOMM_NCCL_CHECK(ncclGather(in.data_ptr(), d.outputs[0].data_ptr(), count(in),
                                       nccl_type(d.dtype), d.root, comm_, stream()),
                            &d);
        return;
      }
      Tensor tmp = scratch(static_cast<int64_t>(size_) * in.numel(), d.dtype);
      DIFFCOMM_NCCL_CHECK(ncclGather(in.data_ptr(), tmp.data_ptr(), count(in), nccl_type(d.dtype),
                                     d.root, comm_, stream()),
                          &d);
      for (int s = 0; s < size_; ++s)
        copy_async(d.outputs[static_cast<std::size_t>(s)].data_ptr(), at(tmp, s * in.numel()),
                   in.nbytes(), &d);
      return;
#endif
    }
    // Grouped point-to-point: every non-root posts its send (zero counts
    // too), the root one receive per peer.
    {
      Group group(this, &d);
      if (root) {
        for (int p = 0; p < size_; ++p)
          if (p != rank_)
            DIFFCOMM_NCCL_CHECK(ncclRecv(d.outputs[static_cast<std::size_t>(p)].data_ptr(),
                                         count(in), nccl_type(d.dtype), p, comm_, stream()),
                                &d);
      } else {
        DIFFCOMM_NCCL_CHECK(
            ncclSend(in.data_ptr(), count(in), nccl_type(d.dtype), d.root, comm_, stream()), &d);
      }
      group.end();
    }
    if (root)
      copy_async(d.outputs[static_cast<std::size_t>(rank_)].data_ptr(), in.data_ptr(), in.nbytes(),
                 &d);
  });
}

void NcclBackend::scatter(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& out = d.outputs[0];
    const bool root = rank_ == d.root;
    if (native_) {
#if DIFFCOMM_NCCL_HEADER_HAS_2_28
      if (out.numel() == 0) return;
      if (!root) {  // sendbuff is not used off the root
        DIFFCOMM_NCCL_CHECK(ncclScatter(out.data_ptr(), out.data_ptr(), count(out),
                                        nccl_type(d.dtype), d.root, comm_, stream()),
                            &d);
        return;
      }
      if (consecutive(d.inputs)) {
        DIFFCOMM_NCCL_CHECK(ncclScatter(d.inputs[0].data_ptr(), out.data_ptr(), count(out),
                                        nccl_type(d.dtype), d.root, comm_, stream()),
                            &d);
        return;
      }
      Tensor tmp = scratch(static_cast<int64_t>(size_) * out.numel(), d.dtype);
      for (int s = 0; s < size_; ++s)
        copy_async(at(tmp, s * out.numel()), d.inputs[static_cast<std::size_t>(s)].data_ptr(),
                   out.nbytes(), &d);
      DIFFCOMM_NCCL_CHECK(ncclScatter(tmp.data_ptr(), out.data_ptr(), count(out),
                                      nccl_type(d.dtype), d.root, comm_, stream()),
                          &d);
      return;
#endif
    }
    {
      Group group(this, &d);
      if (root) {
        for (int p = 0; p < size_; ++p)
          if (p != rank_)
            DIFFCOMM_NCCL_CHECK(ncclSend(d.inputs[static_cast<std::size_t>(p)].data_ptr(),
                                         count(out), nccl_type(d.dtype), p, comm_, stream()),
                                &d);
      } else {
        DIFFCOMM_NCCL_CHECK(
            ncclRecv(out.data_ptr(), count(out), nccl_type(d.dtype), d.root, comm_, stream()), &d);
      }
      group.end();
    }
    if (root)
      copy_async(out.data_ptr(), d.inputs[static_cast<std::size_t>(rank_)].data_ptr(), out.nbytes(),
                 &d);
  });
}

void NcclBackend::reduce_scatter(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& out = d.outputs[0];
    if (out.numel() == 0) return;
    if (consecutive(d.inputs)) {
      DIFFCOMM_NCCL_CHECK(ncclReduceScatter(d.inputs[0].data_ptr(), out.data_ptr(), count(out),
                                            nccl_type(d.dtype), red_op(d), comm_, stream()),
                          &d);
    } else {
      Tensor tmp = scratch(static_cast<int64_t>(size_) * out.numel(), d.dtype);
      for (int s = 0; s < size_; ++s)
        copy_async(at(tmp, s * out.numel()), d.inputs[static_cast<std::size_t>(s)].data_ptr(),
                   out.nbytes(), &d);
      DIFFCOMM_NCCL_CHECK(ncclReduceScatter(tmp.data_ptr(), out.data_ptr(), count(out),
                                            nccl_type(d.dtype), red_op(d), comm_, stream()),
                          &d);
    }
    finish_avg(d, out);
  });
}

void NcclBackend::reduce_scatter_single(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& out = d.outputs[0];
    if (out.numel() == 0) return;
    DIFFCOMM_NCCL_CHECK(ncclReduceScatter(d.inputs[0].data_ptr(), out.data_ptr(), count(out),
                                          nccl_type(d.dtype), red_op(d), comm_, stream()),
                        &d);
    finish_avg(d, out);
  });
}

void NcclBackend::reduce_scatter_v(Call& c) {
  run(c, [&](Call& d) {
    // One ncclReduce per destination, all in one group: block p of every
    // member's input is reduced onto member p's output (zero-size blocks
    // are posted too; NCCL skips them on every member alike).
    const Tensor& in = d.inputs[0];
    const Tensor& out = d.outputs[0];
    const auto blocks = dist::BlockLayout::of(d.input_splits, in.row_numel());
    {
      Group group(this, &d);
      for (int p = 0; p < size_; ++p) {
        const auto pi = static_cast<std::size_t>(p);
        const int64_t n = blocks.length(pi);
        void* send = at(in, blocks.offset(pi));
        // recvbuff is only used on the root; elsewhere pass the send block.
        void* recv = p == rank_ ? out.data_ptr() : send;
        DIFFCOMM_NCCL_CHECK(ncclReduce(send, recv, static_cast<std::size_t>(n), nccl_type(d.dtype),
                                       red_op(d), p, comm_, stream()),
                            &d);
      }
      group.end();
    }
    finish_avg(d, out);
  });
}

void NcclBackend::all_to_all(Call& c) {
  run(c, [&](Call& d) {
    {
      Group group(this, &d);
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const auto pi = static_cast<std::size_t>(p);
        DIFFCOMM_NCCL_CHECK(ncclSend(d.inputs[pi].data_ptr(), count(d.inputs[pi]),
                                     nccl_type(d.dtype), p, comm_, stream()),
                            &d);
        DIFFCOMM_NCCL_CHECK(ncclRecv(d.outputs[pi].data_ptr(), count(d.outputs[pi]),
                                     nccl_type(d.dtype), p, comm_, stream()),
                            &d);
      }
      group.end();
    }
    const auto me = static_cast<std::size_t>(rank_);
    copy_async(d.outputs[me].data_ptr(), d.inputs[me].data_ptr(), d.inputs[me].nbytes(), &d);
  });
}

void NcclBackend::all_to_all_single(Call& c) {
  if (opts_.even_all_to_all) {
    // The promise of Options::even_all_to_all, checked before any traffic.
    const int64_t k = c.input_splits.empty() ? 0 : c.input_splits[0];
    auto even = [&](const dist::SplitList& s) {
      return std::all_of(s.begin(), s.end(), [&](int64_t x) { return x == k; });
    };
    if (!even(c.input_splits) || !even(c.output_splits))
      raise(c.where() + " [nccl]",
            fmt::format("the group promised even all_to_all_single splits "
                        "(Options::even_all_to_all) but got input_splits {} and output_splits {}",
                        fmt::join(c.input_splits, ","), fmt::join(c.output_splits, ",")));
  }
  run(c, [&](Call& d) {
    const Tensor& in = d.inputs[0];
    const Tensor& out = d.outputs[0];
    const int64_t rn = in.row_numel();
#if DIFFCOMM_NCCL_HEADER_HAS_2_28
    if (native_ && opts_.even_all_to_all) {
      const int64_t block = d.input_splits.empty() ? 0 : d.input_splits[0] * rn;
      if (block == 0) return;
      DIFFCOMM_NCCL_CHECK(
          ncclAlltoAll(in.data_ptr(), out.data_ptr(), static_cast<std::size_t>(block),
                       nccl_type(d.dtype), comm_, stream()),
          &d);
      return;
    }
#endif
    const auto send = dist::BlockLayout::of(d.input_splits, rn);
    const auto recv = dist::BlockLayout::of(d.output_splits, rn);
    {
      Group group(this, &d);
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const auto pi = static_cast<std::size_t>(p);
        DIFFCOMM_NCCL_CHECK(
            ncclSend(at(in, send.offset(pi)), static_cast<std::size_t>(send.length(pi)),
                     nccl_type(d.dtype), p, comm_, stream()),
            &d);
        DIFFCOMM_NCCL_CHECK(
            ncclRecv(at(out, recv.offset(pi)), static_cast<std::size_t>(recv.length(pi)),
                     nccl_type(d.dtype), p, comm_, stream()),
            &d);
      }
      group.end();
    }
    const auto me = static_cast<std::size_t>(rank_);
    copy_async(at(out, recv.offset(me)), at(in, send.offset(me)),
               static_cast<std::size_t>(send.length(me)) * element_size(d.dtype), &d);
  });
}

void NcclBackend::send(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& t = d.inputs[0];
    DIFFCOMM_NCCL_CHECK(
        ncclSend(t.data_ptr(), count(t), nccl_type(d.dtype), d.root, comm_, stream()), &d);
  });
}

void NcclBackend::recv(Call& c) {
  run(c, [&](Call& d) {
    const Tensor& t = d.outputs[0];
    DIFFCOMM_NCCL_CHECK(
        ncclRecv(t.data_ptr(), count(t), nccl_type(d.dtype), d.root, comm_, stream()), &d);
  });
}

}  // namespace diffcomm::nccl::impl
