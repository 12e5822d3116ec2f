"""docs/python.md "Check your step against one rank": a column-parallel linear layer
on data-parallel rows, checked on two meshes; then the same step with its loss
normalized by the rank's own rows, which the check names as dp x."""
import torch

import diffcomm.sim as dsim
import diffcomm.torch as dt

X = torch.randn(8, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def step(rank, mesh, seed, per_rank_norm=False):
    dp, tp = mesh.size("dp"), mesh.size("tp")
    d, t = mesh.coordinate("dp"), mesh.coordinate("tp")
    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cols = 6 // tp
    w_t = w[:, t * cols:(t + 1) * cols].clone().requires_grad_()  # this TP rank's columns
    x = X[d * 8 // dp:(d + 1) * 8 // dp]                             # this DP replica's rows
    tokens = x.shape[0] if per_rank_norm else X.shape[0]            # the bug: local rows
    loss = (x @ w_t).pow(2).sum() / tokens
    loss.backward()
    g = dt.all_reduce(w_t.grad, "sum", mesh.group("dp"))            # DP gradient reduction
    return {"w": (g, dsim.Shard(1, "tp"))}


meshes = [{"dp": 2, "tp": 3}, {"dp": 4, "tp": 2}]
report = dsim.check_equivalence(step, meshes)
print(report)
assert report.ok

bad = dsim.check_equivalence(lambda r, m, s: step(r, m, s, per_rank_norm=True), meshes)
print(bad)
assert not bad.ok and bad.finding(1, "w").expressions == ["dp"]
