// The decorator shape (issue 25 item 2): Backend::run's one dispatch,
// ForwardingBackend, ComposedReductions and the fixed stack of
// dist::stack_layers — checked with a recording transport, and
// ComposedReductions over the simulated world's own backend against the
// simulated world's reductions, bit for bit.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "diffcomm/distributed/backend/checked_backend.hpp"
#include "diffcomm/distributed/backend/composed.hpp"
#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/backend/layers.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {
namespace {

// A transport that moves nothing and records which primitive ran.
class Recording final : public Backend {
 public:
  Recording(int rank, int size) : rank_(rank), size_(size) {}
  std::string backend_name() const override { return "recording"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int global_rank(int r) const override { return r; }
  bool supports(const Device& d) const override { return d.is_cpu(); }
  void run_composed(Call& c, const std::function<void()>& steps) override {
    composed.push_back(c.op);
    steps();
  }
  std::shared_ptr<Backend> split(Call&, int, int) override {
    return std::make_shared<Recording>(rank_, size_);
  }
  void barrier(Call& c) override { note(c); }
  void all_reduce(Call& c) override { note(c); }
  void broadcast(Call& c) override { note(c); }
  void reduce(Call& c) override { note(c); }
  void all_gather(Call& c) override { note(c); }
  void all_gather_single(Call& c) override { note(c); }
  void all_gather_v(Call& c) override { note(c); }
  void gather(Call& c) override { note(c); }
  void scatter(Call& c) override { note(c); }
  void reduce_scatter(Call& c) override { note(c); }
  void reduce_scatter_single(Call& c) override { note(c); }
  void reduce_scatter_v(Call& c) override { note(c); }
  void all_to_all(Call& c) override { note(c); }
  void all_to_all_single(Call& c) override { note(c); }
  void send(Call& c) override { note(c); }
  void recv(Call& c) override { note(c); }

  std::vector<OpType> ops;       // every primitive, in order
  std::vector<bool> steps;       // whether it was a composed op's step
  std::vector<OpType> composed;  // run_composed's calls

 private:
  void note(const Call& c) {
    ops.push_back(c.op);
    steps.push_back(c.part_of != nullptr);
  }
  int rank_, size_;
};

const std::vector<OpType> kPrimitives = {OpType::Barrier,
                                         OpType::AllReduce,
                                         OpType::Broadcast,
                                         OpType::Reduce,
                                         OpType::AllGather,
                                         OpType::AllGatherSingle,
                                         OpType::AllGatherV,
                                         OpType::Gather,
                                         OpType::Scatter,
                                         OpType::ReduceScatter,
                                         OpType::ReduceScatterSingle,
                                         OpType::ReduceScatterV,
                                         OpType::AllToAll,
                                         OpType::AllToAllSingle,
                                         OpType::Send,
                                         OpType::Recv};

TEST(BackendRun, DispatchesEveryOpToItsPrimitive) {
  Recording b(0, 1);
  for (OpType op : kPrimitives) {
    Call c;
    c.op = op;
    b.run(c);
  }
  EXPECT_EQ(b.ops, kPrimitives);
  Call split;
  split.op = OpType::NewGroup;
  EXPECT_THROW(b.run(split), InvalidArgument);
}

// A call of `op` on a group of 4 as rank 1, over 8 float32 elements.
Call call_of(OpType op) {
  Call c;
  c.op = op;
  c.seq = 5;
  c.rank = 1;
  c.group_size = 4;
  c.root = 0;
  Tensor t = zeros({8});
  c.inputs = {t};
  c.outputs = {op == OpType::ReduceScatterSingle ? zeros({2}) : t};
  return c;
}

TEST(ComposedReductions, ReductionsBecomeStepsOfTheTransportOthersPassThrough) {
  auto transport = std::make_shared<Recording>(1, 4);
  ComposedReductions composed(transport);
  Call ar = call_of(OpType::AllReduce);
  composed.run(ar);
  EXPECT_EQ(transport->ops, (std::vector<OpType>{OpType::AllToAllSingle, OpType::AllGatherV}));
  EXPECT_EQ(transport->steps, (std::vector<bool>{true, true}));
  EXPECT_EQ(transport->composed, std::vector<OpType>{OpType::AllReduce});

  transport->ops.clear();
  Call red = call_of(OpType::Reduce);
  composed.run(red);  // reduce-scatter of blocks, then each block to dst
  EXPECT_EQ(transport->ops, (std::vector<OpType>{OpType::AllToAllSingle, OpType::AllToAllSingle}));

  transport->ops.clear();
  Call rs = call_of(OpType::ReduceScatterSingle);
  composed.run(rs);
  EXPECT_EQ(transport->ops, std::vector<OpType>{OpType::AllToAllSingle});

  transport->ops.clear();
  transport->steps.clear();
  Call bc = call_of(OpType::Broadcast);
  composed.run(bc);
  EXPECT_EQ(transport->ops, std::vector<OpType>{OpType::Broadcast});
  EXPECT_EQ(transport->steps, std::vector<bool>{false});
  EXPECT_EQ(transport->composed.size(), 3U);  // not for the broadcast

  Call sp = call_of(OpType::NewGroup);
  std::shared_ptr<Backend> sub = composed.split(sp, 0, 0);
  ASSERT_NE(dynamic_cast<ComposedReductions*>(sub.get()), nullptr);  // the split is composed too
  EXPECT_EQ(sub->backend_name(), "recording");
}

TEST(StackLayers, CheckedOutsideComposedOutsideTheTransport) {
  auto transport = std::make_shared<Recording>(0, 1);
  int controls = 0;
  auto control = [&]() -> std::shared_ptr<Backend> {
    ++controls;
    return std::make_shared<Recording>(0, 1);
  };
  Options both;
  both.check = true;
  std::shared_ptr<Backend> b = stack_layers(transport, both, control, Device::cpu());
  auto* checked = dynamic_cast<CheckedBackend*>(b.get());
  ASSERT_NE(checked, nullptr);
  EXPECT_NE(dynamic_cast<ComposedReductions*>(&checked->inner()), nullptr);
  EXPECT_EQ(&transport_of(*b), transport.get());
  EXPECT_EQ(controls, 1);

  Options native_unchecked;
  native_unchecked.check = false;
  native_unchecked.native_reduction = true;
  EXPECT_EQ(stack_layers(transport, native_unchecked, control, Device::cpu()).get(),
            transport.get());
  EXPECT_EQ(controls, 1);  // the control backend is made only for checked mode
  EXPECT_THROW(stack_layers(nullptr, native_unchecked, control, Device::cpu()), InvalidArgument);
}

// A transport that copies every own block (as NCCL's and torch's): the
// simulated backend with skips_own_block() false, so ComposedReductions
// takes its copying path over it.
class CopiesOwnBlock final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  bool skips_own_block() const override { return false; }
  int placed_steps = 0;  // steps that asked to skip the own block anyway

