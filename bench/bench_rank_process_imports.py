"""What rank processes pay for torch's lazy imports (bench/RESULTS.md, "Issue 49 item 2 (part)").

Three diffcomm.sim.run calls of examples/python's encoder-parallel step (cp 2, tp 2, SP, zigzag:
world 4, process ranks) in this interpreter. Timed from outside, paired:

    farm-bench -n 5 --timeout 400 --vs "python bench/bench_rank_process_imports.py off" -- \\
        python bench/bench_rank_process_imports.py on

"off" empties diffcomm.sim's LAZY_TORCH_MODULES, so every rank process imports torch._dynamo
itself (torch >= 2: its first optimizer does), as before the caller imported it once.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "python"))

import torch  # noqa: E402,F401  (imported first, as a torch user's program does)

import diffcomm.sim as sim  # noqa: E402
import diffcomm.sim._processes as processes  # noqa: E402
from encoder_parallel_step import StepConfig, check, step  # noqa: E402

if sys.argv[1:] == ["off"]:
    processes.LAZY_TORCH_MODULES = ()
elif sys.argv[1:] != ["on"]:
    sys.exit("usage: bench_rank_process_imports.py on|off")
cfg = StepConfig(cp=2, tp=2, sp=True, layout="zigzag", ffn=4, images=[[(100, 200), (300, 60)]],
                 seed=3)
for seed in range(3):
    result = sim.run(cfg.world_size, lambda rank, group: step(rank, group, cfg), seed=seed)
    check(cfg, result.results)
