"""Peak memory of a diffcomm.torch training loop in the simulated world.

Each step: y = all_reduce(x * 1.0, op="max") on a 1M-element float64 tensor
(a Max reduction saves its input and output for backward), then
y.sum().backward(). Prints the process's peak RSS after each step count in
STEPS (each count in a fresh process). A bridged op whose diffcomm graph
stayed in the rank's cohort kept both saved tensors of every step alive
(~16 MB per rank per step); flat numbers mean every step's graph is freed.

Run: build/python-venv/bin/python bench/torch_loop_memory.py
"""
import resource
import subprocess
import sys

STEPS = (5, 40, 120)


def one(steps: int) -> int:
    import torch

    import diffcomm.sim as sim
    import diffcomm.torch as dt

    def rank(r, world):
        x = torch.ones(1_000_000, dtype=torch.float64, requires_grad=True)
        for _ in range(steps):
            dt.all_reduce(x * 1.0, op="max", group=world).sum().backward()

    sim.run(2, rank, isolation="thread")  # the memory measured is this process's
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


if __name__ == "__main__":
    if len(sys.argv) == 2:
        print(one(int(sys.argv[1])))
    else:
        for n in STEPS:
            out = subprocess.run([sys.executable, __file__, str(n)], capture_output=True,
                                 text=True, check=True).stdout.strip()
            print(f"{n:4d} steps: peak RSS {out} MiB")