 protected:
  void forward(Call& c) override {
    if (c.own_block_placed) ++placed_steps;
    inner().run(c);
  }
};

// ComposedReductions over the simulated world's backend reduces every
// element in group-rank order, as the simulated world does: the same bits,
// whether the transport skips the own block's copies (the simulated one,
// as MPI) or copies it (as NCCL and torch), in place and out of place.
TEST(ComposedReductions, OverTheSimulatedWorldGivesItsBitsExactly) {
  for (int n : {1, 2, 3, 5}) {
    sim::WorldOptions o;
    o.ranks = n;
    o.seed = 11;
    sim::World world(o);
    world.run([&](sim::Rank& rank) {
      const ProcessGroup& native = rank.world();
      // Non-owning: the world's group keeps its backend alive.
      std::shared_ptr<Backend> sim_backend(std::shared_ptr<Backend>{}, &native.backend());
      auto copying = std::make_shared<CopiesOwnBlock>(sim_backend);
      ASSERT_TRUE(sim_backend->skips_own_block());
      const ProcessGroup skipping_g(std::make_shared<ComposedReductions>(sim_backend), "composed",
                                    nullptr);
      const ProcessGroup copying_g(std::make_shared<ComposedReductions>(copying), "copying",
                                   nullptr);
      for (const ProcessGroup* composed : {&skipping_g, &copying_g}) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Product}) {
          const std::string where = composed->name() + ", world " + std::to_string(n);
          const Tensor x = rand_normal({13}, rank.generator());
          Tensor a = x.copy_data(), b = x.copy_data(), into = full({13}, -1.0);
          all_reduce(native, a, op);
          all_reduce(*composed, b, op);
          EXPECT_EQ(a.to_vector(), b.to_vector()) << "all_reduce, " << where;
          all_reduce_into(*composed, into, x, op);
          EXPECT_EQ(a.to_vector(), into.to_vector()) << "all_reduce_into, " << where;
          Tensor ra = zeros({3}), rb = zeros({3});
          const Tensor y = rand_normal({3 * static_cast<int64_t>(n)}, rank.generator());
          reduce_scatter_single(native, ra, y, op);
          reduce_scatter_single(*composed, rb, y, op);
          EXPECT_EQ(ra.to_vector(), rb.to_vector()) << "reduce_scatter_single, " << where;
          Tensor da = x.copy_data(), db = x.copy_data();
          reduce(native, da, n - 1, op);
          reduce(*composed, db, n - 1, op);
          if (rank.rank() == n - 1) {
            EXPECT_EQ(da.to_vector(), db.to_vector()) << "reduce, " << where;
          }
        }
      }
      EXPECT_EQ(copying->placed_steps, 0);
    });
  }
}

