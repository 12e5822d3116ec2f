#include "diffcomm/sim/rank_process.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/prctl.h>

#include <csignal>
#endif

#include "call_codec.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/distributed/stats.hpp"
#include "diffcomm/tensor/error.hpp"
#include "payload_memory.hpp"
#include "wire.hpp"

namespace diffcomm::sim {

using detail::MessageType;
using detail::Reader;
using detail::Writer;

namespace {

constexpr const char* kOp = "diffcomm.sim rank process";

[[noreturn]] void world_gone() {
  raise<BackendError>(kOp,
                      "the simulated world (the process that called diffcomm.sim.run) has "
                      "gone");
}

Reader expect(int fd, MessageType type) {
  auto reply = detail::receive_message(fd);
  if (!reply) world_gone();
  if (reply->type() != type && reply->type() != MessageType::Failed)
    raise<BackendError>(
        kOp, fmt::format("unexpected message {} from the world", static_cast<int>(reply->type())));
  return std::move(*reply);
}

// ------------------------------------------------------------ rank side
// The rank process's end of its socket and payload memory, shared by its
// groups' backends (one per process) and read by its flight recorder's clock.
struct Connection {
  Connection(int socket_fd, int memory_fd) : fd(socket_fd), memory(memory_fd) {}
  int fd;
  detail::PayloadMemory memory;
  double clock_us = 0;  // the rank's simulated clock after its last call
};

class RemoteBackend final : public dist::Backend {
 public:
  RemoteBackend(std::shared_ptr<Connection> c, uint64_t handle, detail::Identity id)
      : conn_(std::move(c)), handle_(handle), id_(std::move(id)) {}

  std::string backend_name() const override { return id_.backend_name; }
  int rank() const override { return id_.rank; }
  int size() const override { return static_cast<int>(id_.members.size()); }
  int global_rank(int r) const override { return id_.members.at(static_cast<std::size_t>(r)); }
  bool supports(const Device& d) const override { return d.is_cpu() && id_.cpu; }
  bool all_reduce_out_of_place() const override { return id_.out_of_place; }
  bool skips_own_block() const override { return id_.skips_own_block; }

  std::shared_ptr<dist::Backend> split(dist::Call& c, int color, int key) override {
    Writer w(MessageType::Split);
    w.put<uint64_t>(handle_);
    detail::put_call(w, c);
    w.put<int32_t>(color);
    w.put<int32_t>(key);
    if (!detail::send_message(conn_->fd, w)) world_gone();
    Reader r = expect(conn_->fd, MessageType::SplitOk);
    if (r.type() == MessageType::Failed) detail::throw_reply_error(r);
    const auto handle = r.get<int64_t>();
    if (handle < 0) return nullptr;
    return std::make_shared<RemoteBackend>(conn_, static_cast<uint64_t>(handle),
                                           detail::get_identity(r));
  }

  void barrier(dist::Call& c) override { forward(c); }
  void all_reduce(dist::Call& c) override { forward(c); }
  void broadcast(dist::Call& c) override { forward(c); }
  void reduce(dist::Call& c) override { forward(c); }
  void all_gather(dist::Call& c) override { forward(c); }
  void all_gather_single(dist::Call& c) override { forward(c); }
  void all_gather_v(dist::Call& c) override { forward(c); }
  void gather(dist::Call& c) override { forward(c); }
  void scatter(dist::Call& c) override { forward(c); }
  void reduce_scatter(dist::Call& c) override { forward(c); }
  void reduce_scatter_single(dist::Call& c) override { forward(c); }
  void reduce_scatter_v(dist::Call& c) override { forward(c); }
  void all_to_all(dist::Call& c) override { forward(c); }
  void all_to_all_single(dist::Call& c) override { forward(c); }
  void send(dist::Call& c) override { forward(c); }
  void recv(dist::Call& c) override { forward(c); }

 private:
  // The Call and its tensors (copied into the payload memory) to the world;
  // on success the written tensors are copied back, else the world's error
  // is rethrown here, as the rank thread would have seen it.
  void forward(dist::Call& c) {
    const detail::StagedTensors staged = detail::stage_tensors(c, conn_->memory);
    Writer w(MessageType::Call);
    w.put<uint64_t>(handle_);
    detail::put_call(w, c);
    w.put<uint64_t>(conn_->memory.size());
    detail::put_tensors(w, staged);
    if (!detail::send_message(conn_->fd, w)) world_gone();
    Reader r = expect(conn_->fd, MessageType::Done);
    if (r.type() == MessageType::Failed) detail::throw_reply_error(r);
    conn_->clock_us = r.get<double>();
    detail::unstage_outputs(staged, conn_->memory);
  }

