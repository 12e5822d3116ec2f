#pragma once
// A small reader of fuzzer bytes: integers and strings drawn in order, zeros
// once the input is exhausted (FuzzedDataProvider-style, without the header
// dependency).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace diffcomm::fuzz {

class Input {
 public:
  Input(const uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  /// A value in [lo, hi] (hi - lo < 2^63), from up to 8 bytes.
  int64_t range(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
    uint64_t v = raw();
    return span == 0 ? static_cast<int64_t>(v) : lo + static_cast<int64_t>(v % span);
  }
  /// Any int64.
  int64_t any() { return static_cast<int64_t>(raw()); }
  bool flag() { return range(0, 1) == 1; }
  /// Up to max_len bytes as a string (length first).
  std::string text(std::size_t max_len) {
    const auto n = static_cast<std::size_t>(range(0, static_cast<int64_t>(max_len)));
    const std::size_t take = n < size_ - pos_ ? n : size_ - pos_;
    std::string s(reinterpret_cast<const char*>(data_ + pos_), take);
    pos_ += take;
    return s;
  }
  std::string rest() {
    std::string s(reinterpret_cast<const char*>(data_ + pos_), size_ - pos_);
    pos_ = size_;
    return s;
  }
  bool empty() const { return pos_ >= size_; }

 private:
  uint64_t raw() {
    uint64_t v = 0;
    const std::size_t take = size_ - pos_ < 8 ? size_ - pos_ : 8;
    std::memcpy(&v, data_ + pos_, take);
    pos_ += take;
    return v;
  }
  const uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

}  // namespace diffcomm::fuzz
