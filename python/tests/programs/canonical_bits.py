"""canonical_all_reduce over a launched world (mpirun or torchrun), on every
group size 1..W: the first s ranks each hold C/s of the same C = 840 chunks
(840 = lcm(1..8)) and all-reduce them canonically. Rank 0 prints
"BITS s <sha256 of the result's bytes>" per size s (every member's result
must be bit-identical; a member whose bits differ from rank 0's fails the
job). argv: backend (torch | mpi)."""
import hashlib
import sys

import torch

import diffcomm.torch as dt

CHUNKS, ELEMENTS = 840, 7


def global_chunks() -> torch.Tensor:
    """The C chunks, the same on every process: exponents over 2^-20..2^20, so
    the order of the additions shows in the bits."""
    g = torch.Generator().manual_seed(20261207)
    mant = torch.rand(CHUNKS, ELEMENTS, generator=g, dtype=torch.float64) + 1.0
    exp = torch.randint(-20, 21, (CHUNKS, ELEMENTS), generator=g).to(torch.float64)
    sign = torch.randint(0, 2, (CHUNKS, ELEMENTS), generator=g).to(torch.float64) * 2 - 1
    return sign * mant * torch.pow(2.0, exp)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def main() -> None:
    backend = sys.argv[1]
    import torch.distributed as tdist  # noqa: PLC0415

    if backend == "torch":
        tdist.init_process_group("gloo")
    dt.init_process_group(backend)
    rank, world = dt.get_rank(), dt.get_world_size()
    chunks = global_chunks()
    for s in range(1, world + 1):
        group = dt.new_group(list(range(s)))  # collective over the world
        if group is None:
            continue
        k = CHUNKS // s
        r = group.rank()
        y = dt.canonical_all_reduce(chunks[r * k:(r + 1) * k].clone(), group=group)
        # Every member's bits against member 0's.
        mine = torch.tensor(list(bytes.fromhex(digest(y))), dtype=torch.float64)
        first = dt.broadcast(mine, group=group, group_src=0)
        if not torch.equal(mine, first):
            raise SystemExit(f"rank {rank}: group size {s}: bits differ from group rank 0's")
        if rank == 0:
            print(f"BITS {s} {digest(y)}", flush=True)
    # Leave as a torch job should: torch 2.x's gloo threads, still running at
    # interpreter exit, ended a rank with "terminate called without an active
    # exception" (SIGABRT) once in CI. The barrier first: no rank tears down
    # while a peer still reads its last broadcast.
    dt.get_world().barrier()
    dt.destroy_process_group()
    if backend == "torch":
        tdist.destroy_process_group()


if __name__ == "__main__":
    main()
