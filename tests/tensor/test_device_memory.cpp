// The CUDA device policy without a GPU (ctest label `unit`):
//  - DeviceGuard restores the caller's device on return and on exception;
//  - DeviceMemory allocates on the given stream from the chosen allocator,
//    frees on the allocation stream, and makes it wait (events) for every
//    other stream that used the block, recorded on that stream's device;
//  - the per-thread current stream and StreamGuard;
//  - the element arithmetic of the CUDA reduction (reduce_semantics.hpp),
//    compiled here for the host: equal to dist::reduce_into where that is
//    defined, and to the NaN / wrap-around rules where the CPU one is not
//    specified yet.
// All CUDA calls go through a recording fake DeviceApi.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/tensor/cuda.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "tensor/cuda/device_memory.hpp"
#include "tensor/cuda/reduce_semantics.hpp"

namespace diffcomm {
namespace {

using detail::DeviceGuard;
using detail::DeviceMemory;

// Streams and events are opaque handles: small integers cast to pointers.
void* handle(std::uintptr_t v) { return reinterpret_cast<void*>(v); }

class FakeDeviceApi final : public detail::DeviceApi {
 public:
  int device = 0;
  int fail_set_device_to = -1;  // set_device(this) throws
  std::vector<std::string> log;

  int current_device() override { return device; }
  void set_device(int d) override {
    log.push_back("set_device " + std::to_string(d));
    if (d == fail_set_device_to) throw BackendError("fake: cudaSetDevice failed");
    device = d;
  }
  void* create_event() override {
    log.push_back("create_event on " + std::to_string(device));
    return handle(1000 + ++events_);
  }
  void record_event(void* ev, void* stream) override {
    log.push_back("record " + name(ev) + " on " + name(stream) + " dev " + std::to_string(device));
  }
  void stream_wait_event(void* stream, void* ev) override {
    log.push_back(name(stream) + " waits " + name(ev) + " dev " + std::to_string(device));
  }
  void destroy_event(void* ev) noexcept override { log.push_back("destroy " + name(ev)); }

  static std::string name(void* h) { return std::to_string(reinterpret_cast<std::uintptr_t>(h)); }

 private:
  int events_ = 0;
};

class RecordingAllocator final : public cuda::Allocator {
 public:
  // Blocks are fake addresses from `base` on (distinct per allocator).
  explicit RecordingAllocator(FakeDeviceApi& api, std::uintptr_t base = 0x100000)
      : api_(api), next_(base) {}
  struct Event {
    std::string what;
    std::size_t nbytes;
    int device;
    void* stream;
    int current_device;
  };
  std::vector<Event> events;

  void* allocate(std::size_t nbytes, int device, void* stream) override {
    events.push_back({"alloc", nbytes, device, stream, api_.device});
    next_ += 0x10000;
    return handle(next_);
  }
  void deallocate(void*, std::size_t nbytes, int device, void* stream) noexcept override {
    events.push_back({"free", nbytes, device, stream, api_.device});
    api_.log.push_back("free on " + FakeDeviceApi::name(stream) + " dev " +
                       std::to_string(api_.device));
  }
  std::string name() const override { return "recording"; }

