// diffcomm._core: the Python binding of diffcomm (nanobind).
//
// Tensors cross the boundary through DLPack with nanobind's ndarray (no
// hand-written capsule code): from_dlpack() borrows the caller's storage
// (zero-copy; non-contiguous input is refused), to_torch() lends diffcomm's
// storage to torch (zero-copy). Every call that may communicate releases the
// GIL, so ranks of diffcomm.sim.run (one OS thread each) and torch threads
// never wait on it.
#include "bind.hpp"

NB_MODULE(_core, m) {
  using namespace diffcomm_python;
  m.doc() = "diffcomm: differentiable collectives and the encoder-parallel exchange (C++ core).";
  bind_errors(m);
  bind_caller(m);
  bind_tensor(m);
  bind_dist(m);
  bind_nn(m);
  bind_encoder_parallel(m);
  bind_sim(m);
  bind_equivalence(m);
  bind_replay(m);
  bind_backends(m);
  bind_torch_transport(m);
}
