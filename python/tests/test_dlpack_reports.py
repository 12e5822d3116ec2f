"""DLPack round trips, step/check/sweep reports vs diffcomm-sim --json, the
planner and token rules."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import diffcomm
import diffcomm.sim as sim
import diffcomm.torch as dt


# ------------------------------------------------------------ DLPack
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16,
                                   torch.int64, torch.int32, torch.uint8])
def test_round_trip_shares_storage(dtype):
    x = torch.arange(12).reshape(3, 4).to(dtype)
    d = dt.to_diffcomm(x)
    assert d.shape == [3, 4] and d.data_ptr == x.data_ptr()
    back = dt.from_diffcomm(d)
    assert back.data_ptr() == x.data_ptr() and back.dtype == dtype
    x[1, 2] = 7  # a write through torch is seen through both views: no copy anywhere
    assert back[1, 2].item() == 7


def test_outputs_share_diffcomm_storage():
    def fn(rank, world):
        y = dt.all_reduce(torch.ones(4, dtype=torch.float64))
        d = dt.to_diffcomm(y)
        return d.data_ptr == y.data_ptr()

    assert all(sim.run(2, fn).results)


def test_a_requires_grad_input_is_borrowed_under_no_grad():
    x = torch.ones(4, dtype=torch.float64, requires_grad=True)

    def fn(rank, world):
        with torch.no_grad():
            y = dt.all_reduce(x)
        return y.tolist(), y.requires_grad

    assert sim.run(2, fn).results == [([2.0] * 4, False)] * 2


def test_an_unconsumed_capsule_frees_its_tensor():
    diffcomm.empty_host_cache()
    d = diffcomm._core.zeros([1 << 17], "float64")  # 1 MiB: a host-cache block
    cap = diffcomm._core.to_dlpack(d)
    del d
    before = diffcomm.host_cache_stats()["cached_bytes"]
    del cap  # never consumed: the capsule's destructor runs the DLPack deleter
    assert diffcomm.host_cache_stats()["cached_bytes"] == before + (1 << 20)


def test_outputs_handed_to_torch_return_to_the_host_cache():
    diffcomm.empty_host_cache()

    def fn(rank, world):
        y = dt.all_reduce(torch.ones(1 << 18))  # 1 MiB float32
        ptr = y.data_ptr()
        del y  # torch drops diffcomm's storage: back to the cache
        z = dt.all_reduce(torch.ones(1 << 18))
        return ptr, z.data_ptr(), z[0].item()

    # Threads: the host cache counted is this process's (rank processes have their own).
    results = sim.run(2, fn, isolation="thread").results
    # Each output block is reused by the next call of the same size class
    # (on one rank or the other: the cache is per process).
    assert {r[0] for r in results} == {r[1] for r in results}
    assert all(r[2] == 2.0 for r in results)
    assert diffcomm.host_cache_stats()["hits"] >= 2


def test_a_bad_host_cache_limit_is_named():
    code = ("import diffcomm\n"
            "try:\n"
            "    diffcomm._core.zeros([1 << 20], 'float64')\n"
            "except diffcomm.InvalidArgument as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "DIFFCOMM_HOST_CACHE_MB": "lots"}, timeout=120)
    assert "DIFFCOMM_HOST_CACHE_MB='lots': expected a whole number of MiB" in out.stdout, out


def test_non_contiguous_rejected_clearly():
    x = torch.arange(6.0).reshape(2, 3)
    with pytest.raises(diffcomm.InvalidArgument, match=r"not contiguous.*\.contiguous\(\)"):
        dt.to_diffcomm(x.t())
    with pytest.raises(diffcomm.InvalidArgument, match="not contiguous"):
        sim.run(1, lambda r, g: dt.all_reduce(x.t()))
    dt.to_diffcomm(x.t().contiguous())  # the documented remedy
    dt.to_diffcomm(x[1:])  # a contiguous row slice is fine (offset pointer)
    assert dt.to_diffcomm(x[1:]).data_ptr == x[1:].data_ptr()


def test_error_hierarchy():
    for cls in (diffcomm.InvalidArgument, diffcomm.CollectiveMismatch, diffcomm.Deadlock,
                diffcomm.RankFailure, diffcomm.BackendError):
        assert issubclass(cls, diffcomm.Error)


# ------------------------------------------------------------ planner, tokens
def test_token_rule():
    assert sim.image_tokens(28 * 10, 28 * 20) == 200  # exact multiples: (H/28)(W/28)
    assert sim.image_patches(28 * 10, 28 * 20) == 800
    assert sim.smart_resize(30, 30) == (56, 56)  # below min_pixels: scaled up to 56 x 56


# CASES.md 10: a side the down-scaling floors to 0 px is clamped to one factor.
def test_token_rule_clamp_case10():
    assert sim.smart_resize(639, 31, 3136, 15680) == (560, 28)
    assert sim.smart_resize(31, 639, 3136, 15680) == (28, 560)


def test_design_worked_example():
    # S = 16, one image on tokens 5..10 (6 rows), cp = 2, tp = 2 (DESIGN.md).
    batch = sim.Batch([sim.Sample(16, [sim.ImageSpan(5, 6)])])
    cases = [(True, sim.CpLayout.Contiguous, [1, 2]),
             (False, sim.CpLayout.Contiguous, [0, 1, 2, 3]),
             (True, sim.CpLayout.Zigzag, [2, 3])]
    for sp, layout, dests in cases:
        plan = sim.plan_exchange(batch, sim.DecoderMesh(2, 2, sp, layout), sim.EncoderLayout(4, 1))
        assert plan.mode == sim.FeatureExchangeMode.ParentVariableA2A
        assert plan.destinations == [dests]
    assert sim.select_feature_exchange(sim.MeshContext(1, 2, True)) == \
        sim.FeatureExchangeMode.TpVariableA2A
    assert sim.select_feature_exchange(sim.MeshContext(1, 2, False)) == \
        sim.FeatureExchangeMode.TpVariableAllGather
    assert sim.select_feature_exchange(sim.MeshContext(1, 1)) == sim.FeatureExchangeMode.Local


def test_batch_from_image_sizes():
    b = sim.batch_from_image_sizes([[(280, 560), (56, 56)], []], text_tokens=3, seq_multiple=8)
    s0 = b.samples[0]
    assert [(im.token_start, im.tokens, im.patches) for im in s0.images] == \
        [(3, 200, 800), (206, 4, 16)]
    assert s0.seq_len == 216  # 3 + 200 + 3 + 4 + 3 = 213 -> 216
    assert b.samples[1].seq_len == 8 and b.samples[1].images == []


# ------------------------------------------------------------ reports
STEP_KEYS = {"mode", "mesh", "encoder", "seed", "dtype", "hidden", "images", "tokens",
             "image_tokens", "bytes", "encoder_imbalance", "sim_time_us", "wall_ms", "per_rank",
             "check"}


def test_step_report_fields_and_pass():
    rep = sim.step(ranks=8, cp=2, tp=2, sp=True, batch=2, seed=3)
    assert STEP_KEYS <= set(rep) and rep.exit_code == 0 and rep.passed
    assert rep["mesh"] == {"ranks": 8, "dp": 2, "cp": 2, "tp": 2, "sp": True, "sp_chunks": 4,
                           "cp_layout": "contiguous"}
    assert rep["check"]["passed"] and rep["check"]["grad_max_rel_diff"] <= 1e-12
    assert len(rep["per_rank"]) == 8 and "check vs single-rank reference" in rep.text


def test_step_sp_chunks_add_one_all_gather_and_reduce_scatter_per_piece():
    one = sim.step(ranks=8, cp=2, tp=2, sp=True, batch=2, seed=3, sp_chunks=1)
    four = sim.step(ranks=8, cp=2, tp=2, sp=True, batch=2, seed=3)
    assert one.passed and four.passed and one["mesh"]["sp_chunks"] == 1
    assert one["bytes"] == four["bytes"]  # the exchange is the same
    for a, b in zip(one["per_rank"], four["per_rank"]):
        # shards of hundreds of rows: 3 more all-gathers and 3 more reduce-scatters
        assert b["calls"] - a["calls"] == 6, (a, b)
        assert b["bytes_sent"] == a["bytes_sent"] and b["bytes_received"] == a["bytes_received"]


def test_step_wrong_convention_and_fault():
    bad = sim.step(tp=2, receiver_grad="partial", seed=1)
    assert bad.exit_code == 1 and not bad["check"]["passed"]
    assert abs(bad["check"]["grad_max_rel_diff"] - 1.0) < 1e-9  # tp - 1
    f = sim.step(ranks=4, tp=4, fault=(2, 1))
    assert f.exit_code == 3 and f["fault"]["triggered"] and "error" in f


def _cli():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    for c in [os.environ.get("DIFFCOMM_SIM", "")] + [
            os.path.join(root, "python", "build", d, "diffcomm", "tools", "diffcomm-sim")
            for d in (os.listdir(os.path.join(root, "python", "build"))
                      if os.path.isdir(os.path.join(root, "python", "build")) else [])] + [
            os.path.join(root, "build", p, "tools", "diffcomm-sim") for p in ("dev", "release")]:
        if c and os.path.exists(c):
            return c
    return shutil.which("diffcomm-sim")


def test_step_and_check_equal_the_cli_json():
    exe = _cli()
    if exe is None:
        pytest.skip("diffcomm-sim not built")
    args = ["--ranks", "4", "--cp", "2", "--tp", "2", "--cp-layout", "zigzag", "--seed", "9",
            "--batch", "3", "--json", "--images", sim.default_images_path()]
    cli = json.loads(subprocess.run([exe, "step", *args], check=True, capture_output=True,
                                    text=True).stdout)
    py = sim.step(ranks=4, cp=2, tp=2, cp_layout="zigzag", seed=9, batch=3)
    for k in ("wall_ms",):
        cli.pop(k), py.pop(k)
    assert dict(py) == cli
    cli = json.loads(subprocess.run([exe, "check", "--op", "all_gather_v", "--ranks", "5",
                                     "--seed", "4", "--json"], check=True, capture_output=True,
                                    text=True).stdout)
    assert sim.check("all_gather_v", 5, 4) == cli


def test_check_and_sweep():
    for op in diffcomm._core.sim.differentiable_ops():
        rep = sim.check(op, 4, 2)
        assert rep["passed"] and rep["op"] == op and rep["rel_err"] <= rep["tolerance"]
    sw = sim.sweep((0, 2), ranks=4, tp=2, sp=True, batch=2)
    assert sw["seeds"] == 3 and sw["passed"] == 3 and sw["failures"] == []
    sw = sim.sweep((0, 1), tp=2, receiver_grad="partial", batch=2)
    assert sw["failed"] == 2 and sw["failures"][0]["seed"] == 0


def test_bad_options_raise_invalid_argument():
    with pytest.raises(diffcomm.InvalidArgument):
        sim.step(ranks=6, cp=4)
    with pytest.raises(diffcomm.InvalidArgument):
        sim.step(tp=2, ffn=3)
    with pytest.raises(diffcomm.InvalidArgument, match="--sp-chunks"):
        sim.step(tp=2, sp=True, sp_chunks=0)
    with pytest.raises(diffcomm.InvalidArgument):
        sim.run(0, lambda r, g: None)