 private:
  FakeDeviceApi& api_;
  std::uintptr_t next_;
};

// ---------------------------------------------------------------- DeviceGuard
TEST(DeviceGuard, RestoresTheCallersDeviceOnReturn) {
  FakeDeviceApi api;
  api.device = 3;
  {
    const DeviceGuard g(api, 1);
    EXPECT_EQ(api.device, 1);
    EXPECT_EQ(g.previous(), 3);
  }
  EXPECT_EQ(api.device, 3);
  EXPECT_EQ(api.log, (std::vector<std::string>{"set_device 1", "set_device 3"}));
}

TEST(DeviceGuard, RestoresTheCallersDeviceOnException) {
  FakeDeviceApi api;
  api.device = 2;
  EXPECT_THROW(
      {
        const DeviceGuard g(api, 0);
        EXPECT_EQ(api.device, 0);
        throw std::runtime_error("op failed");
      },
      std::runtime_error);
  EXPECT_EQ(api.device, 2);
}

TEST(DeviceGuard, NoSwitchWhenTheDeviceIsAlreadyCurrent) {
  FakeDeviceApi api;
  api.device = 1;
  { const DeviceGuard g(api, 1); }
  EXPECT_TRUE(api.log.empty());
}

TEST(DeviceGuard, NestedGuardsUnwindInOrder) {
  FakeDeviceApi api;
  api.device = 0;
  {
    const DeviceGuard a(api, 1);
    {
      const DeviceGuard b(api, 2);
      EXPECT_EQ(api.device, 2);
    }
    EXPECT_EQ(api.device, 1);
  }
  EXPECT_EQ(api.device, 0);
}

TEST(DeviceGuard, AFailedSwitchRaisesAndChangesNothing) {
  FakeDeviceApi api;
  api.device = 0;
  api.fail_set_device_to = 5;
  EXPECT_THROW(DeviceGuard(api, 5), BackendError);
  EXPECT_EQ(api.device, 0);
}

TEST(DeviceGuard, AFailedRestoreDoesNotThrowFromTheDestructor) {
  FakeDeviceApi api;
  api.device = 4;
  api.fail_set_device_to = 4;  // restoring fails
  EXPECT_NO_THROW({ const DeviceGuard g(api, 1); });
  EXPECT_EQ(api.device, 1);
}

// ---------------------------------------------------------------- DeviceMemory
TEST(DeviceMemory, AllocatesOnTheStreamWithTheDeviceCurrentAndRestoresIt) {
  FakeDeviceApi api;
  api.device = 0;
  auto alloc = std::make_shared<RecordingAllocator>(api);
  DeviceMemory mem(api, alloc);
  void* p = mem.allocate(256, 1, handle(7));
  ASSERT_EQ(alloc->events.size(), 1u);
  EXPECT_EQ(alloc->events[0].nbytes, 256u);
  EXPECT_EQ(alloc->events[0].device, 1);
  EXPECT_EQ(alloc->events[0].stream, handle(7));
  EXPECT_EQ(alloc->events[0].current_device, 1);  // made current for the call
  EXPECT_EQ(api.device, 0);                       // and restored
  mem.deallocate(p);
  ASSERT_EQ(alloc->events.size(), 2u);
  EXPECT_EQ(alloc->events[1].what, "free");
  EXPECT_EQ(alloc->events[1].stream, handle(7));  // stream order: the allocation stream
  EXPECT_EQ(alloc->events[1].current_device, 1);
  EXPECT_EQ(api.device, 0);
  const cuda::MemoryStats s = mem.stats();
  EXPECT_EQ(s.allocations, 1);
  EXPECT_EQ(s.frees, 1);
  EXPECT_EQ(s.bytes_in_use, 0);
  EXPECT_EQ(s.peak_bytes_in_use, 256);
  EXPECT_EQ(s.cross_stream_frees, 0);
  EXPECT_EQ(s.allocator, "recording");
}

TEST(DeviceMemory, ZeroBytesGetADistinctBlock) {
  FakeDeviceApi api;
  auto alloc = std::make_shared<RecordingAllocator>(api);
  DeviceMemory mem(api, alloc);
  void* a = mem.allocate(0, 0, nullptr);
  void* b = mem.allocate(0, 0, nullptr);
  EXPECT_NE(a, b);
  EXPECT_EQ(alloc->events[0].nbytes, 1u);
  mem.deallocate(a);
  mem.deallocate(b);
}

TEST(DeviceMemory, FreeingAfterUseOnOtherStreamsWaitsForThemByEvents) {
  FakeDeviceApi api;
  api.device = 0;
  auto alloc = std::make_shared<RecordingAllocator>(api);
  DeviceMemory mem(api, alloc);
  char* p = static_cast<char*>(mem.allocate(1024, 0, handle(7)));
  mem.record_use(p + 100, handle(8), 0);   // a view inside the block
  mem.record_use(p, handle(8), 0);         // the same stream twice: one wait
  mem.record_use(p, handle(7), 0);         // the allocation stream: nothing
  mem.record_use(p + 1024, handle(9), 0);  // past the end: another block's business
  api.log.clear();
  mem.deallocate(p);
  EXPECT_EQ(api.log,
            (std::vector<std::string>{"create_event on 0", "record 1001 on 8 dev 0",
                                      "7 waits 1001 dev 0", "destroy 1001", "free on 7 dev 0"}));
  EXPECT_EQ(mem.stats().cross_stream_frees, 1);
}

TEST(DeviceMemory, EventsOfAnotherDevicesStreamAreRecordedOnThatDevice) {
  FakeDeviceApi api;
  api.device = 2;
  auto alloc = std::make_shared<RecordingAllocator>(api);
  DeviceMemory mem(api, alloc);
  void* p = mem.allocate(64, 0, handle(7));
  mem.record_use(p, handle(11), 1);  // e.g. a peer copy on device 1's stream
  api.log.clear();
  mem.deallocate(p);
  EXPECT_EQ(api.log, (std::vector<std::string>{"set_device 0", "set_device 1", "create_event on 1",
                                               "record 1001 on 11 dev 1", "set_device 0",
                                               "7 waits 1001 dev 0", "destroy 1001",
                                               "free on 7 dev 0", "set_device 2"}));
  EXPECT_EQ(api.device, 2);
}

TEST(DeviceMemory, AForgottenStreamIsNotWaitedFor) {
  FakeDeviceApi api;
  auto alloc = std::make_shared<RecordingAllocator>(api);
  DeviceMemory mem(api, alloc);
  void* p = mem.allocate(64, 0, handle(7));
  mem.record_use(p, handle(8), 0);
  mem.record_use(p, handle(9), 0);
  mem.forget_stream(handle(8), 0);  // idle, about to be destroyed
  api.log.clear();
  mem.deallocate(p);
  EXPECT_EQ(api.log,
            (std::vector<std::string>{"create_event on 0", "record 1001 on 9 dev 0",
                                      "7 waits 1001 dev 0", "destroy 1001", "free on 7 dev 0"}));
}

TEST(DeviceMemory, UnknownPointersAreIgnored) {
  FakeDeviceApi api;
  auto alloc = std::make_shared<RecordingAllocator>(api);
  DeviceMemory mem(api, alloc);
  int borrowed = 0;  // e.g. from_blob memory of a trainer
  mem.record_use(&borrowed, handle(3), 0);
  mem.deallocate(&borrowed);
  EXPECT_TRUE(alloc->events.empty());
  EXPECT_EQ(mem.stats().frees, 0);
}

TEST(DeviceMemory, BlocksGoBackToTheAllocatorTheyCameFrom) {
  FakeDeviceApi api;
  auto first = std::make_shared<RecordingAllocator>(api);
  auto second = std::make_shared<RecordingAllocator>(api, 0x900000);
  DeviceMemory mem(api, first);
  void* a = mem.allocate(8, 0, nullptr);
  mem.set_allocator(second);  // e.g. a trainer's caching allocator
  EXPECT_EQ(mem.allocator(), second);
  void* b = mem.allocate(8, 0, nullptr);
  mem.deallocate(a);
  mem.deallocate(b);
  ASSERT_EQ(first->events.size(), 2u);
  EXPECT_EQ(first->events[1].what, "free");
  ASSERT_EQ(second->events.size(), 2u);
  EXPECT_EQ(second->events[1].what, "free");
  mem.set_allocator(nullptr);  // back to the default
  EXPECT_EQ(mem.allocator(), first);
}

TEST(DeviceMemory, AFailedEventStillReturnsTheBlock) {
  FakeDeviceApi api;
  api.device = 0;
  auto alloc = std::make_shared<RecordingAllocator>(api);
  DeviceMemory mem(api, alloc);
  void* p = mem.allocate(8, 1, handle(7));
  mem.record_use(p, handle(8), 1);
  api.fail_set_device_to = 1;  // the device is gone (e.g. at exit)
  EXPECT_NO_THROW(mem.deallocate(p));
  ASSERT_EQ(alloc->events.size(), 2u);
  EXPECT_EQ(alloc->events[1].what, "free");
}

TEST(DeviceMemory, WithoutAnAllocatorAllocationIsRefused) {
  FakeDeviceApi api;
  DeviceMemory mem(api, nullptr);
  EXPECT_THROW(mem.allocate(8, 0, nullptr), InvalidArgument);
}

// ---------------------------------------------------------------- current stream
TEST(CurrentStream, DefaultsToTheLegacyStreamPerDeviceAndThread) {
  EXPECT_EQ(cuda::current_stream(0), nullptr);
  EXPECT_EQ(cuda::current_stream(5), nullptr);
  {
    const cuda::StreamGuard g(1, handle(42));
    EXPECT_EQ(cuda::current_stream(1), handle(42));
    EXPECT_EQ(cuda::current_stream(0), nullptr);
    void* other_thread = handle(1);
    std::thread([&] { other_thread = cuda::current_stream(1); }).join();
    EXPECT_EQ(other_thread, nullptr);
    {
      const cuda::StreamGuard inner(1, handle(43));
      EXPECT_EQ(cuda::current_stream(1), handle(43));
    }
    EXPECT_EQ(cuda::current_stream(1), handle(42));
  }
  EXPECT_EQ(cuda::current_stream(1), nullptr);
  EXPECT_THROW(cuda::set_current_stream(-1, nullptr), InvalidArgument);
}

TEST(CurrentStream, StreamGuardRestoresOnException) {
  EXPECT_THROW(
      {
        const cuda::StreamGuard g(0, handle(9));
        throw std::runtime_error("x");
      },
      std::runtime_error);
  EXPECT_EQ(cuda::current_stream(0), nullptr);
}

// ---------------------------------------------------------------- arithmetic
namespace rs = detail::rs;

static_assert(static_cast<int>(dist::ReduceOp::Sum) == static_cast<int>(rs::Op::Sum));
static_assert(static_cast<int>(dist::ReduceOp::Avg) == static_cast<int>(rs::Op::Avg));
static_assert(static_cast<int>(dist::ReduceOp::Product) == static_cast<int>(rs::Op::Product));
static_assert(static_cast<int>(dist::ReduceOp::Min) == static_cast<int>(rs::Op::Min));
static_assert(static_cast<int>(dist::ReduceOp::Max) == static_cast<int>(rs::Op::Max));

TEST(ReduceSemantics, SixteenBitConversionsMatchTheCpuTypes) {
  std::mt19937 rng(7);
  std::vector<float> samples = {0.0f,
                                -0.0f,
                                1.0f,
                                65504.0f,
                                65520.0f,
                                1e-8f,
                                5.96e-8f,
                                2.98e-8f,
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN(),
                                -std::nanf("1")};
  for (int i = 0; i < 200000; ++i)
    samples.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  for (float f : samples) {
    ASSERT_EQ(rs::bf16_from_float(f), bfloat16::from_float(f)) << f;
    ASSERT_EQ(rs::f16_from_float(f), float16::from_float(f)) << f;
  }
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const auto b = static_cast<uint16_t>(h);
    ASSERT_EQ(std::bit_cast<uint32_t>(rs::f16_to_float(b)),
              std::bit_cast<uint32_t>(float16::to_float(b)))
        << h;
  }
}

// dist::reduce_into and the device element rule on the same random data.
template <class T>
void expect_like_reduce_into(DType dtype, dist::ReduceOp op, int k, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-3.0, 3.0);
  std::vector<Tensor> in;
  for (int j = 0; j < k; ++j) {
    Tensor t = empty({n}, dtype, Device::cpu());
    T* p = static_cast<T*>(t.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      const double v = u(rng);
      if constexpr (std::is_integral_v<T>)
        p[i] = static_cast<T>(std::lround(v * 10));
      else
        p[i] = static_cast<T>(static_cast<compute_t<T>>(j == 0 ? v * 256 : v));  // cancellations
    }
    in.push_back(t);
  }
  Tensor want = empty({n}, dtype, Device::cpu());
  dist::reduce_into(want, in, op);
  using S = std::conditional_t<std::is_same_v<T, bfloat16>, rs::Bf16Bits,
                               std::conditional_t<std::is_same_v<T, float16>, rs::F16Bits, T>>;
  const T* w = static_cast<const T*>(want.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const S got = rs::reduce_element<S>(
        static_cast<rs::Op>(static_cast<int>(op.kind())), k,
        [&](int j) {
          return std::bit_cast<S>(
              static_cast<const T*>(in[static_cast<std::size_t>(j)].data_ptr())[i]);
        },
        op.factor());
    ASSERT_EQ(std::memcmp(&w[i], &got, sizeof(S)), 0)
        << dtype_name(dtype) << " " << dist::reduce_op_name(op) << " k=" << k << " i=" << i;
  }
}

