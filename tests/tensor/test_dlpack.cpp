// DLPack interop: zero-copy export and import, ownership hand-over, and the
// checks on what we accept.
#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "tensor/cuda/device_ops.hpp"

namespace diffcomm {
namespace {

struct DLExpect {
  DType dtype;
  uint8_t code;
  uint8_t bits;
};

// The DLPack spelling of every dtype, from the DLPack spec.
const std::vector<DLExpect> kDLTypes = {
    {DType::Float32, kDLFloat, 32},   {DType::Float64, kDLFloat, 64},
    {DType::BFloat16, kDLBfloat, 16}, {DType::Float16, kDLFloat, 16},
    {DType::Int32, kDLInt, 32},       {DType::Int64, kDLInt, 64},
    {DType::UInt8, kDLUInt, 8},
};

// A hand-built producer: owns a buffer, counts deleter calls.
struct Producer {
  std::vector<unsigned char> bytes;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  int deleter_calls = 0;
  DLManagedTensor managed{};

  DLManagedTensor* make(DLDataType dtype, std::vector<int64_t> shp, std::vector<int64_t> str,
                        uint64_t byte_offset, DLDeviceType dev = kDLCPU, int dev_id = 0) {
    shape = std::move(shp);
    strides = std::move(str);
    DLTensor& t = managed.dl_tensor;
    t.data = bytes.data();
    t.device = {dev, dev_id};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dtype;
    t.shape = shape.data();
    t.strides = strides.empty() ? nullptr : strides.data();
    t.byte_offset = byte_offset;
    managed.manager_ctx = this;
    managed.deleter = [](DLManagedTensor* self) {
      ++static_cast<Producer*>(self->manager_ctx)->deleter_calls;
    };
    return &managed;
  }
};

DLDataType dl_float32() { return DLDataType{kDLFloat, 32, 1}; }

// ---------------------------------------------------------------- export

TEST(DLPackExport, DescribesTheTensorForEveryDType) {
  for (const auto& e : kDLTypes) {
    SCOPED_TRACE(dtype_name(e.dtype));
    Tensor t = from_vector({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {2, 3, 2}, e.dtype);
    DLManagedTensor* m = to_dlpack(t);
    ASSERT_NE(m, nullptr);
    ASSERT_NE(m->deleter, nullptr);
    const DLTensor& d = m->dl_tensor;
    EXPECT_EQ(d.data, t.data_ptr());  // zero-copy
    EXPECT_EQ(d.byte_offset, 0u);
    EXPECT_EQ(d.device.device_type, kDLCPU);
    EXPECT_EQ(d.device.device_id, 0);
    EXPECT_EQ(d.dtype.code, e.code);
    EXPECT_EQ(d.dtype.bits, e.bits);
    EXPECT_EQ(d.dtype.lanes, 1);
    ASSERT_EQ(d.ndim, 3);
    EXPECT_EQ(std::vector<int64_t>(d.shape, d.shape + 3), (std::vector<int64_t>{2, 3, 2}));
    ASSERT_NE(d.strides, nullptr);
    // Row-major strides in elements: (3*2, 2, 1).
    EXPECT_EQ(std::vector<int64_t>(d.strides, d.strides + 3), (std::vector<int64_t>{6, 2, 1}));
    m->deleter(m);
  }
}

TEST(DLPackExport, RoundTripIsZeroCopyForEveryDType) {
  for (const auto& e : kDLTypes) {
    SCOPED_TRACE(dtype_name(e.dtype));
    const std::vector<double> values = {0, 1, 2, 3, 4, 5, 6, 7};
    Tensor t = from_vector(values, {4, 2}, e.dtype);
    Tensor back = from_dlpack(to_dlpack(t));
    EXPECT_EQ(back.dtype(), e.dtype);
    EXPECT_EQ(back.shape(), (Shape{4, 2}));
    EXPECT_TRUE(back.device().is_cpu());
    EXPECT_EQ(back.data_ptr(), t.data_ptr());
    EXPECT_EQ(back.to_vector(), values);
    back.row_view(3, 1).fill_(9);  // same memory
    EXPECT_EQ(t.to_vector()[6], 9.0);
    EXPECT_EQ(t.to_vector()[7], 9.0);
  }
}

TEST(DLPackExport, ExportKeepsStorageAliveUntilTheConsumerDeletes) {
  std::vector<float> buf = {1, 2, 3, 4};
  int freed = 0;
  Tensor t = from_blob(buf.data(), {4}, DType::Float32, Device::cpu(), [&](void*) { ++freed; });
  DLManagedTensor* m = to_dlpack(t);
  t = Tensor();
  EXPECT_EQ(freed, 0);  // the export holds the storage
  EXPECT_EQ(static_cast<float*>(m->dl_tensor.data)[2], 3.0f);
  m->deleter(m);
  EXPECT_EQ(freed, 1);
}

TEST(DLPackExport, ImportOfAnExportFreesTheOriginalExactlyOnce) {
  std::vector<double> buf = {1, 2, 3};
  int freed = 0;
  Tensor t = from_blob(buf.data(), {3}, DType::Float64, Device::cpu(), [&](void*) { ++freed; });
  Tensor back = from_dlpack(to_dlpack(t));
  Tensor view = back.row_view(1, 2);
  t = Tensor();
  back = Tensor();
  EXPECT_EQ(freed, 0);
  EXPECT_EQ(view.to_vector(), (std::vector<double>{2, 3}));
  view = Tensor();
  EXPECT_EQ(freed, 1);
}

TEST(DLPackExport, RowViewWithAnOffset) {
  Tensor base = arange(0, 12, 1, DType::Int32).view_as_shape({4, 3});
  Tensor v = base.row_view(2, 2);
  DLManagedTensor* m = to_dlpack(v);
  const DLTensor& d = m->dl_tensor;
  // The view's first element: 2 rows * 3 * 4 bytes past the base, whether
  // expressed through data or byte_offset.
  const char* first = static_cast<const char*>(d.data) + d.byte_offset;
  EXPECT_EQ(first, static_cast<const char*>(base.data_ptr()) + 2 * 3 * 4);
  EXPECT_EQ(std::vector<int64_t>(d.shape, d.shape + 2), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::vector<int64_t>(d.strides, d.strides + 2), (std::vector<int64_t>{3, 1}));
  const auto* p = reinterpret_cast<const int32_t*>(first);
  EXPECT_EQ(std::vector<int32_t>(p, p + 6), (std::vector<int32_t>{6, 7, 8, 9, 10, 11}));

  Tensor back = from_dlpack(m);
  EXPECT_EQ(back.data_ptr(), v.data_ptr());
  EXPECT_EQ(back.to_vector(), (std::vector<double>{6, 7, 8, 9, 10, 11}));
}

TEST(DLPackExport, ZeroDimAndEmptyTensors) {
  Tensor s = full({}, 4.0, DType::Float64);
  Tensor back = from_dlpack(to_dlpack(s));
  EXPECT_EQ(back.dim(), 0);
  EXPECT_EQ(back.item(), 4.0);

  Tensor z = zeros({0, 5}, DType::Float32);
  DLManagedTensor* m = to_dlpack(z);
  EXPECT_EQ(m->dl_tensor.ndim, 2);
  EXPECT_EQ(m->dl_tensor.shape[0], 0);
  EXPECT_EQ(m->dl_tensor.shape[1], 5);
  Tensor zb = from_dlpack(m);
  EXPECT_EQ(zb.shape(), (Shape{0, 5}));
  EXPECT_EQ(zb.numel(), 0);
}

TEST(DLPackExport, UndefinedTensorIsRejected) {
  EXPECT_THROW(to_dlpack(Tensor()), InvalidArgument);
}

// ---------------------------------------------------------------- import

TEST(DLPackImport, HonoursByteOffset) {
  Producer prod;
  prod.bytes.resize(8 * sizeof(float));
  auto* f = reinterpret_cast<float*>(prod.bytes.data());
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(10 * i);
  {
    // Skip two floats: the tensor is elements 2..7 as [2, 3].
    Tensor t = from_dlpack(prod.make(dl_float32(), {2, 3}, {3, 1}, 2 * sizeof(float)));
    EXPECT_EQ(t.data_ptr(), f + 2);
    EXPECT_EQ(t.dtype(), DType::Float32);
    EXPECT_EQ(t.shape(), (Shape{2, 3}));
    EXPECT_EQ(t.to_vector(), (std::vector<double>{20, 30, 40, 50, 60, 70}));
    t.row_view(1, 1).fill_(-1);  // writes land in the producer's buffer
    EXPECT_EQ(f[5], -1.0f);
    EXPECT_EQ(f[7], -1.0f);
    EXPECT_EQ(f[4], 40.0f);
    Tensor keep = t.row_view(0, 1);
    t = Tensor();
    EXPECT_EQ(prod.deleter_calls, 0);
  }
  EXPECT_EQ(prod.deleter_calls, 1);
}

TEST(DLPackImport, NullStridesMeanCompact) {
  Producer prod;
  prod.bytes.resize(6 * sizeof(int64_t));
  auto* p = reinterpret_cast<int64_t*>(prod.bytes.data());
  for (int i = 0; i < 6; ++i) p[i] = i * i;
  {
    Tensor t = from_dlpack(prod.make(DLDataType{kDLInt, 64, 1}, {3, 2}, {}, 0));
    EXPECT_EQ(t.dtype(), DType::Int64);
    EXPECT_EQ(t.to_vector(), (std::vector<double>{0, 1, 4, 9, 16, 25}));
  }
  EXPECT_EQ(prod.deleter_calls, 1);
}

TEST(DLPackImport, EveryDTypeCode) {
  for (const auto& e : kDLTypes) {
    SCOPED_TRACE(dtype_name(e.dtype));
    Producer prod;
    prod.bytes.assign(16, 0);
    {
      Tensor t = from_dlpack(prod.make(DLDataType{e.code, e.bits, 1}, {2}, {1}, 0));
      EXPECT_EQ(t.dtype(), e.dtype);
      EXPECT_EQ(t.to_vector(), (std::vector<double>{0, 0}));
    }
    EXPECT_EQ(prod.deleter_calls, 1);
  }
}

TEST(DLPackImport, SizeOneDimsMayCarryAnyStride) {
  Producer prod;
  prod.bytes.resize(6 * sizeof(float));
  {
    Tensor t = from_dlpack(prod.make(dl_float32(), {2, 1, 3}, {3, 99, 1}, 0));
    EXPECT_EQ(t.shape(), (Shape{2, 1, 3}));
  }
  EXPECT_EQ(prod.deleter_calls, 1);
}

TEST(DLPackImport, RejectsNonContiguousStrides) {
  const std::vector<std::vector<int64_t>> bad = {
      {1, 2},  // column-major [2, 3]
      {6, 2},  // every other element
      {3, 2},  // inner stride 2
      {4, 1},  // padded rows
  };
  for (const auto& strides : bad) {
    Producer prod;
    prod.bytes.resize(16 * sizeof(float));
    DLManagedTensor* m = prod.make(dl_float32(), {2, 3}, strides, 0);
    try {
      from_dlpack(m);
      ADD_FAILURE() << "accepted strides " << strides[0] << ", " << strides[1];
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("contiguous"), std::string::npos) << e.what();
    }
    // On failure ownership stays with the caller: the deleter has not run.
    EXPECT_EQ(prod.deleter_calls, 0);
  }
}

TEST(DLPackImport, RejectsUnsupportedDTypesAndDevices) {
  Producer prod;
  prod.bytes.resize(64);
  EXPECT_THROW(from_dlpack(prod.make(DLDataType{kDLFloat, 32, 4}, {2}, {1}, 0)),
               InvalidArgument);  // vector lanes
  EXPECT_THROW(from_dlpack(prod.make(DLDataType{kDLComplex, 64, 1}, {2}, {1}, 0)), InvalidArgument);
  EXPECT_THROW(from_dlpack(prod.make(DLDataType{kDLInt, 8, 1}, {2}, {1}, 0)), InvalidArgument);
  EXPECT_THROW(from_dlpack(prod.make(DLDataType{kDLUInt, 16, 1}, {2}, {1}, 0)), InvalidArgument);
  EXPECT_THROW(from_dlpack(prod.make(DLDataType{kDLBfloat, 32, 1}, {2}, {1}, 0)), InvalidArgument);
  EXPECT_THROW(from_dlpack(prod.make(dl_float32(), {2}, {1}, 0, kDLOpenCL)), InvalidArgument);
  EXPECT_THROW(from_dlpack(prod.make(dl_float32(), {2}, {1}, 0, kDLCUDAHost)), InvalidArgument);
  EXPECT_THROW(from_dlpack(nullptr), InvalidArgument);
  EXPECT_EQ(prod.deleter_calls, 0);
}

TEST(DLPackImport, CudaDeviceIsMappedWithoutTouchingMemory) {
  // Only metadata is read: the pointer is never dereferenced on import.
  Producer prod;
  prod.bytes.resize(4 * sizeof(float));
  {
    Tensor t = from_dlpack(prod.make(dl_float32(), {4}, {1}, 0, kDLCUDA, 3));
    EXPECT_TRUE(t.device().is_cuda());
    EXPECT_EQ(t.device(), Device::cuda(3));
    EXPECT_EQ(t.shape(), (Shape{4}));
  }
  EXPECT_EQ(prod.deleter_calls, 1);
}

TEST(DLPackImport, NullDeleterIsAllowed) {
  std::vector<float> buf = {1, 2};
  DLManagedTensor m{};
  int64_t shape[1] = {2};
  m.dl_tensor.data = buf.data();
  m.dl_tensor.device = {kDLCPU, 0};
  m.dl_tensor.ndim = 1;
  m.dl_tensor.dtype = dl_float32();
  m.dl_tensor.shape = shape;
  m.deleter = nullptr;
  {
    Tensor t = from_dlpack(&m);
    EXPECT_EQ(t.to_vector(), (std::vector<double>{1, 2}));
  }
  SUCCEED();
}

TEST(DLPackCuda, ExportAndImportACudaTensor) {
  if (!detail::cuda_available()) GTEST_SKIP() << "no CUDA device";
  Tensor t = full({2, 3}, 1.5, DType::Float32, Device::cuda(0));
  DLManagedTensor* m = to_dlpack(t);
  EXPECT_EQ(m->dl_tensor.device.device_type, kDLCUDA);
  EXPECT_EQ(m->dl_tensor.device.device_id, 0);
  EXPECT_EQ(m->dl_tensor.data, t.data_ptr());
  Tensor back = from_dlpack(m);
  EXPECT_EQ(back.device(), Device::cuda(0));
  EXPECT_EQ(back.data_ptr(), t.data_ptr());
  EXPECT_EQ(back.to_vector(), std::vector<double>(6, 1.5));
}

// Found by fuzz/fuzz_dlpack (issue 13): shapes no producer can have are
// refused before t.shape or t.data is read, and the deleter does not run.
TEST(DLPackImport, NegativeNdimOrDimsAndNullPointersAreRefused) {
  int deleted = 0;
  float buffer[6] = {};
  int64_t shape[2] = {2, 3};
  DLManagedTensor m{};
  m.manager_ctx = &deleted;
  m.deleter = [](DLManagedTensor* self) { ++*static_cast<int*>(self->manager_ctx); };
  m.dl_tensor.data = buffer;
  m.dl_tensor.device = {kDLCPU, 0};
  m.dl_tensor.dtype = {kDLFloat, 32, 1};
  m.dl_tensor.shape = shape;
  m.dl_tensor.ndim = -3;
  EXPECT_THROW(from_dlpack(&m), InvalidArgument);
  m.dl_tensor.ndim = 2;
  m.dl_tensor.shape = nullptr;
  EXPECT_THROW(from_dlpack(&m), InvalidArgument);
  m.dl_tensor.shape = shape;
  shape[1] = -3;
  EXPECT_THROW(from_dlpack(&m), InvalidArgument);
  shape[1] = int64_t{1} << 62;  // 2 x 2^62 x 4 bytes overflows
  EXPECT_THROW(from_dlpack(&m), InvalidArgument);
  shape[1] = 3;
  m.dl_tensor.data = nullptr;
  EXPECT_THROW(from_dlpack(&m), InvalidArgument);
  EXPECT_EQ(deleted, 0);
  m.dl_tensor.data = buffer;
  { EXPECT_EQ(from_dlpack(&m).numel(), 6); }
  EXPECT_EQ(deleted, 1);
}

}  // namespace
}  // namespace diffcomm
