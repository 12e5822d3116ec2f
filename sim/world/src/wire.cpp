#include "wire.hpp"

#include <sys/socket.h>

#include <cerrno>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim::detail {

Reader::Reader(std::string bytes) : bytes_(std::move(bytes)) {
  type_ = static_cast<MessageType>(get<uint8_t>());
}

const char* Reader::take(std::size_t n) {
  if (bytes_.size() - at_ < n)
    raise<BackendError>("diffcomm.sim rank process", "truncated message from the other end");
  const char* p = bytes_.data() + at_;
  at_ += n;
  return p;
}

std::string Reader::get_string() {
  const auto n = get<uint64_t>();
  return std::string(take(static_cast<std::size_t>(n)), static_cast<std::size_t>(n));
}

namespace {

// All of [p, p+n) or false (peer gone). MSG_NOSIGNAL: a peer that died is
// EPIPE here, not a SIGPIPE that ends this process.
bool send_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

// 1: all read; 0: end of stream before the first byte; -1: cut short.
int receive_all(int fd, char* p, std::size_t n) {
  std::size_t got = 0;
  while (got < n) {
    const ssize_t k = ::recv(fd, p + got, n - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return got == 0 ? 0 : -1;
    got += static_cast<std::size_t>(k);
  }
  return 1;
}

}  // namespace

bool send_message(int fd, const Writer& message) {
  const uint64_t n = message.bytes().size();
  return send_all(fd, reinterpret_cast<const char*>(&n), sizeof n) &&
         send_all(fd, message.bytes().data(), message.bytes().size());
}

std::optional<Reader> receive_message(int fd) {
  uint64_t n = 0;
  if (receive_all(fd, reinterpret_cast<char*>(&n), sizeof n) != 1) return std::nullopt;
  if (n == 0) raise<BackendError>("diffcomm.sim rank process", "empty message from the other end");
  std::string bytes(static_cast<std::size_t>(n), '\0');
  // The peer ending mid-message has gone, as one ending between messages.
  if (receive_all(fd, bytes.data(), bytes.size()) != 1) return std::nullopt;
  return Reader(std::move(bytes));
}

}  // namespace diffcomm::sim::detail
