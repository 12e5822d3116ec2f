#!/usr/bin/env python3
"""Synthetic flight recorder dumps for `diffcomm-sim replay` at scale (issue 22,
item 6), in dump format 2 (include/diffcomm/distributed/flight_dump.hpp).

    bench/replay_synthetic.py DIR RANKS ENTRIES [ok|mismatch|deadlock]
    /usr/bin/time -v build/release/tools/diffcomm-sim replay DIR

Each rank records ENTRIES calls of a training step's shape: on its TP group
of 8 ("tp<k>", ranks 8k..8k+7) an all_gather_single of float32[2048] rows,
then on the world group an all_reduce of float32[1024], alternating.
`mismatch`: rank RANKS-1's last world all_reduce has 1023 elements;
`deadlock`: rank RANKS-1 never records its last call.
"""
import json
import os
import sys

COLUMNS = ["id", "call_index", "call", "state", "backward_call", "start_ns", "duration_ns",
           "bytes_sent", "bytes_received"]


def desc(group, group_rank, size, op, inp, out):
    return {"group": group, "group_rank": group_rank, "group_size": size, "op": op,
            "dtype": "float32", "numel": inp[0], "input_shapes": [inp], "output_shapes": [out],
            "input_splits": [], "output_splits": [], "root": -1, "tag": 0, "reduce_op": "sum",
            "reduce_factor": 1.0, "color": -1, "key": 0, "members": [],
            "members_are_ranks": False, "backward_of": None}


def dump(r, ranks, entries, case):
    tp = r // 8
    last = r == ranks - 1
    calls = [desc(f"tp{tp}", r % 8, 8, "all_gather_single", [2048], [8 * 2048]),
             desc("world", r, ranks, "all_reduce", [1024], [1024]),
             desc("world", r, ranks, "all_reduce", [1023], [1023])]
    n = entries - 1 if case == "deadlock" and last else entries
    rows = []
    for i in range(n):
        world = i % 2
        k = 2 if case == "mismatch" and last and world and i >= entries - 2 else world
        rows.append(f"[{i + 1},{k},{i // 2},1,-1,{i * 1000000},{1000},{4096},{4096}]")
    n_tp, n_world = (entries + 1) // 2, entries // 2
    groups = [{"name": f"tp{tp}", "member_range": [8 * tp, 1, 8], "group_rank": r % 8,
               "calls": n_tp, "p2p_calls": 0, "watermark": 0, "p2p_watermark": 0},
              {"name": "world", "member_range": [0, 1, ranks], "group_rank": r, "calls": n_world,
               "p2p_calls": 0, "watermark": 0, "p2p_watermark": 0}]
    header = {"format": "diffcomm-flight-recorder", "version": 2, "rank": r, "world_size": ranks,
              "capacity": entries, "groups": groups, "calls": calls, "columns": COLUMNS}
    text = json.dumps(header, separators=(",", ":"))[:-1]
    return text + ',"entries":[\n' + ",\n".join(rows) + "]}\n"


def main():
    out, ranks, entries = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    case = sys.argv[4] if len(sys.argv) > 4 else "ok"
    assert ranks % 8 == 0 and case in ("ok", "mismatch", "deadlock")
    os.makedirs(out, exist_ok=True)
    for r in range(ranks):
        with open(os.path.join(out, f"rank-{r}.json"), "w") as f:
            f.write(dump(r, ranks, entries, case))


if __name__ == "__main__":
    main()
