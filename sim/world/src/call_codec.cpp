#include "call_codec.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim::detail {

// ------------------------------------------------------------- identity
void put_identity(Writer& w, const dist::Backend& b) {
  w.put_string(b.backend_name());
  w.put<int32_t>(b.rank());
  std::vector<int32_t> members;
  for (int r = 0; r < b.size(); ++r) members.push_back(b.global_rank(r));
  w.put_vector(members);
  w.put<uint8_t>(b.supports(Device::cpu()));
  w.put<uint8_t>(b.all_reduce_out_of_place());
  w.put<uint8_t>(b.skips_own_block());
}

Identity get_identity(Reader& r) {
  Identity id;
  id.backend_name = r.get_string();
  id.rank = r.get<int32_t>();
  for (int32_t m : r.get_vector<int32_t>()) id.members.push_back(m);
  id.cpu = r.get<uint8_t>() != 0;
  id.out_of_place = r.get<uint8_t>() != 0;
  id.skips_own_block = r.get<uint8_t>() != 0;
  return id;
}

// ------------------------------------------------------------- the call
namespace {

void put_splits(Writer& w, const dist::SplitList& s) {
  w.put<uint8_t>(s.is_uniform());
  w.put<uint64_t>(s.size());
  if (s.is_uniform())
    w.put<int64_t>(s.uniform_value());
  else
    w.put_vector(s.to_vector());
}

dist::SplitList get_splits(Reader& r) {
  const bool uniform = r.get<uint8_t>() != 0;
  const auto n = r.get<uint64_t>();
  if (uniform) return dist::SplitList::uniform(static_cast<std::size_t>(n), r.get<int64_t>());
  return dist::SplitList(r.get_vector<int64_t>());
}

// part_of names one of the ops (op_cstr): the world side points at the
// same static name, so it outlives the call like the rank's did.
const char* static_op_name(const std::string& name) {
  for (int op = 0; op <= static_cast<int>(dist::OpType::NewGroup); ++op)
    if (name == dist::op_cstr(static_cast<dist::OpType>(op)))
      return dist::op_cstr(static_cast<dist::OpType>(op));
  return nullptr;
}

}  // namespace

void put_call(Writer& w, const dist::Call& c) {
  w.put<uint8_t>(static_cast<uint8_t>(c.op));
  w.put<uint64_t>(c.seq);
  w.put_string(c.group);
  w.put<int32_t>(c.rank);
  w.put<int32_t>(c.group_size);
  w.put<uint8_t>(static_cast<uint8_t>(c.dtype));
  w.put<int32_t>(c.root);
  w.put<int32_t>(c.tag);
  w.put<uint8_t>(c.reduce_op.kind());
  w.put<double>(c.reduce_op.factor());
  put_splits(w, c.input_splits);
  put_splits(w, c.output_splits);
  w.put<int32_t>(c.color);
  w.put<int32_t>(c.key);
  w.put_vector(c.members);
  w.put<uint8_t>(c.members_are_ranks);
  w.put<uint64_t>(c.bytes_sent);
  w.put<uint64_t>(c.bytes_received);
  w.put_string(c.part_of != nullptr ? c.part_of : "");
  w.put<uint8_t>(c.own_block_placed);
  w.put<uint8_t>(c.backward_of.has_value());
  if (c.backward_of) {
    w.put<uint8_t>(static_cast<uint8_t>(c.backward_of->op));
    w.put<uint64_t>(c.backward_of->seq);
  }
  w.put<int32_t>(c.thread_index);
  w.put_string(c.caller.file ? c.caller.file : "");
  w.put<uint32_t>(c.caller.line);
}