  std::shared_ptr<Connection> conn_;
  uint64_t handle_;
  detail::Identity id_;
};

// ------------------------------------------------------------ world side
// One rank process's groups on the world side, by the handle its backends
// name them with (0: the world group).
class Served {
 public:
  Served(const ThreadedWorld& world, int rank, const dist::ProcessGroup& group, int memory_fd)
      : world_(world), rank_(rank), memory_(memory_fd) {
    auto keep = std::make_shared<dist::ProcessGroup>(group);
    backends_.emplace_back(keep, &keep->backend());
  }

  Writer go(const std::string& group_name) const {
    Writer w(MessageType::Go);
    detail::put_identity(w, *backends_[0]);
    w.put_string(group_name);
    w.put<double>(clock_us());
    return w;
  }

  Writer call(Reader& r) {
    auto& backend = this->backend(r.get<uint64_t>());
    detail::DecodedCall decoded;
    detail::get_call(r, decoded);
    memory_.follow(static_cast<std::size_t>(r.get<uint64_t>()));
    detail::get_tensors(r, decoded.call, memory_.data());
    return run([&] {
      backend.run(decoded.call);
      Writer w(MessageType::Done);
      w.put<double>(clock_us());
      return w;
    });
  }

  Writer split(Reader& r) {
    auto& backend = this->backend(r.get<uint64_t>());
    detail::DecodedCall decoded;
    detail::get_call(r, decoded);
    const auto color = r.get<int32_t>();
    const auto key = r.get<int32_t>();
    return run([&] {
      auto sub = backend.split(decoded.call, color, key);
      Writer w(MessageType::SplitOk);
      if (!sub) {
        w.put<int64_t>(-1);
        return w;
      }
      w.put<int64_t>(static_cast<int64_t>(backends_.size()));
      detail::put_identity(w, *sub);
      backends_.push_back(std::move(sub));
      return w;
    });
  }

 private:
  dist::Backend& backend(uint64_t handle) const {
    if (handle >= backends_.size())
      raise<BackendError>(kOp, fmt::format("rank {}: no group with handle {}", rank_, handle));
    return *backends_[static_cast<std::size_t>(handle)];
  }
  double clock_us() const { return world_.world().rank_time_us(rank_); }

  // The reply of `op`, or the error it raised as a Failed reply (built
  // after the handler: nothing that may block runs inside one).
  template <class Op>
  Writer run(Op&& op) {
    std::exception_ptr error;
    try {
      return op();
    } catch (...) {
      error = std::current_exception();
    }
    return detail::error_reply(error);
  }

  const ThreadedWorld& world_;
  int rank_;
  detail::PayloadMemory memory_;
  std::vector<std::shared_ptr<dist::Backend>> backends_;
};

}  // namespace

RankProcessEnd serve_rank_process(const ThreadedWorld& world, int rank,
                                  const dist::ProcessGroup& group, int socket_fd, int memory_fd) {
  Served served(world, rank, group, memory_fd);
  if (!detail::send_message(socket_fd, served.go(group.name()))) return {};
  while (auto message = detail::receive_message(socket_fd)) {
    Reader& r = *message;
    switch (r.type()) {
      case MessageType::Call:
        if (!detail::send_message(socket_fd, served.call(r))) return {};
        break;
      case MessageType::Split:
        if (!detail::send_message(socket_fd, served.split(r))) return {};
        break;
      case MessageType::Finish: {
        RankProcessEnd end;
        end.reported = true;
        end.failure = r.get_string();
        end.payload = r.get_string();
        return end;
      }
      default:
        raise<BackendError>(
            kOp, fmt::format("rank {}: unexpected message {}", rank, static_cast<int>(r.type())));
    }
  }
  return {};
}

dist::ProcessGroup connect_rank_process(int socket_fd, int memory_fd) {
#if defined(__linux__)
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the run's caller
#endif
  auto conn = std::make_shared<Connection>(socket_fd, memory_fd);
  Reader go = expect(socket_fd, MessageType::Go);
  if (go.type() == MessageType::Failed) detail::throw_reply_error(go);
  detail::Identity id = detail::get_identity(go);
  std::string name = go.get_string();
  conn->clock_us = go.get<double>();
  // The simulated world's recorder, on the rank's simulated clock (as a
  // thread rank's), which each reply brings back. It holds the connection.
  const Connection* clock = conn.get();
  auto recorder = std::shared_ptr<dist::FlightRecorder>(
      new dist::FlightRecorder(
          [](const void* c) { return static_cast<const Connection*>(c)->clock_us * 1e-6; }, clock),
      [conn](dist::FlightRecorder* r) { delete r; });
  return dist::ProcessGroup(std::make_shared<RemoteBackend>(conn, 0, std::move(id)),
                            std::move(name), std::make_shared<dist::Stats>(), std::move(recorder));
}

bool finish_rank_process(int socket_fd, const std::string& failure, const std::string& payload) {
  Writer w(MessageType::Finish);
  w.put_string(failure);
  w.put_string(payload);
  return detail::send_message(socket_fd, w);
}

}  // namespace diffcomm::sim