TEST(ReduceSemantics, EqualsReduceIntoBitForBit) {
  using dist::ReduceOp;
  for (int k : {1, 2, 3, 5, 8, 40}) {
    for (ReduceOp op :
         {ReduceOp(ReduceOp::Sum), ReduceOp(ReduceOp::Avg), ReduceOp(ReduceOp::Product),
          ReduceOp(ReduceOp::Min), ReduceOp(ReduceOp::Max), ReduceOp::premul_sum(-0.3)}) {
      const auto seed = static_cast<uint32_t>(k * 10 + static_cast<int>(op.kind()));
      expect_like_reduce_into<float>(DType::Float32, op, k, 257, seed);
      expect_like_reduce_into<double>(DType::Float64, op, k, 257, seed);
      expect_like_reduce_into<bfloat16>(DType::BFloat16, op, k, 257, seed);
      expect_like_reduce_into<float16>(DType::Float16, op, k, 257, seed);
      if (op != ReduceOp::Avg && op != ReduceOp::Product && op != ReduceOp::PremulSum) {
        expect_like_reduce_into<int32_t>(DType::Int32, op, k, 257, seed);
        expect_like_reduce_into<int64_t>(DType::Int64, op, k, 257, seed);
      }
    }
  }
}

// The examples of issue 11: one rounding at the end, not per combine.
TEST(ReduceSemantics, SixteenBitSumsRoundOnce) {
  auto bf = [](float f) { return rs::Bf16Bits{bfloat16::from_float(f)}; };
  const std::vector<rs::Bf16Bits> four = {bf(256), bf(1), bf(1), bf(1)};
  const auto s = rs::reduce_element<rs::Bf16Bits>(
      rs::Op::Sum, 4, [&](int j) { return four[static_cast<std::size_t>(j)]; });
  EXPECT_EQ(rs::bf16_to_float(s.bits), 260.0f);  // 259 is a tie: to even
  auto hf = [](float f) { return rs::F16Bits{float16::from_float(f)}; };
  const std::vector<rs::F16Bits> h = {hf(2048), hf(1), hf(1), hf(1)};
  const auto t = rs::reduce_element<rs::F16Bits>(
      rs::Op::Sum, 4, [&](int j) { return h[static_cast<std::size_t>(j)]; });
  EXPECT_EQ(rs::f16_to_float(t.bits), 2052.0f);
  // float64 Avg of 5, 0, 0 is 5/3 rounded once.
  const std::vector<double> d = {5, 0, 0};
  EXPECT_EQ(rs::reduce_element<double>(rs::Op::Avg, 3,
                                       [&](int j) { return d[static_cast<std::size_t>(j)]; }),
            5.0 / 3.0);
}

