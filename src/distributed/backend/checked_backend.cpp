// Cross-rank checks for production backends (see checked_backend.hpp).
#include "diffcomm/distributed/backend/checked_backend.hpp"

#include <fmt/format.h>

#include <cstring>

#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {
namespace {

// A control step of `user` (fingerprints travel as int64).
Call control_call(const Call& user, OpType op) {
  Call c = user.step(op);
  c.dtype = DType::Int64;
  return c;
}

Tensor int64_tensor(const std::vector<int64_t>& words, const Device& device) {
  Tensor cpu = empty({static_cast<int64_t>(words.size())}, DType::Int64);
  if (!words.empty()) std::memcpy(cpu.data_ptr(), words.data(), words.size() * sizeof(int64_t));
  return device.is_cpu() ? cpu : cpu.to(device);
}
std::vector<int64_t> words_of(const Tensor& t) {
  const Tensor cpu = t.device().is_cpu() ? t : t.to(Device::cpu());
  std::vector<int64_t> w(static_cast<std::size_t>(cpu.numel()));
  if (!w.empty()) std::memcpy(w.data(), cpu.data_ptr(), w.size() * sizeof(int64_t));
  return w;
}

// Envelope of a send/recv: dtype, rank, up to 8 dims (a hash beyond), tag.
constexpr int64_t kEnvelopeWords = 11;
std::vector<int64_t> envelope(const Call& c, const Tensor& t) {
  std::vector<int64_t> w(kEnvelopeWords, 0);
  w[0] = static_cast<int64_t>(c.dtype);
  w[1] = t.dim();
  for (int64_t d = 0; d < std::min<int64_t>(t.dim(), 8); ++d)
    w[static_cast<size_t>(2 + d)] = t.size(d);
  w[10] = c.tag;
  return w;
}
CallDesc from_envelope(const std::vector<int64_t>& w, OpType op, int peer) {
  CallDesc d;
  d.op = op;
  d.dtype = static_cast<DType>(w[0]);
  d.root = peer;
  d.tag = static_cast<int>(w[10]);
  Shape s;
  for (int64_t k = 0; k < std::min<int64_t>(w[1], 8); ++k)
    s.push_back(w[static_cast<size_t>(2 + k)]);
  (op == OpType::Send ? d.inputs : d.outputs).push_back(s);
  return d;
}

}  // namespace

CheckedBackend::CheckedBackend(std::shared_ptr<Backend> inner, std::shared_ptr<Backend> control,
                               Device control_device)
    : ForwardingBackend(std::move(inner)), control_(std::move(control)), device_(control_device) {
  if (!control_) raise("CheckedBackend", "null backend");
  if (control_->size() != size() || control_->rank() != rank())
    raise("CheckedBackend", "control backend has other members than the data one");
}

void CheckedBackend::forward(Call& c) {
  if (c.op == OpType::Send)
    check_send(c);
  else if (c.op == OpType::Recv)
    check_recv(c);
  else
    check(c);
  inner().run(c);
}

void CheckedBackend::check(const Call& call) {
  const std::string report = agree(call, "");
  if (!report.empty()) throw CollectiveMismatch(call.site(), "collective mismatch: " + report);
}

bool CheckedBackend::announce_refusal(const Call& call, const std::string& error) {
  if (call.op == OpType::Send || call.op == OpType::Recv) return false;
  agree(call, error.empty() ? "refused" : error);
  return true;
}