// A backend that reduces only in place (as the MPI, NCCL and torch
// transports with native_reduction): all_reduce_into must hand it in-place
// calls. Counts the calls that are not.
class InPlaceOnly final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  bool all_reduce_out_of_place() const override { return false; }
  int out_of_place_calls = 0;

 protected:
  void forward(Call& c) override {
    if (c.op == OpType::AllReduce && !c.inputs[0].same(c.outputs[0])) ++out_of_place_calls;
    inner().run(c);
  }
};

// all_reduce_into gives all_reduce's bits on every stack (the simulated
// world's own out-of-place reduction, the composed one over it, and an
// in-place-only backend) and never writes its input.
TEST(AllReduceInto, EqualsAllReduceOfACopyOnEveryStack) {
  for (int n : {1, 2, 3, 5}) {
    sim::WorldOptions o;
    o.ranks = n;
    o.seed = 5;
    sim::World world(o);
    world.run([&](sim::Rank& rank) {
      const ProcessGroup& native = rank.world();
      std::shared_ptr<Backend> sim_backend(std::shared_ptr<Backend>{}, &native.backend());
      auto in_place = std::make_shared<InPlaceOnly>(sim_backend);
      const ProcessGroup composed(std::make_shared<ComposedReductions>(sim_backend), "composed",
                                  nullptr);
      const ProcessGroup copying(in_place, "in_place_only", nullptr);
      EXPECT_TRUE(native.backend().all_reduce_out_of_place());
      EXPECT_TRUE(composed.backend().all_reduce_out_of_place());
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Product}) {
        const Tensor x = rand_normal({4, 7}, rank.generator());
        const std::vector<double> before = x.to_vector();
        Tensor expected = x.copy_data();
        all_reduce(native, expected, op);
        for (const ProcessGroup* g : {&native, &composed, &copying}) {
          Tensor out = full({4, 7}, -1.0);
          all_reduce_into(*g, out, x, op);
          EXPECT_EQ(out.to_vector(), expected.to_vector()) << g->name() << ", world " << n;
          EXPECT_EQ(x.to_vector(), before) << g->name() << ": the input was written";
        }
      }
      EXPECT_EQ(in_place->out_of_place_calls, 0);
      // The output is the input itself: the in-place all_reduce.
      Tensor t = full({3}, 2.0);
      all_reduce_into(native, t, t);
      EXPECT_EQ(t.to_vector(), std::vector<double>(3, 2.0 * n));
    });
  }
}

