"""diffcomm.torch's in-place forms, all_reduce_ and broadcast_, in the
simulated world: values against closed forms computed here from every rank's
data (float64, integer-valued, so sums are exact), bit-identity with the
out-of-place ops, torch's version counter, and the errors at the boundary.
The same ops over MPI and torch's gloo: tests/distributed/test_torch_ops.py."""
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffcomm
import diffcomm.sim as sim
import diffcomm.torch as dt

f64 = torch.float64


def data(rank, shape, dtype, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def closed_form(xs, op):
    stack = torch.stack([x.to(f64) for x in xs])
    return {
        "sum": stack.sum(0),
        "avg": stack.sum(0) / len(xs),
        "max": stack.max(0).values,
        "min": stack.min(0).values,
        "product": stack.prod(0),
    }[op]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.integers(1, 5), shape=st.sampled_from([(0,), (1,), (3,), (2, 5)]),
       dtype=st.sampled_from([torch.float64, torch.float32]),
       op=st.sampled_from(["sum", "avg", "max", "min", "product"]), seed=st.integers(0, 99))
def test_all_reduce_in_place_is_the_closed_form_and_the_out_of_place_op(world, shape, dtype, op,
                                                                       seed):
    def fn(rank, group):
        x = data(rank, shape, dtype, seed)
        before = x._version
        out_of_place = dt.all_reduce(x, op)
        y = dt.all_reduce_(x, op)
        assert y is x and x._version > before
        return x, out_of_place

    res = sim.run(world, fn, seed=seed).results
    expected = closed_form([data(r, shape, dtype, seed) for r in range(world)], op)
    for x, out_of_place in res:
        assert torch.equal(x, out_of_place)  # bit for bit
        torch.testing.assert_close(x.to(f64), expected, rtol=1e-6 if dtype == torch.float32 else 0,
                                   atol=0)


@settings(max_examples=15, deadline=None)
@given(world=st.integers(1, 5), data_=st.data())
def test_broadcast_in_place_gives_every_rank_src_tensor(world, data_):
    src = data_.draw(st.integers(0, world - 1))

    def fn(rank, group):
        x = data(rank, (2, 3), f64, 5)
        assert dt.broadcast_(x, src=src) is x
        return x

    for x in sim.run(world, fn).results:
        assert torch.equal(x, data(src, (2, 3), f64, 5))


def test_broadcast_in_place_in_a_subgroup_takes_global_or_group_src():
    def fn(rank, world):
        g = dt.new_group([1, 3], world)
        if g is None:
            return None
        a, b = torch.full((2,), float(rank)), torch.full((2,), float(rank))
        dt.broadcast_(a, src=3, group=g)  # global rank
        dt.broadcast_(b, group=g, group_src=1)  # the same member, group-local
        return a.tolist(), b.tolist()

    assert sim.run(4, fn).results == [None, ([3.0, 3.0], [3.0, 3.0]), None,
                                      ([3.0, 3.0], [3.0, 3.0])]


def test_a_tensor_requiring_grad_is_refused_unless_grad_mode_is_off():
    def fn(rank, world):
        w = torch.ones(2, requires_grad=True)
        with pytest.raises(diffcomm.InvalidArgument) as e:
            dt.all_reduce_(w)
        assert (f"diffcomm.torch.all_reduce_ on group 'world' (rank {rank} of 2)" in str(e.value)
                and "use all_reduce" in str(e.value))
        with pytest.raises(diffcomm.InvalidArgument, match="broadcast_ on group 'world'"):
            dt.broadcast_(w, src=0)
        with torch.no_grad():  # e.g. an optimizer's update of a replicated parameter
            dt.all_reduce_(w)
        return w.tolist(), w.requires_grad

    assert sim.run(2, fn).results == [([2.0, 2.0], True)] * 2


def test_overwriting_a_tensor_torch_saved_for_backward_fails_backward():
    # torch counts the write: without the version bump torch would compute
    # w's gradient from the reduced x (silently wrong).
    def fn(rank, world):
        w = torch.ones(3, requires_grad=True)
        x = torch.full((3,), float(rank + 1))
        loss = (w * x).sum()  # mul saves x for w's gradient
        dt.all_reduce_(x)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        return True

    assert sim.run(2, fn).results == [True, True]


def test_bad_inputs_are_named():
    def fn(rank, world):
        with pytest.raises(TypeError, match="all_reduce_: expected a torch.Tensor, got list"):
            dt.all_reduce_([1.0])
        with pytest.raises(diffcomm.InvalidArgument):
            dt.all_reduce_(torch.ones(4, 4).t())  # not contiguous: never copied silently
        with pytest.raises(diffcomm.InvalidArgument, match="src"):
            dt.broadcast_(torch.ones(1))  # neither src nor group_src
        return True

    assert sim.run(2, fn).results == [True, True]


