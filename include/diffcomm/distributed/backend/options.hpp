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
  /// (seconds), else 600. Must be finite and > 0 (NaN, inf, 0 and negative
  /// values raise InvalidArgument where the group is created): every wait
  /// has a deadline.
  std::optional<double> timeout_s;
  /// Entries of each rank's flight recorder ring (FlightRecorder). Unset:
  /// the environment variable DIFFCOMM_FR_SIZE, else 2000 (torch's default).
  /// Must be >= 1 (InvalidArgument where the group is created).
  std::optional<std::size_t> flight_recorder_size;
  /// Directory where every rank writes its flight recorder as
  /// DIR/rank-<global rank>.json when a call raises Timeout,
  /// CollectiveMismatch or BackendError (schema: FlightRecorder::write_json).
  /// Unset: the environment variable DIFFCOMM_FR_DUMP_DIR, else no dumps.
  std::optional<std::string> flight_recorder_dump_dir;

  /// check, resolved as documented above.
  bool resolved_check() const;
  /// timeout_s, resolved as documented above. Throws InvalidArgument for a
  /// value that is not a finite number of seconds > 0.
  double resolved_timeout_s() const;
  /// flight_recorder_size, resolved as documented above. Throws
  /// InvalidArgument for 0 or a DIFFCOMM_FR_SIZE that is not a count.
  std::size_t resolved_flight_recorder_size() const;
  /// flight_recorder_dump_dir, resolved as documented above ("" = no dumps).
  std::string resolved_flight_recorder_dump_dir() const;
};

}  // namespace diffcomm::dist