TEST(AllReduceInto, NamesTheMismatchedOutput) {
  sim::WorldOptions o;
  o.ranks = 2;
  sim::World world(o);
  world.run([&](sim::Rank& rank) {
    const Tensor x = zeros({4}, DType::Float64);
    try {
      all_reduce_into(rank.world(), zeros({5}, DType::Float64), x);
      ADD_FAILURE() << "a [5] output for a [4] input was accepted";
    } catch (const InvalidArgument& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("all_reduce"), std::string::npos) << m;
      EXPECT_NE(m.find("output has shape [5], expected [4]"), std::string::npos) << m;
      EXPECT_NE(m.find("rank " + std::to_string(rank.rank())), std::string::npos) << m;
    }
    EXPECT_THROW(all_reduce_into(rank.world(), zeros({4}, DType::Float32), x), InvalidArgument);
    // A kind cast from an integer outside the enum.
    EXPECT_THROW(all_reduce(rank.world(), zeros({4}), ReduceOp(ReduceOp::Kind(9))),
                 InvalidArgument);
    dist::barrier(rank.world());  // nothing was issued: the group still matches
  });
}

}  // namespace
// Call::thread_index (issue [4/7] item 3): the group numbers the threads
// that make its collectives in order of first use. A thread that ends and a
// new one in its place (std::thread::id may be reused) are two threads;
// send/recv neither count nor carry a number; members whose numbers differ
// disagree in checked mode and the report names both threads.
TEST(ThreadNumbers, TheGroupNumbersItsCallingThreadsInOrderOfFirstUse) {
  const ProcessGroup g(std::make_shared<Recording>(0, 2), "threads", nullptr);
  const auto number_of = [&](OpType op) {
    Call c;
    c.op = op;
    c.thread_index = -1;
    const ProcessGroup::CallSlot slot(g, c);
    return c.thread_index;
  };
  const auto on_new_thread = [&](OpType op) {
    int number = -2;
    std::thread t([&] { number = number_of(op); });
    t.join();
    return number;
  };
  EXPECT_EQ(number_of(OpType::AllReduce), 0);
  EXPECT_EQ(number_of(OpType::Barrier), 0);
  EXPECT_EQ(on_new_thread(OpType::AllReduce), 1);
  EXPECT_EQ(on_new_thread(OpType::AllReduce), 2);  // another thread, even at a reused id
  EXPECT_EQ(on_new_thread(OpType::Send), -1);      // p2p: untouched, not numbered
  EXPECT_EQ(number_of(OpType::AllGather), 0);      // main again: its first number
  EXPECT_EQ(number_of(OpType::Recv), -1);
  int worker_first = -1, worker_again = -1;
  std::thread worker([&] {
    worker_first = number_of(OpType::AllReduce);
    worker_again = number_of(OpType::AllReduce);
  });
  worker.join();
  EXPECT_EQ(worker_first, 3);
  EXPECT_EQ(worker_again, 3);

  Call a, b;
  a.op = b.op = OpType::AllReduce;
  a.group_size = b.group_size = 2;
  b.rank = 1;
  a.inputs = a.outputs = b.inputs = b.outputs = {zeros({2})};
  a.thread_index = b.thread_index = 1;
  EXPECT_TRUE(fingerprints_agree({fingerprint(a), fingerprint(b)}));
  EXPECT_EQ(compare(std::vector<const Call*>{&a, &b}, {0, 1}), "");
  b.thread_index = 0;
  EXPECT_FALSE(fingerprints_agree({fingerprint(a), fingerprint(b)}));
  EXPECT_NE(compare(std::vector<const Call*>{&a, &b}, {0, 1}), "");
  EXPECT_STREQ(fingerprint_field(fingerprint(a), fingerprint(b)), "calling thread");
  const auto words = serialize(describe(b));
  const CallDesc back = deserialize(words.data(), words.size());
  EXPECT_EQ(back.thread_index, 0);
  const CallDesc first = describe(a);
  const std::string report = compare(std::vector<const CallDesc*>{&first, &back}, {0, 1});
  EXPECT_EQ(report.rfind("rank 0 (global 0) called all_reduce(float32, in=[2], op=sum) from its "
                         "thread #1 but rank 1 (global 1) called all_reduce(float32, in=[2], "
                         "op=sum) from its thread #0: calling thread differs",
                         0),
            0u)
      << report;
}

}  // namespace diffcomm::dist
