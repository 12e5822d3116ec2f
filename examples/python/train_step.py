"""One encoder-parallel training step in torch through diffcomm.torch, launched
by torchrun (diffcomm over torch's gloo group) or by mpirun (diffcomm over MPI).

    torchrun --nproc_per_node 4 examples/python/train_step.py   # cp=2 tp=2 with SP
    mpirun -np 4 python examples/python/train_step.py

Every rank encodes its bucket of images, diffcomm.torch.route_features sends
the feature rows to the decoder ranks that own their tokens, unpack_records and
merge_into_decoder build this rank's decoder shard, the decoder's loss is
backpropagated through the exchange (diffcomm's exact adjoints), the encoder
gradient is all-reduced and SGD updates W. Each rank then checks its shard and
the gradient against the single-rank float64 reference.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import diffcomm.torch as dt  # noqa: E402
from encoder_parallel_step import StepConfig, reference, step  # noqa: E402


def init() -> "dt._core.ProcessGroup":
    """diffcomm's world over what launched this process."""
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        return dt.init_process_group("mpi")  # MPI_COMM_WORLD; or comm=<mpi4py communicator>
    import torch.distributed as tdist  # noqa: PLC0415

    tdist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_*
    return dt.init_process_group("torch")  # diffcomm's semantics over torch's group


def main() -> int:
    world = init()
    n = world.size()
    cp = 2 if n % 2 == 0 else 1
    cfg = StepConfig(cp=cp, tp=n // cp, sp=True, ffn=2 * (n // cp), seed=1,
                     images=[[(640, 480), (120, 90)], [(333, 500)], [(56, 56), (224, 224)]])
    lr = 0.1
    e, tokens, dw, loss, w_new = step(world.rank(), world, cfg, lr=lr)

    full, dw_ref, _ = reference(cfg)
    for row, (b, t) in enumerate(tokens):
        assert torch.equal(e[row], full[b][t]), f"shard row {row} differs"
    err = float((dw - dw_ref).abs().max() / dw_ref.abs().max())
    assert err <= 1e-12, err
    from encoder_parallel_step import weights  # noqa: PLC0415

    w0, _ = weights(cfg)
    assert torch.allclose(w_new, w0 - lr * dw_ref, rtol=0, atol=1e-12)
    line = (f"rank {world.rank()}/{n}: {len(tokens)} shard rows, loss term {loss:.6g}, "
            f"encoder grad rel diff vs single-rank reference {err:.2e} -> OK\n")
    os.write(1, line.encode())  # one write: ranks under a launcher share the terminal
    dt.destroy_process_group()
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        # torch's own group too: torch 1.13's gloo group left for interpreter
        # exit can end the process in std::terminate (a joinable thread).
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
