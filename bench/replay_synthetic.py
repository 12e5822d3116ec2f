#!/usr/bin/env python3
"""Synthetic flight recorder dumps for `diffcomm-sim replay` at scale (issue 22,
item 6): RANKS dumps of ENTRIES agreeing all_reduce calls on the world group
(float32[1024]), written to DIR. Then time the replay and its peak memory:

    bench/replay_synthetic.py DIR RANKS ENTRIES
    /usr/bin/time -v build/release/tools/diffcomm-sim replay DIR
"""
import json
import os
import sys


def entry(i, rank, ranks):
    return {"id": i + 1, "group": "world", "group_rank": rank, "group_size": ranks, "call": i,
            "op": "all_reduce", "dtype": "float32", "numel": 1024, "input_shapes": [[1024]],
            "output_shapes": [[1024]], "input_splits": [], "output_splits": [], "root": -1,
            "tag": 0, "reduce_op": "sum", "reduce_factor": 1.0, "color": -1, "key": 0,
            "members": [], "members_are_ranks": False, "backward_of": None,
            "state": "completed", "start_s": 0.0, "duration_s": 0.0, "bytes_sent": 0,
            "bytes_received": 0}


def main():
    out, ranks, entries = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.makedirs(out, exist_ok=True)
    members = list(range(ranks))
    for r in range(ranks):
        doc = {"format": "diffcomm-flight-recorder", "version": 1, "rank": r,
               "world_size": ranks, "capacity": entries,
               "groups": [{"name": "world", "members": members, "group_rank": r,
                           "calls": entries, "p2p_calls": 0, "watermark": 0,
                           "p2p_watermark": 0}],
               "entries": [entry(i, r, ranks) for i in range(entries)]}
        with open(os.path.join(out, f"rank-{r}.json"), "w") as f:
            json.dump(doc, f)


if __name__ == "__main__":
    main()