TEST(ReduceSemantics, MaxAndMinPropagateNaNInEitherPosition) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (rs::Op op : {rs::Op::Max, rs::Op::Min}) {
    const std::vector<std::vector<float>> cases = {{nan, 1, 2}, {1, nan, 2}, {1, 2, nan}};
    for (const auto& c : cases)
      EXPECT_TRUE(std::isnan(
          rs::reduce_element<float>(op, 3, [&](int j) { return c[static_cast<std::size_t>(j)]; })));
    auto bf = [](float f) { return rs::Bf16Bits{bfloat16::from_float(f)}; };
    const std::vector<rs::Bf16Bits> b = {bf(1), bf(nan)};
    EXPECT_EQ(rs::reduce_element<rs::Bf16Bits>(
                  op, 2, [&](int j) { return b[static_cast<std::size_t>(j)]; })
                  .bits,
              0x7FC0);
  }
  // Ties between -0 and +0: the earlier input wins (std::max / std::min).
  const std::vector<float> z = {-0.0f, 0.0f};
  EXPECT_TRUE(std::signbit(rs::reduce_element<float>(
      rs::Op::Max, 2, [&](int j) { return z[static_cast<std::size_t>(j)]; })));
  EXPECT_TRUE(std::signbit(rs::reduce_element<float>(
      rs::Op::Min, 2, [&](int j) { return z[static_cast<std::size_t>(j)]; })));
}

