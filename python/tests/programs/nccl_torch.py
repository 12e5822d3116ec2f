"""One rank per GPU (torchrun's environment): diffcomm.torch over torch's own
NCCL group (init_process_group("nccl") without diffcomm's NCCL backend).
all_reduce of rank-dependent CUDA tensors and its gradient, checked against
closed forms. Prints "RESULT rank R: OK"."""
import os

import torch
import torch.distributed as tdist

import diffcomm.torch as dt

rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank % torch.cuda.device_count())
tdist.init_process_group("nccl")
g = dt.init_process_group("nccl")
assert g.backend_name == "torch", g.backend_name
x = (torch.arange(4, dtype=torch.float32, device="cuda") + rank).requires_grad_()
y = dt.all_reduce(x)
dt.backward((y * (rank + 1)).sum())
torch.cuda.synchronize()
base = sum(range(n))
assert y.tolist() == [4.0 * 0 + n * k + base for k in range(4)], y.tolist()
assert x.grad.tolist() == [float(sum(r + 1 for r in range(n)))] * 4, x.grad.tolist()
print(f"RESULT rank {rank}: OK", flush=True)
dt.destroy_process_group()
tdist.destroy_process_group()