def test_mismatched_in_place_calls_are_reported_on_every_rank():
    def fn(rank, world):
        try:
            dt.all_reduce_(torch.ones(3 if rank == 1 else 2, dtype=f64))
        except diffcomm.CollectiveMismatch as e:
            return str(e)
        return None

    for m in sim.run(3, fn, seed=4).results:
        assert m is not None and "shape differs" in m, m


def test_an_inference_tensor_is_reduced_in_place_without_error():
    # A metric computed under inference_mode, reduced outside it: no version
    # counter to bump (torch 1.13 refused the fallback's copy_ after the write).
    def fn(rank, world):
        with torch.inference_mode():
            x = torch.full((3,), float(rank + 1))
        dt.all_reduce_(x)
        dt.broadcast_(x, src=0)
        return x.tolist()

    assert sim.run(2, fn).results == [[3.0, 3.0, 3.0]] * 2


def test_tensors_diffcomm_cannot_read_as_they_are_refused_by_name():
    def fn(rank, world):
        where = f"on group 'world' (rank {rank} of 2)"
        neg = torch._neg_view(torch.tensor([1.0, 2.0]))  # memory +1, +2; values -1, -2
        for op in (dt.all_reduce, dt.all_reduce_):
            with pytest.raises(diffcomm.InvalidArgument, match="lazily negated"):
                op(neg, "max")
        with pytest.raises(diffcomm.InvalidArgument, match="has no memory"):
            dt.all_reduce(torch._efficientzerotensor(3))
        # A meta tensor has no data: named, not torch's bare BufferError ("Cannot pack tensors
        # on meta"), on the fast path and through the autograd bridge.
        for meta in (torch.empty(3, device="meta"),
                     torch.empty(3, device="meta", requires_grad=True)):
            with pytest.raises(diffcomm.InvalidArgument,
                               match=re.escape(f"diffcomm.torch.all_reduce {where}: ") +
                               "the tensor is on the meta device and has no data"):
                dt.all_reduce(meta)
        with pytest.raises(diffcomm.InvalidArgument) as e:
            dt.all_reduce_(torch.ones(2, dtype=torch.int16))
        assert where in str(e.value) and "dtype int16" in str(e.value)
        for op in (1, True, 0):  # torch 2's ReduceOp enum compares equal to ints
            with pytest.raises(diffcomm.InvalidArgument, match="unknown reduce op"):
                dt.all_reduce_(torch.ones(2), op)
        with pytest.raises(TypeError, match=re.escape(f"broadcast_ {where}: src must be an int, "
                                                      "got 1.0")):
            dt.broadcast_(torch.ones(2), src=1.0)
        with pytest.raises(diffcomm.InvalidArgument, match=r"src=1099511627776 is not a rank"):
            dt.broadcast_(torch.ones(2), src=2**40)
        with pytest.raises(diffcomm.InvalidArgument, match=re.escape(
                f"broadcast {where}: diffcomm: global rank 5 is not a member")):
            dt.broadcast(torch.ones(2), src=5)
        with pytest.raises(TypeError, match="group must be a diffcomm ProcessGroup"):
            dt.all_reduce_(torch.ones(2), group="world")
        dt.broadcast_(torch.ones(2), src=np_int(1))  # numpy integers are ranks
        return True

    assert sim.run(2, fn).results == [True, True]


def np_int(v):
    import numpy  # noqa: PLC0415 (only this test needs it)

    return numpy.int64(v)


def test_every_op_names_itself_when_it_refuses_an_input():
    # The out-of-place ops too, with and without the autograd bridge.
    def fn(rank, world):
        where = f"on group 'world' (rank {rank} of 2)"
        for requires_grad in (False, True):
            x = torch.ones(4, 4).t().detach().requires_grad_(requires_grad)  # non-contiguous
            for name, call in (("all_reduce", lambda: dt.all_reduce(x)),
                               ("all_gather_single", lambda: dt.all_gather_single(x)),
                               ("broadcast", lambda: dt.broadcast(x, src=0))):
                with pytest.raises(diffcomm.InvalidArgument,
                                   match=re.escape(f"diffcomm.torch.{name} {where}: ")):
                    call()
        for name, call in (("all_reduce", lambda: dt.all_reduce([1.0, 2.0])),
                           ("reduce_scatter_single", lambda: dt.reduce_scatter_single(None))):
            with pytest.raises(TypeError, match=re.escape(
                    f"diffcomm.torch.{name}: expected torch.Tensor inputs, got ")):
                call()
        return True

    assert sim.run(2, fn).results == [True, True]
