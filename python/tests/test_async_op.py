"""async_op=True on diffcomm.torch's collectives: a completed Work as torch.distributed returns
(wait(), is_completed(), result(), get_future()), holding the same values as the plain call."""
import pytest

torch = pytest.importorskip("torch")

import diffcomm.sim as sim  # noqa: E402
import diffcomm.torch as dt  # noqa: E402


def test_every_collective_returns_a_completed_work_with_its_result():
    def fn(rank, world):
        x = torch.arange(4.0) + rank
        got = {}
        for name, call in {
            "all_reduce": lambda **k: dt.all_reduce(x, **k),
            "broadcast": lambda **k: dt.broadcast(x, src=1, **k),
            "all_gather": lambda **k: dt.all_gather(x, **k),
            "all_gather_single": lambda **k: dt.all_gather_single(x, **k),
            "reduce_scatter_single": lambda **k: dt.reduce_scatter_single(
                torch.arange(6.0) + rank, **k),
            "all_to_all_single": lambda **k: dt.all_to_all_single(torch.arange(3.0) + rank, **k),
            "all_reduce_": lambda **k: dt.all_reduce_(x.clone(), **k),
        }.items():
            plain = call()
            work = call(async_op=True)
            assert work.wait() is True and work.is_completed() and work.is_success()
            assert work.exception() is None
            plain_list = list(plain) if isinstance(plain, tuple) else [plain]
            assert len(work.result()) == len(plain_list), name
            for a, b in zip(work.result(), plain_list):
                assert torch.equal(a, b), name
            assert torch.equal(work.get_future().value()[0], plain_list[0]), name
            assert name in repr(work)
            got[name] = [t.tolist() for t in work.result()]
        return got

    results = sim.run(3, fn).results
    assert results[0]["all_reduce"] == [[3.0, 6.0, 9.0, 12.0]]
    assert results[2]["broadcast"] == [[1.0, 2.0, 3.0, 4.0]]
    assert results[1]["all_gather"] == [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0],
                                        [2.0, 3.0, 4.0, 5.0]]


def test_async_op_keeps_the_gradient():
    def fn(rank, world):
        x = torch.full((2,), float(rank + 1), requires_grad=True)
        y = dt.all_reduce(x, async_op=True).result()[0]
        (y * (rank + 1)).sum().backward()
        return x.grad.tolist()

    # d/dx_r sum_s (s+1) * sum_q x_q = sum_s (s+1) = 6 on every rank of 3
    assert sim.run(3, fn).results == [[6.0, 6.0]] * 3