void get_call(Reader& r, DecodedCall& out) {
  dist::Call& c = out.call;
  c.op = static_cast<dist::OpType>(r.get<uint8_t>());
  c.seq = r.get<uint64_t>();
  out.group = r.get_string();
  c.group = out.group;
  c.rank = r.get<int32_t>();
  c.group_size = r.get<int32_t>();
  c.dtype = static_cast<DType>(r.get<uint8_t>());
  c.root = r.get<int32_t>();
  c.tag = r.get<int32_t>();
  const auto kind = static_cast<dist::ReduceOp::Kind>(r.get<uint8_t>());
  const auto factor = r.get<double>();
  c.reduce_op =
      kind == dist::ReduceOp::PremulSum ? dist::ReduceOp::premul_sum(factor) : dist::ReduceOp(kind);
  c.input_splits = get_splits(r);
  c.output_splits = get_splits(r);
  c.color = r.get<int32_t>();
  c.key = r.get<int32_t>();
  c.members = r.get_vector<int64_t>();
  c.members_are_ranks = r.get<uint8_t>() != 0;
  c.bytes_sent = r.get<uint64_t>();
  c.bytes_received = r.get<uint64_t>();
  out.part_of = r.get_string();
  c.part_of = static_op_name(out.part_of);
  c.own_block_placed = r.get<uint8_t>() != 0;
  if (r.get<uint8_t>() != 0) {
    const auto op = static_cast<dist::OpType>(r.get<uint8_t>());
    c.backward_of = dist::CallId{op, r.get<uint64_t>()};
  }
  c.thread_index = r.get<int32_t>();
  const std::string file = r.get_string();
  c.caller.file = file.empty() ? nullptr : dist::intern_file(file);
  c.caller.line = r.get<uint32_t>();
}

