"""diffcomm.sim.check_equivalence: hand-made steps with closed-form gradients,
the errors, and the mutation suite of examples/python/equivalence (a correct
VLM-style step on drawn meshes; each public bug shape flagged with its
parameter and factor or shards)."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffcomm
import diffcomm.sim as dsim
import diffcomm.torch as dt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python",
                                "equivalence"))
from mutations import (EncoderLossScaled, PartialTwiceOverTp, PerRankLossNorm,  # noqa: E402
                       SliceOnlyBackward)
from vlm_step import VlmStep  # noqa: E402

# Global data of the hand-made steps: 8 rows x 2; d/dw sum(data * w) = column sums.
DATA = torch.arange(16, dtype=torch.float64).reshape(8, 2)
COLUMN_SUMS = torch.tensor([56.0, 64.0], dtype=torch.float64)  # 0+2+..+14, 1+3+..+15


def _rows(mesh, dim):
    """This rank's contiguous rows of DATA along mesh dim `dim`."""
    n, k = mesh.size(dim), mesh.coordinate(dim)
    return DATA[k * 8 // n:(k + 1) * 8 // n]


def partial_step(rank, mesh, seed):
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    (w * _rows(mesh, "dp")).sum().backward()
    return {"w": (w.grad, dsim.Partial("dp"))}


def reduced_twice_step(rank, mesh, seed):
    g = partial_step(rank, mesh, seed)["w"][0]
    return {"w": (dt.all_reduce(g.clone(), "sum", mesh.group("dp")), dsim.Partial("dp"))}


def test_placements_reassemble_to_the_closed_form():
    assert torch.equal(DATA.sum(0), COLUMN_SUMS)

    def step(rank, mesh, seed):
        g = partial_step(rank, mesh, seed)["w"][0]
        full = dt.all_reduce(g.clone(), "sum", mesh.group("dp"))
        chunks = torch.chunk(DATA[:5], mesh.size("tp"))  # 5 rows on tp = 3: 2, 2, 1
        return {"w": (full, dsim.Replicate()), "p": (g, dsim.Partial("dp")),
                "s": (chunks[mesh.coordinate("tp")].clone(), dsim.Shard(0, "tp"))}

    report = dsim.check_equivalence(step, [{"dp": 4, "tp": 1}, {"dp": 2, "tp": 3}])
    assert report.ok, str(report)
    assert str(report).splitlines() == [
        "mesh {dp: 4, tp: 1}: all 3 gradients match the reference (max rel error 0)",
        "mesh {dp: 2, tp: 3}: all 3 gradients match the reference (max rel error 0)"]


def test_partial_reduced_twice_is_dp_times_the_reference():
    report = dsim.check_equivalence(reduced_twice_step, [{"dp": 4}, {"dp": 2, "tp": 2}])
    assert not report.ok
    f = report.finding(0, "w")
    assert f.factor == pytest.approx(4.0, rel=1e-15) and f.factor_fits
    assert f.expressions == ["dp"]
    assert str(report.meshes[0]) == "w: grad = 4.000 x reference = dp on mesh {dp: 4, tp: 1}"
    tie = report.finding(1, "w")  # dp = tp = 2: a factor of 2 is either
    assert tie.expressions == ["dp", "tp"]
    assert "dp or tp (a tie" in str(report.meshes[1])


def test_float32_factor_is_matched_within_rtol():
    # float32 rounding leaves ~1e-7 between g and 4 r: not a multiple at the
    # float64 factor tolerance (1e-9), tp x at the default max(1e-9, rtol).
    x = torch.sin(torch.arange(24, dtype=torch.float32).reshape(8, 3) * 3.3)

    def step(rank, mesh, seed):
        n, k = mesh.size("tp"), mesh.coordinate("tp")
        g = x[k * 8 // n:(k + 1) * 8 // n].sum(0)
        return {"w": (dt.all_reduce(g, "sum", mesh.group("tp")), dsim.Partial("tp"))}

    strict = dsim.check_equivalence(step, [{"tp": 4}], rtol=1e-5, factor_rtol=1e-9)
    assert not strict.finding(0, "w").factor_fits
    f = dsim.check_equivalence(step, [{"tp": 4}], rtol=1e-5).finding(0, "w")
    assert f.factor_fits and f.expressions == ["tp"]


def test_divergent_replicas_are_named():
    def step(rank, mesh, seed):
        g = COLUMN_SUMS.clone()
        if mesh.coordinate("dp") == 1 and mesh.coordinate("tp") == 1:
            g[0] += 1
        return {"w": (g, dsim.Replicate())}

    f = dsim.check_equivalence(step, [{"dp": 2, "tp": 2}]).finding(0, "w")
    assert not f.ok and f.divergent_ranks == [3]  # rank of (dp 1, tp 1)


def test_bad_inputs_name_parameter_and_rank():
    def unknown(rank, mesh, seed):
        return {"w": (COLUMN_SUMS.clone(), dsim.Partial("pp"))}

    with pytest.raises(diffcomm.InvalidArgument, match=r"parameter 'w' on rank 0: placement "
                       r"Partial\(pp\) names mesh dim 'pp'"):
        dsim.check_equivalence(unknown, [{"dp": 2}])

    def shape(rank, mesh, seed):
        return {"w": (torch.zeros(2 + mesh.size("dp"), dtype=torch.float64), dsim.Replicate())}

    with pytest.raises(diffcomm.InvalidArgument,
                       match=r"parameter 'w' on rank 0 \(Replicate\(\)\): shape \[4\], expected "
                             r"\[3\]"):
        dsim.check_equivalence(shape, [{"dp": 2}])

    def not_a_pair(rank, mesh, seed):
        return {"w": COLUMN_SUMS}

    with pytest.raises(TypeError, match="parameter 'w' on rank 0: expected"):
        dsim.check_equivalence(not_a_pair, [{"dp": 2}])

    def raises(rank, mesh, seed):
        if mesh.size("dp") > 1 and rank == 1:
            raise ValueError("boom")
        return {"w": (COLUMN_SUMS.clone(), dsim.Replicate())}

    with pytest.raises(ValueError, match="boom") as info:
        dsim.check_equivalence(raises, [{"dp": 2}])
    assert info.value.rank == 1


# ------------------------------------------------------------ the mutation suite
def _mesh(dp, cp, tp):
    return {"dp": dp, "cp": cp, "tp": tp}


meshes = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]),
                   st.sampled_from([1, 2, 4])).filter(lambda m: m[0] * m[1] * m[2] <= 16)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(meshes, min_size=1, max_size=2, unique=True))
