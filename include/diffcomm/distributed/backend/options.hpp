#pragma once
// Options of the production backends (MPI, NCCL): cross-rank checking,
// reduction mode and the deadline of every wait. The simulated world needs
// none of them: it always checks, is always deterministic and never waits.
#include <cstddef>
#include <optional>
#include <string>

namespace diffcomm::dist {

struct Options {
  /// Checked mode: before every collective the members exchange a fixed-size
  /// fingerprint of their call on a control communicator, and a disagreement
  /// raises CollectiveMismatch on every member, worded as in the simulated
  /// world; send/recv exchange an envelope (dtype, shape) first. Unset: the
  /// environment variable DIFFCOMM_CHECK ("1"/"0"), else on in Debug builds
  /// of diffcomm (NDEBUG undefined) and off in Release builds (the idea of
  /// TORCH_DISTRIBUTED_DEBUG).
  std::optional<bool> check;
  /// Use the transport's own reduction (MPI_Allreduce, ncclAllReduce, ...)
  /// for all_reduce, reduce and reduce_scatter*: faster, but its order of
  /// combination and its rounding (per hop for 16-bit types) depend on the
  /// transport's algorithm, so results are NOT bit-identical to the
  /// simulated world. Default false: diffcomm's deterministic composition.
  bool native_reduction = false;
  /// Seconds any call (world creation included) may wait for its peers
  /// before raising Timeout. Unset: the environment variable DIFFCOMM_TIMEOUT
  /// (seconds), else 600. Must be finite, > 0 and at most kMaxTimeoutS (NaN,
  /// inf, 0, negative and larger values raise InvalidArgument where the group
  /// is created): every wait has a deadline, one every transport can keep.
  std::optional<double> timeout_s;
  /// Entries of each rank's flight recorder ring (FlightRecorder). Unset:
  /// the environment variable DIFFCOMM_FR_SIZE, else 2000 (torch's default).
  /// Must be in [1, kMaxFlightRecorderSize] (InvalidArgument where the group
  /// is created).
  std::optional<std::size_t> flight_recorder_size;
  /// Directory where every rank writes its flight recorder as
  /// DIR/rank-<global rank>.json when a call raises Timeout,
  /// CollectiveMismatch, BackendError or RankFailure (schema: FlightRecorder::write_json).
  /// Unset: the environment variable DIFFCOMM_FR_DUMP_DIR, else no dumps.
  std::optional<std::string> flight_recorder_dump_dir;

  /// check, resolved as documented above.
  bool resolved_check() const;
  /// timeout_s, resolved as documented above. Throws InvalidArgument naming
  /// the option or variable for a value that is not a finite number of seconds
  /// in (0, kMaxTimeoutS].
  double resolved_timeout_s() const;
  /// flight_recorder_size, resolved as documented above. Throws
  /// InvalidArgument naming the option or variable for 0, more than
  /// kMaxFlightRecorderSize, or a DIFFCOMM_FR_SIZE that is not a count.
  std::size_t resolved_flight_recorder_size() const;

  /// The longest deadline, 10^6 s (11.6 days): in milliseconds it fits a
  /// 32-bit int, the narrowest a transport takes (torch's gloo failed every
  /// call at once with 1e10 s and hung with 1e11 s).
  static constexpr double kMaxTimeoutS = 1e6;
  /// The largest flight recorder ring, 10^6 entries: the ring is allocated
  /// when the group is created (10^12 entries ended in std::bad_alloc there).
  static constexpr std::size_t kMaxFlightRecorderSize = 1'000'000;
  /// flight_recorder_dump_dir, resolved as documented above ("" = no dumps).
  std::string resolved_flight_recorder_dump_dir() const;
};

}  // namespace diffcomm::dist