// ------------------------------------------------------------- tensors
namespace {

constexpr std::size_t kAlign = 64;

std::size_t aligned(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Span {
  char* begin;
  char* end;
  bool output;
};

// The runs of overlapping spans, in address order, placed one after another.
std::vector<StagedTensors::Run> runs_of(std::vector<Span> spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  std::vector<StagedTensors::Run> runs;
  char* end = nullptr;
  for (const Span& s : spans) {
    if (!runs.empty() && s.begin < end) {
      end = std::max(end, s.end);
      runs.back().bytes = static_cast<std::size_t>(end - runs.back().at);
      runs.back().written = runs.back().written || s.output;
      continue;
    }
    const std::size_t offset = runs.empty() ? 0 : aligned(runs.back().offset + runs.back().bytes);
    runs.push_back({s.begin, static_cast<std::size_t>(s.end - s.begin), offset, s.output});
    end = s.end;
  }
  return runs;
}

StagedTensors::Place place_of(const Tensor& t, const std::vector<StagedTensors::Run>& runs) {
  StagedTensors::Place p{0, t.dtype(), t.shape()};
  if (t.nbytes() == 0) return p;
  auto* at = static_cast<char*>(t.data_ptr());
  for (const auto& run : runs)
    if (at >= run.at && at < run.at + run.bytes) p.offset = run.offset + (at - run.at);
  return p;
}

void put_places(Writer& w, const std::vector<StagedTensors::Place>& places) {
  w.put<uint64_t>(places.size());
  for (const auto& p : places) {
    w.put<uint64_t>(p.offset);
    w.put<uint8_t>(static_cast<uint8_t>(p.dtype));
    w.put_vector(p.shape);
  }
}

}  // namespace

StagedTensors stage_tensors(const dist::Call& c, PayloadMemory& memory) {
  std::vector<Span> spans;
  auto add = [&](const dist::TensorList& list, bool output) {
    for (const Tensor& t : list) {
      if (!t.device().is_cpu())
        raise(c.site(), "the simulated world's rank processes take CPU tensors only");
      if (t.nbytes() == 0) continue;
      auto* at = static_cast<char*>(t.data_ptr());
      spans.push_back({at, at + t.nbytes(), output});
    }
  };
  add(c.inputs, false);
  add(c.outputs, true);
  StagedTensors s;
  s.runs = runs_of(std::move(spans));
  const std::size_t total = s.runs.empty() ? 0 : s.runs.back().offset + s.runs.back().bytes;
  memory.reserve(total);
  for (const auto& run : s.runs) std::memcpy(memory.data() + run.offset, run.at, run.bytes);
  for (const Tensor& t : c.inputs) s.inputs.push_back(place_of(t, s.runs));
  for (const Tensor& t : c.outputs) s.outputs.push_back(place_of(t, s.runs));
  return s;
}

void put_tensors(Writer& w, const StagedTensors& staged) {
  put_places(w, staged.inputs);
  put_places(w, staged.outputs);
}

void unstage_outputs(const StagedTensors& staged, const PayloadMemory& memory) {
  for (const auto& run : staged.runs)
    if (run.written) std::memcpy(run.at, memory.data() + run.offset, run.bytes);
}

void get_tensors(Reader& r, dist::Call& c, char* base) {
  // One handle per distinct (place, dtype, shape): an in-place call's input
  // and output are one tensor on this side too.
  std::map<std::tuple<uint64_t, uint8_t, Shape>, Tensor> made;
  auto list = [&] {
    std::vector<Tensor> ts;
    const auto n = r.get<uint64_t>();
    for (uint64_t i = 0; i < n; ++i) {
      const auto offset = r.get<uint64_t>();
      const auto dtype = r.get<uint8_t>();
      Shape shape = r.get_vector<int64_t>();
      auto key = std::make_tuple(offset, dtype, shape);
      auto it = made.find(key);
      if (it == made.end()) {
        const auto dt = static_cast<DType>(dtype);
        const bool none = std::find(shape.begin(), shape.end(), 0) != shape.end();
        Tensor t = none ? empty(shape, dt) : from_blob(base + offset, shape, dt);
        it = made.emplace(key, std::move(t)).first;
      }
      ts.push_back(it->second);
    }
    return ts.size() == 1 ? dist::TensorList(ts[0]) : dist::TensorList(std::move(ts));
  };
  c.inputs = list();
  c.outputs = list();
}

// ------------------------------------------------------------- errors
Writer error_reply(const std::exception_ptr& error) {
  Writer w(MessageType::Failed);
  ErrorKind kind = ErrorKind::Error;
  ErrorSite site;
  std::string detail;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    kind = e.kind();
    site = e.site();
    detail = std::string(e.detail());
  } catch (const std::bad_alloc& e) {
    kind = ErrorKind::ResourceExhausted;
    detail = bad_alloc_detail(e.what());
  } catch (const std::exception& e) {
    detail = e.what();
  } catch (...) {
    detail = "unknown exception";
  }
  w.put<uint8_t>(static_cast<uint8_t>(kind));
  w.put_string(site.op);
  w.put<uint8_t>(site.call.has_value());
  w.put<uint64_t>(site.call.value_or(0));
  w.put<uint8_t>(site.group.has_value());
  w.put_string(site.group.value_or(""));
  w.put_string(site.backend);
  w.put<uint8_t>(site.rank.has_value());
  w.put<int32_t>(site.rank.value_or(0));
  w.put<uint8_t>(site.group_size.has_value());
  w.put<int32_t>(site.group_size.value_or(0));
  w.put_string(site.step);
  w.put<uint8_t>(site.global_rank.has_value());
  w.put<int32_t>(site.global_rank.value_or(0));
  w.put_string(detail);
  return w;
}

void throw_reply_error(Reader& r) {
  const auto kind = static_cast<ErrorKind>(r.get<uint8_t>());
  ErrorSite site;
  site.op = r.get_string();
  auto optional = [&r](auto v, bool has) { return has ? std::optional(v) : std::nullopt; };
  bool has = r.get<uint8_t>() != 0;
  site.call = optional(r.get<uint64_t>(), has);
  has = r.get<uint8_t>() != 0;
  site.group = optional(r.get_string(), has);
  site.backend = r.get_string();
  has = r.get<uint8_t>() != 0;
  site.rank = optional(r.get<int32_t>(), has);
  has = r.get<uint8_t>() != 0;
  site.group_size = optional(r.get<int32_t>(), has);
  site.step = r.get_string();
  has = r.get<uint8_t>() != 0;
  site.global_rank = optional(r.get<int32_t>(), has);
  throw_error(kind, std::move(site), r.get_string());
}

}  // namespace diffcomm::sim::detail