def test_vlm_step_equals_one_rank(drawn):
    report = dsim.check_equivalence(VlmStep(), [_mesh(*m) for m in drawn])
    assert report.ok, str(report)
    for m in report.meshes:
        assert max(f.max_rel_error for f in m.params) <= 1e-12


def test_vlm_step_on_world_16():
    report = dsim.check_equivalence(VlmStep(), [_mesh(2, 2, 4), _mesh(4, 2, 2)])
    assert report.ok, str(report)


def _ok(report, mesh_index, names):
    for n in names:
        assert report.finding(mesh_index, n).ok, str(report)


ALL = ["encoder.w", "encoder.adapter", "decoder.a", "decoder.norm"]


def test_per_rank_loss_normalization_is_world_times():
    report = dsim.check_equivalence(PerRankLossNorm(), [_mesh(2, 1, 4), _mesh(2, 2, 2)])
    for name in ALL:
        f = report.finding(0, name)
        assert f.factor == pytest.approx(8.0, rel=1e-12) and f.expressions == ["dp*tp"], name
        f = report.finding(1, name)
        assert f.factor == pytest.approx(8.0, rel=1e-12) and f.expressions == ["world"], name
    assert ("encoder.w: grad = 8.000 x reference = dp*tp on mesh {dp: 2, cp: 1, tp: 4}"
            in str(report).splitlines())


