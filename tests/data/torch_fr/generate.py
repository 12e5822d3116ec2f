"""Writes real PyTorch Flight Recorder dumps of small gloo jobs, the fixtures
of diffcomm-sim replay's torch reader (tests/sim_replay/test_torch_flight_dump.cpp) and
of python/tests/test_replay_torch.py, which regenerates them with the torch it
runs under.

    torchrun --nproc-per-node 3 generate.py CASE OUT_DIR FORMAT

CASE: ok (every collective gloo has, agreeing), dtype, size, op (rank 1
calls broadcast where the others all_reduce), skip (rank 2 never reaches the
last barrier), or wrap (rank 1 alone keeps 8 entries, so its ring lost the
first calls the others still hold). FORMAT: pkl or json. Each rank writes OUT_DIR/rank_<global rank>.<FORMAT>
as torch's own dump-on-timeout would (TORCH_FR_DUMP_TEMP_FILE=OUT_DIR/rank_):
right after issuing its last call, without waiting for it (a mismatched
gloo call may never complete), then leaves at once.
"""

import os
import sys

import torch
import torch.distributed as dist


def collectives(rank: int, world: int) -> None:
    """One call of each collective gloo records, all ranks agreeing."""
    dist.all_reduce(torch.ones(3))
    dist.broadcast(torch.ones(2, dtype=torch.float64), src=1)
    dist.reduce(torch.ones(4), dst=0)
    dist.all_gather([torch.empty(2) for _ in range(world)], torch.ones(2))
    dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2))
    dist.gather(torch.ones(2), [torch.empty(2) for _ in range(world)] if rank == 0 else None, dst=0)
    dist.scatter(torch.empty(2), [torch.ones(2) for _ in range(world)] if rank == 0 else None, src=0)
    dist.all_to_all_single(torch.empty(world), torch.ones(world))
    sizes = [r + 1 for r in range(world)]  # uneven: rank j gets j + 1 rows from everyone
    dist.all_to_all_single(torch.empty(world * (rank + 1)), torch.ones(sum(sizes)),
                           output_split_sizes=[rank + 1] * world, input_split_sizes=sizes)
    pair = dist.new_group([0, 1])
    if rank < 2:
        dist.all_reduce(torch.ones(5, dtype=torch.int64), group=pair)
    dist.barrier()


def last_call(case: str, rank: int):
    """The call each rank dumps after: the same on every rank unless the case breaks it."""
    if case == "dtype":
        return dist.all_reduce(torch.ones(4, dtype=torch.float64 if rank == 1 else torch.float32),
                               async_op=True)
    if case == "size":
        return dist.all_reduce(torch.ones(5 if rank == 2 else 4), async_op=True)
    if case == "op":
        if rank == 1:
            return dist.broadcast(torch.ones(4), src=0, async_op=True)
        return dist.all_reduce(torch.ones(4), async_op=True)
    if case == "skip" and rank == 2:
        return None
    return dist.barrier(async_op=True)


def main() -> None:
    case, out, fmt = sys.argv[1], sys.argv[2], sys.argv[3]
    if case == "wrap" and os.environ["RANK"] == "1":
        os.environ["TORCH_FR_BUFFER_SIZE"] = "8"  # read when the first group is made
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives(rank, world)
    if case == "wrap":
        for _ in range(6):
            dist.all_reduce(torch.ones(2))
    last_call(case, rank)
    c10d = torch._C._distributed_c10d
    if fmt == "pkl":
        data = c10d._dump_fr_trace(True, False, False)  # collectives, no stack traces, all
    else:
        data = c10d._dump_fr_trace_json(True, False)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank_{rank}.{fmt}"), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    sys.stdout.flush()
    os._exit(0)  # the last call may never complete: leave as a crashed job would


if __name__ == "__main__":
    main()