TEST(ReduceSemantics, IntegerSumAndProductWrapAround) {
  const std::vector<int32_t> a = {std::numeric_limits<int32_t>::max(), 1};
  EXPECT_EQ(rs::reduce_element<int32_t>(rs::Op::Sum, 2,
                                        [&](int j) { return a[static_cast<std::size_t>(j)]; }),
            std::numeric_limits<int32_t>::min());
  const std::vector<int64_t> b = {std::numeric_limits<int64_t>::min(), -1};
  EXPECT_EQ(rs::reduce_element<int64_t>(rs::Op::Sum, 2,
                                        [&](int j) { return b[static_cast<std::size_t>(j)]; }),
            std::numeric_limits<int64_t>::max());
  const std::vector<int32_t> c = {65536, 65536};
  EXPECT_EQ(rs::reduce_element<int32_t>(rs::Op::Product, 2,
                                        [&](int j) { return c[static_cast<std::size_t>(j)]; }),
            0);
  const std::vector<uint8_t> d = {200, 100};
  EXPECT_EQ(rs::reduce_element<uint8_t>(rs::Op::Sum, 2,
                                        [&](int j) { return d[static_cast<std::size_t>(j)]; }),
            44);
  EXPECT_EQ(rs::reduce_element<uint8_t>(rs::Op::Product, 2,
                                        [&](int j) { return d[static_cast<std::size_t>(j)]; }),
            static_cast<uint8_t>(20000 % 256));
}

}  // namespace
}  // namespace diffcomm