def test_partial_reduced_twice_over_tp():
    report = dsim.check_equivalence(PartialTwiceOverTp(), [_mesh(2, 1, 4), _mesh(1, 2, 2)])
    _ok(report, 0, ["encoder.w", "encoder.adapter", "decoder.a"])
    f = report.finding(0, "decoder.norm")
    assert f.factor == pytest.approx(4.0, rel=1e-12) and f.expressions == ["tp"]
    f = report.finding(1, "decoder.norm")  # cp = tp = 2: an honest tie
    assert f.factor == pytest.approx(2.0, rel=1e-12) and f.expressions == ["cp", "tp"]


def test_encoder_loss_scaled_by_encoder_dp_over_llm_dp():
    report = dsim.check_equivalence(EncoderLossScaled(), [_mesh(2, 1, 4), _mesh(2, 2, 2)])
    _ok(report, 0, ["decoder.a", "decoder.norm"])
    for name in ["encoder.w", "encoder.adapter"]:
        f = report.finding(0, name)
        assert f.factor == pytest.approx(4.0, rel=1e-12) and f.expressions == ["tp"]
        f = report.finding(1, name)  # cp*tp = 4 = dp*cp = dp*tp on this mesh
        assert f.factor == pytest.approx(4.0, rel=1e-12)
        assert f.expressions == ["dp*cp", "dp*tp", "cp*tp"]


def test_slice_only_backward_of_the_exchange():
    # dp 0 holds samples 0, 1: one image, inside tokens 0-15 of tp rank 0
    # (its producer); dp 1 holds samples 2, 3, and sample 2's image straddles
    # tokens 15/16, so some of its rows always come from another rank.
    report = dsim.check_equivalence(SliceOnlyBackward(), [_mesh(2, 1, 2)])
    _ok(report, 0, ["decoder.a", "decoder.norm"])
    w = report.finding(0, "encoder.w")
    assert not w.ok and not w.factor_fits
    adapter = report.finding(0, "encoder.adapter")
    assert not adapter.ok and adapter.differing_shards == [1]
    assert "encoder.adapter: shards dp=1 of Shard(0, dp) differ" in str(report)


def test_readme_example():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python",
                        "equivalence", "readme_example.py")
    r = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[2:] == ["w: grad = 2.000 x reference = dp on mesh {dp: 2, tp: 3}",
                         "w: grad = 4.000 x reference = dp on mesh {dp: 4, tp: 2}"], r.stdout


def test_nested_placement_list_and_missing_gradient():
    # DATA's rows cut by dp, then each dp piece by tp: [Shard(0, dp), Shard(0, tp)].
    def step(rank, mesh, seed):
        dp, tp = mesh.size("dp"), mesh.size("tp")
        k = mesh.coordinate("dp") * tp + mesh.coordinate("tp")
        rows = DATA[k * 8 // (dp * tp):(k + 1) * 8 // (dp * tp)].clone()
        missing = None if mesh.coordinate("tp") == 1 else COLUMN_SUMS.clone()
        return {"rows": (rows, [dsim.Shard(0, "dp"), dsim.Replicate(), dsim.Shard(0, "tp")]),
                "m": (missing, dsim.Replicate())}

    report = dsim.check_equivalence(step, [{"dp": 2, "tp": 2}])
    rows, m = report.finding(0, "rows"), report.finding(0, "m")
    assert rows.ok and rows.placement_str == "[Shard(0, dp), Shard(0, tp)]", str(report)
    assert m.missing_ranks == [1, 3] and not m.ok


def test_step_equivalence_judges_the_decoder_input_shards():
    rep = dsim.step(ranks=8, cp=2, tp=2, sp=True, cp_layout="zigzag", equivalence=True)
    assert rep.passed, rep.text
    params = {p["name"]: p for p in rep["equivalence"]["params"]}
    assert params["decoder.input"]["placement"] == "[Shard(0, dp), Partial(cp), Partial(tp)]"
    assert params["decoder.input"]["ok"] and params["encoder.w"]["ok"]
    bad = dsim.step(ranks=4, tp=4, receiver_grad="partial", equivalence=True)
    assert bad.exit_code == 1
    assert "encoder.w: grad = 4.000 x reference = tp on mesh {dp: 1, cp: 1, tp: 4}" in bad.text
    assert "equivalence" not in dsim.step(ranks=2, tp=2)