std::string CheckedBackend::agree(const Call& call, const std::string& refused) {
  const int n = call.group_size;
  const Fingerprint mine = refused.empty() ? fingerprint(call) : refusal_fingerprint(call);
  Tensor all = empty({static_cast<int64_t>(n * kFingerprintWords)}, DType::Int64, device_);
  Call gather = control_call(call, OpType::AllGatherSingle);
  gather.inputs = {int64_tensor(std::vector<int64_t>(mine.begin(), mine.end()), device_)};
  gather.outputs = {all};
  control_->all_gather_single(gather);
  const std::vector<int64_t> words = words_of(all);
  std::vector<Fingerprint> prints(static_cast<std::size_t>(n));
  for (std::size_t r = 0; r < prints.size(); ++r)
    std::memcpy(prints[r].data(), words.data() + r * kFingerprintWords,
                kFingerprintWords * sizeof(int64_t));
  if (fingerprints_agree(prints)) return "";

  // Rare path: gather every member's full description and explain the
  // difference with the simulated world's compare(). Every member runs this
  // on the same data, so every member raises the same report.
  CallDesc own = describe(call);
  own.refused = refused;
  const std::vector<int64_t> desc = serialize(own);
  Tensor lengths = empty({n}, DType::Int64, device_);
  Call len_gather = control_call(call, OpType::AllGatherSingle);
  len_gather.inputs = {int64_tensor({static_cast<int64_t>(desc.size())}, device_)};
  len_gather.outputs = {lengths};
  control_->all_gather_single(len_gather);
  const std::vector<int64_t> lens = words_of(lengths);
  int64_t total = 0;
  for (int64_t l : lens) total += l;
  Tensor descs = empty({total}, DType::Int64, device_);
  Call desc_gather = control_call(call, OpType::AllGatherV);
  desc_gather.inputs = {int64_tensor(desc, device_)};
  desc_gather.outputs = {descs};
  desc_gather.output_splits = lens;
  control_->all_gather_v(desc_gather);
  const std::vector<int64_t> all_desc = words_of(descs);
  std::vector<CallDesc> calls;
  std::size_t at = 0;
  for (int64_t l : lens) {
    calls.push_back(deserialize(all_desc.data() + at, static_cast<std::size_t>(l)));
    at += static_cast<std::size_t>(l);
  }
  std::vector<const CallDesc*> ptrs;
  std::vector<int> globals;
  for (int r = 0; r < n; ++r) {
    ptrs.push_back(&calls[static_cast<std::size_t>(r)]);
    globals.push_back(global_rank(r));
  }
  std::string report = compare(ptrs, globals);
  if (report.empty()) {
    // Only fields compare() does not look at differ (the call number, when
    // members issued different numbers of calls on this group): name the
    // first fingerprint field in which a member differs from member 0.
    std::size_t r = 1;
    while (r < prints.size() && prints[r] == prints[0]) ++r;
    if (r == prints.size()) r = 1;  // only the split sums disagree: name a pair
    const char* field = fingerprint_field(prints[0], prints[r]);
    report =
        fmt::format("{} called {} #{} but {} called {} #{}: {} differs", rank_label(0, globals[0]),
                    signature(calls[0]), calls[0].seq, rank_label(static_cast<int>(r), globals[r]),
                    signature(calls[r]), calls[r].seq, *field != '\0' ? field : "splits");
  }
  std::vector<std::string> callers;
  for (const CallDesc& c : calls) callers.push_back(c.caller);
  return report + call_sites(callers, globals);
}

std::shared_ptr<Backend> CheckedBackend::split(Call& call, int color, int key) {
  check(call);
  std::shared_ptr<Backend> data = inner().split(call, color, key);
  Call control = call;
  std::shared_ptr<Backend> ctl = control_->split(control, color, key);
  if (!data) return nullptr;
  return std::make_shared<CheckedBackend>(std::move(data), std::move(ctl), device_);
}

// Point to point: the sender sends its envelope, the receiver compares it with
// its buffer and answers 1 (go) or 0 (mismatch); both raise on 0.
void CheckedBackend::check_send(const Call& c) {
  const int peer = c.root;
  Call env = control_call(c, OpType::Send);
  env.root = peer;
  env.tag = c.tag;
  env.inputs = {int64_tensor(envelope(c, c.inputs[0]), device_)};
  control_->send(env);
  Tensor answer = empty({kEnvelopeWords + 1}, DType::Int64, device_);
  Call ack = control_call(c, OpType::Recv);
  ack.root = peer;
  ack.tag = c.tag;
  ack.outputs = {answer};
  control_->recv(ack);
  const std::vector<int64_t> a = words_of(answer);
  if (a[0] != 1) {
    const CallDesc theirs =
        from_envelope(std::vector<int64_t>(a.begin() + 1, a.end()), OpType::Recv, c.rank);
    throw CollectiveMismatch(
        c.site(), "collective mismatch: " + compare_p2p(describe(c), c.rank, global_rank(c.rank),
                                                        theirs, peer, global_rank(peer)));
  }
}

void CheckedBackend::check_recv(const Call& c) {
  const int peer = c.root;
  Tensor theirs_t = empty({kEnvelopeWords}, DType::Int64, device_);
  Call env = control_call(c, OpType::Recv);
  env.root = peer;
  env.tag = c.tag;
  env.outputs = {theirs_t};
  control_->recv(env);
  const CallDesc theirs = from_envelope(words_of(theirs_t), OpType::Send, c.rank);
  const std::string report =
      compare_p2p(theirs, peer, global_rank(peer), describe(c), c.rank, global_rank(c.rank));
  std::vector<int64_t> answer = {report.empty() ? 1 : 0};
  const std::vector<int64_t> mine = envelope(c, c.outputs[0]);
  answer.insert(answer.end(), mine.begin(), mine.end());
  Call ack = control_call(c, OpType::Send);
  ack.root = peer;
  ack.tag = c.tag;
  ack.inputs = {int64_tensor(answer, device_)};
  control_->send(ack);
  if (!report.empty()) throw CollectiveMismatch(c.site(), "collective mismatch: " + report);
}

}  // namespace diffcomm::dist
