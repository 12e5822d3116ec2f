#pragma once
// The byte format between a rank process and the world that serves it
// (rank_process.hpp): length-prefixed messages on a connected AF_UNIX
// stream socket, each a type byte then fields written by Writer and read
// back, in the same order, by Reader. Both ends are the same build on the
// same machine (the child is a fork), so fields are native-endian and
// unversioned.
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace diffcomm::sim::detail {

enum class MessageType : uint8_t {
  // rank process -> world
  Call = 1,    ///< a primitive collective (a dist::Call) to run
  Split = 2,   ///< a group split (Backend::split)
  Finish = 3,  ///< the rank function ended (failure text, payload)
  // world -> rank process
  Go = 10,       ///< the world started the rank: its world group's identity
  Done = 11,     ///< the call ran: the rank's simulated clock
  Failed = 12,   ///< the call raised: the error's kind, site and detail
  SplitOk = 13,  ///< the split ran: the new group's handle and identity (or none)
};

class Writer {
 public:
  explicit Writer(MessageType type) { put(static_cast<uint8_t>(type)); }
  template <class T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const char*>(&v);
    bytes_.append(p, sizeof(T));
  }
  void put_string(std::string_view s) {
    put<uint64_t>(s.size());
    bytes_.append(s.data(), s.size());
  }
  template <class T>
  void put_vector(const std::vector<T>& v) {
    put<uint64_t>(v.size());
    for (const T& x : v) put(x);
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

/// Reads a message's fields; InvalidArgument-free: a short message is a
/// BackendError (the peer is not the other end of this protocol).
class Reader {
 public:
  explicit Reader(std::string bytes);
  MessageType type() const { return type_; }
  template <class T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T v;
    std::memcpy(&v, take(sizeof(T)), sizeof(T));
    return v;
  }
  std::string get_string();
  template <class T>
  std::vector<T> get_vector() {
    const auto n = get<uint64_t>();
    std::vector<T> v;
    v.reserve(static_cast<std::size_t>(n));
    for (uint64_t i = 0; i < n; ++i) v.push_back(get<T>());
    return v;
  }

 private:
  const char* take(std::size_t n);
  std::string bytes_;
  std::size_t at_ = 0;
  MessageType type_;
};

/// Sends one message (retrying on EINTR; no SIGPIPE: a closed peer is an
/// error). Returns false when the peer has gone.
bool send_message(int fd, const Writer& message);
/// Receives one message; nullopt at end of stream (the peer has gone).
/// Throws BackendError for a truncated message.
std::optional<Reader> receive_message(int fd);

}  // namespace diffcomm::sim::detail
