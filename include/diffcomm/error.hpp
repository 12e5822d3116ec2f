#pragma once
// The diffcomm exception hierarchy. Every error diffcomm raises derives from
// diffcomm::Error, so a trainer can catch one type. Messages name the op, the
// rank, the group and what was expected vs received.
#include <stdexcept>
#include <string>

namespace diffcomm {

/// Base of every exception diffcomm throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad input detected locally, before any communication (shapes, dtypes,
/// splits, roots, ranks, list lengths, autograd misuse).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// Members of one collective call disagree (op, dtype, shape, root, reduce op,
/// splits). Raised on every member of the call.
class CollectiveMismatch : public Error {
 public:
  using Error::Error;
};

/// Every live rank is blocked and none can proceed. The message holds, for
/// each rank, the call it waits in or that it has finished.
class Deadlock : public Error {
 public:
  using Error::Error;
};

/// A member of a group failed (injected fault or an exception on that rank);
/// raised on the other members instead of hanging.
class RankFailure : public Error {
 public:
  using Error::Error;
};

/// A production backend waited longer than its deadline (Options::timeout_s,
/// DIFFCOMM_TIMEOUT) for a call to complete — typically a member returned
/// early, failed or skipped the call. The message names the group, the op and
/// the call number waited in, and this rank's flight recorder. The group is
/// unusable afterwards (its transport has calls in flight): end the process
/// (the MPI backend's mpi::abort) rather than continue on it.
class Timeout : public Error {
 public:
  using Error::Error;
};

/// A transport (MPI, NCCL, CUDA) reported an error; the message carries the
/// backend's own code and text.
class BackendError : public Error {
 public:
  using Error::Error;
};

}  // namespace diffcomm
