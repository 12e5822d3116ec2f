#pragma once
// The diffcomm exception hierarchy. Every error diffcomm raises derives from
// diffcomm::Error, so a trainer can catch one type. Messages name the op, the
// rank, the group and what was expected vs received.
//
// An Error carries its kind (which class it is), its site (where it was
// raised: op, call number, group, rank, global rank; any part may be unset)
// and a detail; what() is format_error(site(), detail()), the one formatter
// of every message. Callers branch on kind() or on the class, never on the
// message's words.
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace diffcomm {

/// Which class an Error is: one kind per class below.
enum class ErrorKind {
  Error,  ///< the base class itself (e.g. a non-diffcomm failure relayed by sim::World)
  InvalidArgument,
  CollectiveMismatch,
  Deadlock,
  RankFailure,
  Timeout,
  BackendError,
  ResourceExhausted,
};

/// Number of ErrorKind values (for tables indexed by kind).
inline constexpr std::size_t kErrorKindCount = 8;

/// "InvalidArgument", "Deadlock", ...: the class name of `kind`.
const char* error_kind_name(ErrorKind kind);

/// Where an error was raised. Every part is optional; format_site() writes
/// the parts that are set, in the fixed order of diffcomm's messages. An
/// aggregate whose parts all default to unset, so a designated initializer
/// names only the parts it sets: ErrorSite{.op = "all_reduce", .rank = 3}.
struct ErrorSite {
  std::string op{};                ///< "all_reduce" (a composed step: the user's op); "" = unset
  std::optional<uint64_t> call{};  ///< the op's per-group call number
  std::optional<std::string> group{};  ///< group name
  std::string backend{};               ///< backend name ("sim", "mpi"); "" = unset
  std::optional<int> rank{};           ///< group-local rank
  std::optional<int> group_size{};     ///< written with rank: "rank R of N"
  std::string step{};                  ///< a composed call's transport step op; "" = unset
  std::optional<int> global_rank{};    ///< world rank, leading the message: "rank G: ..."

  /// True when no part is set (the message is the detail alone).
  bool empty() const;
};

/// The site as text: "[rank G: ]op[ #call][ on group 'g'][ (B backend, rank r
/// of n, S step)]", e.g. "all_reduce #3 on group 'world' (rank 1 of 4)";
/// "" for an empty site. No errors.
std::string format_site(const ErrorSite& site);

/// The message of an error at `site` with `detail`: format_site(site) + ": "
/// + detail, or detail alone for an empty site. Every Error's what() is built
/// here. No errors (beyond std::bad_alloc).
std::string format_error(const ErrorSite& site, std::string_view detail);

/// Base of every exception diffcomm throws.
class Error : public std::runtime_error {
 public:
  /// A message without a site: kind Error, empty site, detail = message.
  explicit Error(const std::string& message) : Error(ErrorKind::Error, message) {}
  explicit Error(const char* message) : Error(ErrorKind::Error, std::string(message)) {}
  /// An error at `site`: what() is format_error(site, detail).
  Error(ErrorSite site, std::string_view detail)
      : Error(ErrorKind::Error, std::move(site), detail) {}

  /// Which class this is (the most derived diffcomm class).
  ErrorKind kind() const noexcept { return kind_; }
  /// Where it was raised (an empty site when it was built from a message).
  const ErrorSite& site() const noexcept;
  /// The message without the site: what() minus format_site(site()) + ": ".
  std::string_view detail() const noexcept;

 protected:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  Error(ErrorKind kind, ErrorSite site, std::string_view detail);

 private:
  ErrorKind kind_;
  // Shared so copying an exception never allocates (and cannot throw).
  std::shared_ptr<const ErrorSite> site_;
  // detail() is the tail of what() from here: kept once, not twice.
  std::size_t detail_at_ = 0;
};

// Each class: a message (empty site) or (site, detail), as Error.
#define DIFFCOMM_ERROR_CONSTRUCTORS(Class)                                               \
  explicit Class(const std::string& message) : Error(ErrorKind::Class, message) {}       \
  explicit Class(const char* message) : Error(ErrorKind::Class, std::string(message)) {} \
  Class(ErrorSite site, std::string_view detail)                                         \
      : Error(ErrorKind::Class, std::move(site), detail) {}

/// Bad input detected locally, before any communication (shapes, dtypes,
/// splits, roots, ranks, list lengths, autograd misuse).
class InvalidArgument : public Error {
 public:
  DIFFCOMM_ERROR_CONSTRUCTORS(InvalidArgument)
};

/// Members of one collective call disagree (op, dtype, shape, root, reduce op,
/// splits). Raised on every member of the call.
class CollectiveMismatch : public Error {
 public:
  DIFFCOMM_ERROR_CONSTRUCTORS(CollectiveMismatch)
};

/// Every live rank is blocked and none can proceed. The message holds, for
/// each rank, the call it waits in or that it has finished.
class Deadlock : public Error {
 public:
  DIFFCOMM_ERROR_CONSTRUCTORS(Deadlock)
};

/// A member of a group failed (injected fault or an exception on that rank);
/// raised on the other members instead of hanging.
class RankFailure : public Error {
 public:
  DIFFCOMM_ERROR_CONSTRUCTORS(RankFailure)
};

/// A production backend waited longer than its deadline (Options::timeout_s,
/// DIFFCOMM_TIMEOUT) for a call to complete — typically a member returned
/// early, failed or skipped the call. The message names the group, the op and
/// the call number waited in, and this rank's flight recorder. The group is
/// unusable afterwards (its transport has calls in flight): end the process
/// (the MPI backend's mpi::abort) rather than continue on it.
class Timeout : public Error {
 public:
  DIFFCOMM_ERROR_CONSTRUCTORS(Timeout)
};

/// A transport (MPI, NCCL, CUDA) reported an error; the message carries the
/// backend's own code and text.
class BackendError : public Error {
 public:
  DIFFCOMM_ERROR_CONSTRUCTORS(BackendError)
};

/// A resource ran out: host memory, fiber stacks, memory mappings, file
/// descriptors. The message names what was being allocated and how much
/// (Python: also a MemoryError). Raised where the allocation failed; a
/// simulated rank whose own code ran out of memory (std::bad_alloc from the
/// standard library) fails with this kind too.
class ResourceExhausted : public Error {
 public:
  DIFFCOMM_ERROR_CONSTRUCTORS(ResourceExhausted)
};

#undef DIFFCOMM_ERROR_CONSTRUCTORS

/// Host memory for a tensor could not be had: a ResourceExhausted whose
/// what() names what was being allocated and how much: "diffcomm: cannot
/// allocate 8589934592 bytes (8 GiB) of host memory for a tensor: out of
/// memory". Thrown by tensor allocation (zeros, empty, the ops' outputs). Not
/// a std::bad_alloc (a class cannot be both without making std::exception an
/// ambiguous base): catch ResourceExhausted or diffcomm::Error.
class OutOfMemory : public ResourceExhausted {
 public:
  explicit OutOfMemory(const std::string& message) : ResourceExhausted(message) {}
};

/// The detail of the ResourceExhausted that stands for a std::bad_alloc
/// thrown outside diffcomm's own allocations (a std::vector, string or map
/// of the caller's code), whose what() is `what`: "out of memory:
/// std::bad_alloc from ... (the standard library names neither what nor how
/// much)". No errors (beyond std::bad_alloc).
std::string bad_alloc_detail(std::string_view what);

/// Throws E (InvalidArgument unless named) at `site` with `detail`: what()
/// becomes format_error(site, detail), e.g. "plan_exchange: buckets 0 must be
/// >= 1" for a site holding only its op, and site() / detail() return the two
/// parts. The one way diffcomm raises its errors: no throw site writes an
/// "op: " prefix by hand. Always throws.
template <class E = InvalidArgument>
[[noreturn]] void raise(ErrorSite site, std::string_view detail) {
  static_assert(std::is_base_of_v<Error, E>, "raise throws diffcomm errors only");
  throw E(std::move(site), detail);
}

/// raise<E>(ErrorSite{.op = op}, detail): what() is "op: detail".
template <class E = InvalidArgument>
[[noreturn]] void raise(std::string_view op, std::string_view detail) {
  raise<E>(ErrorSite{.op = std::string(op)}, detail);
}

/// The one mapping from kind to class: calls f(std::type_identity<C>{}) with
/// C the class of `kind` and returns its result. For code that must build
/// the class of a kind known only at run time (throw_error; sim::World::run,
/// which adds its failures to the class). No errors of its own.
template <class F>
decltype(auto) visit_error_class(ErrorKind kind, F&& f) {
  switch (kind) {
    case ErrorKind::InvalidArgument: return f(std::type_identity<InvalidArgument>{});
    case ErrorKind::CollectiveMismatch: return f(std::type_identity<CollectiveMismatch>{});
    case ErrorKind::Deadlock: return f(std::type_identity<Deadlock>{});
    case ErrorKind::RankFailure: return f(std::type_identity<RankFailure>{});
    case ErrorKind::Timeout: return f(std::type_identity<Timeout>{});
    case ErrorKind::BackendError: return f(std::type_identity<BackendError>{});
    case ErrorKind::ResourceExhausted: return f(std::type_identity<ResourceExhausted>{});
    case ErrorKind::Error: break;
  }
  return f(std::type_identity<Error>{});
}

/// Throws the class of `kind` at `site` with `detail` (what() is
/// format_error(site, detail)). Always throws.
[[noreturn]] void throw_error(ErrorKind kind, ErrorSite site, std::string_view detail);

}  // namespace diffcomm
