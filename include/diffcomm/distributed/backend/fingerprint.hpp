#pragma once
// Call fingerprints: what the members of one collective must agree on, how
// their calls are compared, and the words of the mismatch report. This is the
// one home of that logic for every backend:
//  - the simulated world compares the members' full descriptions (CallDesc)
//    at each rendezvous;
//  - the checked production mode (dist::CheckedBackend, MPI and NCCL) first
//    exchanges a fixed-size Fingerprint per member, and only when those
//    disagree exchanges the full descriptions, then reports with the same
//    compare() — so a mismatch reads the same in the sim and in production.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/distributed/backend/call.hpp"

namespace diffcomm::dist {

/// A call without its data: everything a fingerprint compares.
struct CallDesc {
  OpType op = OpType::Barrier;
  uint64_t seq = 0;
  DType dtype = DType::Float32;
  int root = -1;
  int tag = 0;
  ReduceOp reduce_op = ReduceOp::Sum;
  std::vector<Shape> inputs;   ///< shapes of Call::inputs
  std::vector<Shape> outputs;  ///< shapes of Call::outputs
  std::vector<int64_t> input_splits;
  std::vector<int64_t> output_splits;
  std::vector<int64_t> members;       ///< new_group/split: the fingerprint every member passes
  int color = -1;                     ///< new_group/split: this member's color (reports only)
  int key = 0;                        ///< new_group/split: this member's key (reports only)
  bool members_are_ranks = false;     ///< new_group (members = rank list) vs split (a fingerprint)
  std::optional<CallId> backward_of;  ///< Call::backward_of
  /// Non-empty: this member refused its own call with this error
  /// (Backend::announce_refusal); compare() reports it before anything else.
  std::string refused;
  int thread_index = 0;  ///< Call::thread_index
  std::string caller;    ///< Call::caller as "file:line" ("" when unknown)
};

/// "\ncalled at: train.py:42 (ranks 0,1), train.py:57 (rank 2)": where the
/// members of a mismatched call made it (callers[i] of member i, global rank
/// globals[i]), grouped by call site in order of first appearance, at most 8
/// ranks listed per site; "" when no caller is known. Appended to a
/// CollectiveMismatch's report by the simulated world and checked mode alike.
std::string call_sites(const std::vector<std::string>& callers, const std::vector<int>& globals);

/// The description of a call (shapes copied, no data).
CallDesc describe(const Call& call);

/// "all_reduce(float32, in=[4], op=sum)" — the fields a fingerprint compares
/// (a backward call adds " (backward of all_reduce #0)");
/// "new_group(ranks=[0,2])" for new_group, "split(color=0, key=1,
/// fingerprint=[1,2,4,-2])" for ProcessGroup::split.
std::string signature(const CallDesc& call);

/// Flat encoding of a CallDesc (for exchanging it over a transport) and back.
/// deserialize throws InvalidArgument on a malformed encoding.
std::vector<int64_t> serialize(const CallDesc& call);
CallDesc deserialize(const int64_t* words, std::size_t count);

/// Compares the calls of every member of one collective (calls[i] is group
/// rank i's, globals[i] its global rank). Returns "" when they agree, else one
/// line naming both ranks, both calls and the field that differs, e.g.
/// "rank 0 (global 0) called reduce(..., root=0) but rank 1 (global 1) called
/// reduce(..., root=1): root differs". Rules: equal op, dtype, root, reduce op;
/// equal shapes for fixed-size ops; equal splits and row shapes for the _v
/// ops; all_to_all_single: input_splits[j] on rank i == output_splits[i] on
/// rank j; all_to_all: outputs[s] on i has the shape of inputs[i] on s;
/// new_group: equal member lists; split: equal fingerprints; equal reduce op
/// includes PremulSum's factor; equal forward call for backward calls
/// ("forward call differs"). A member that refused its own call
/// (CallDesc::refused) is reported first: "rank 1 (global 1) refused its own
/// call all_to_all_single(...): <error>".
std::string compare(const std::vector<const CallDesc*>& calls, const std::vector<int>& globals);
/// The same comparison straight from the members' Calls (the simulated
/// world's case): agreement is checked in place, without building
/// descriptions; only a mismatch builds them, for the same report.
std::string compare(const std::vector<const Call*>& calls, const std::vector<int>& globals);

/// An exact (injective) code of a shape up to 2-D with modest extents; 0 when
/// the shape has none (then compare the shapes themselves).
uint64_t shape_code(const Shape& shape);
/// all_to_all's shapes as codes, read by each member from its own lists
/// while they are in cache: in[s * n + i] = shape_code(inputs[i] of group
/// rank s), out likewise. Why: comparing reads N^2 shapes, and reading them
/// again from every member's tensors at the rendezvous was a second pass over
/// all of them (hundreds of MB at 1024 ranks).
struct AllToAllCodes {
  const uint64_t* in = nullptr;
  const uint64_t* out = nullptr;
};
/// compare() of all_to_all calls with the members' codes given (read only
/// when every member called all_to_all with N tensors per list).
std::string compare(const std::vector<const Call*>& calls, const std::vector<int>& globals,
                    const AllToAllCodes& codes);

/// A fixed-size summary of one member's call (kFingerprintWords int64 words),
/// exchanged by every member before the data moves in checked mode. Equal
/// where compare() needs equality; split ops carry hashes whose sums over the
/// members agree exactly when the cross-rank split rule holds (64-bit hashes:
/// a false "agree" needs a hash collision).
inline constexpr std::size_t kFingerprintWords = 15;
using Fingerprint = std::array<int64_t, kFingerprintWords>;

/// The fingerprint of `call` as issued by group rank call.rank.
Fingerprint fingerprint(const Call& call);
/// The fingerprint of a member refusing `call` (Backend::announce_refusal):
/// one no call has, so the members never agree on it. Reads only call.op.
Fingerprint refusal_fingerprint(const Call& call);

/// The name of the first field in which two fingerprints differ ("op",
/// "call number", "dtype", "root", "reduce op", "shape", ...), "" when equal.
/// Names the field when compare() finds nothing to report.
const char* fingerprint_field(const Fingerprint& a, const Fingerprint& b);

/// Whether the gathered fingerprints (one per member, in group-rank order)
/// agree under the rules of compare().
bool fingerprints_agree(const std::vector<Fingerprint>& prints);

/// Compares the two ends of a point-to-point transfer: "" when the receive
/// buffer has the sent dtype and shape, else "rank 0 (global 0) sends
/// float32[4] (tag 0) but rank 1 (global 1) receives into float32[3]: shape
/// or dtype differs".
std::string compare_p2p(const CallDesc& send, int src, int src_global, const CallDesc& recv,
                        int dst, int dst_global);

/// "rank 2 (global 5)": how reports name a member.
std::string rank_label(int group_rank, int global_rank);

}  // namespace diffcomm::dist
