"""The package's shape: real submodules, ReduceOp as a type, stubs generated
by the build and installed with the extension."""
import os
import re

import pytest

import diffcomm
import diffcomm.sim as sim
from diffcomm import _core


def public(module):
    return sorted(n for n in dir(module) if not n.startswith("_"))


def test_nn_and_encoder_parallel_are_importable_modules():
    import diffcomm.encoder_parallel as ep
    import diffcomm.nn as nn
    from diffcomm.nn import all_reduce  # noqa: F401

    assert sorted(nn.__all__) == public(_core.nn)  # every binding re-exported
    assert sorted(ep.__all__) == public(_core.encoder_parallel)
    assert nn.all_reduce is _core.nn.all_reduce and ep.plan_exchange is _core.encoder_parallel.plan_exchange


def test_reduce_op_is_a_type_and_names_convert():
    R = diffcomm.ReduceOp
    assert R.MAX == R("max") and R.SUM != R.AVG
    assert R.premul_sum(0.5).name == "premul_sum(0.5)" and R.premul_sum(0.5).factor == 0.5
    assert repr(R.PRODUCT) == "diffcomm.ReduceOp(product)"
    assert len({R.SUM, R("sum"), R.MIN}) == 2
    with pytest.raises(diffcomm.InvalidArgument, match="unknown reduce op 'median'"):
        R("median")


def test_nn_ops_take_a_reduce_op_or_its_name():
    def fn(rank, world):
        x = _core.from_list([float(rank)], [1])
        by_type = diffcomm.nn.all_reduce(x, world, diffcomm.ReduceOp.MAX).tolist()
        by_name = diffcomm.nn.all_reduce(x, world, "min").tolist()
        default = diffcomm.nn.all_reduce(x, world).tolist()
        return by_type, by_name, default

    assert sim.run(3, fn).results == [([2.0], [0.0], [3.0])] * 3


def test_stubs_are_installed_and_match_the_binding():
    stubs = os.path.join(os.path.dirname(_core.__file__), "_core")
    text = open(os.path.join(stubs, "__init__.pyi")).read()
    declared = set(re.findall(r"^(?:def|class) (\w+)", text, re.M))
    missing = [n for n in public(_core) if callable(getattr(_core, n)) and n not in declared]
    assert not missing, missing
    nn_text = open(os.path.join(stubs, "nn.pyi")).read()
    assert all(f"def {n}(" in nn_text for n in public(_core.nn))


def test_import_diffcomm_reaches_every_submodule_lazily():
    """`import diffcomm` then diffcomm.sim / diffcomm.torch, as torch's submodules; torch itself
    is imported only when diffcomm.torch is first used."""
    import subprocess
    import sys

    code = ("import sys, diffcomm\n"
            "assert 'torch' not in sys.modules and 'diffcomm.sim' not in sys.modules\n"
            "assert diffcomm.sim.run is sys.modules['diffcomm.sim'].run\n"
            "assert 'sim' in dir(diffcomm) and 'torch' in dir(diffcomm)\n"
            "assert 'torch' not in sys.modules\n"
            "help(diffcomm.sim.run)\n"
            "assert diffcomm.torch.all_reduce and 'torch' in sys.modules\n"
            "try:\n    diffcomm.nosuch\nexcept AttributeError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR module 'diffcomm' has no attribute 'nosuch'" in out.stdout


def test_errors_are_runtime_errors_and_python_builtins_catch_theirs():
    """diffcomm.Error is a RuntimeError (as torch.distributed's errors); InvalidArgument is also a
    ValueError and Timeout a TimeoutError, so Python's own except clauses catch them."""
    assert issubclass(diffcomm.Error, RuntimeError)
    for cls in (diffcomm.InvalidArgument, diffcomm.CollectiveMismatch, diffcomm.Deadlock,
                diffcomm.RankFailure, diffcomm.Timeout, diffcomm.BackendError,
                diffcomm.ResourceExhausted):
        assert issubclass(cls, diffcomm.Error) and issubclass(cls, RuntimeError), cls
    assert issubclass(diffcomm.InvalidArgument, ValueError)
    assert issubclass(diffcomm.Timeout, TimeoutError)
    assert issubclass(diffcomm.ResourceExhausted, MemoryError)
    assert not issubclass(diffcomm.Deadlock, (ValueError, TimeoutError))
    with pytest.raises(ValueError, match="unknown reduce op 'median'") as info:
        diffcomm.ReduceOp("median")  # raised in C++, translated by the binding
    assert type(info.value) is diffcomm.InvalidArgument
    assert "unknown reduce op 'median'" in str(info.value)
    try:
        raise diffcomm.Timeout("all_reduce #3 on group 'world': timed out after 5 s")
    except TimeoutError as e:
        assert str(e) == "all_reduce #3 on group 'world': timed out after 5 s"


@pytest.mark.skipif("ASAN_OPTIONS" in os.environ, reason="AddressSanitizer aborts on such requests")
def test_a_tensor_beyond_memory_is_resource_exhausted_naming_its_bytes():
    """Issue [4/7] item 4: out of memory is a ResourceExhausted (also a MemoryError) that names
    what was being allocated and how much, here and from a simulated rank."""
    with pytest.raises(MemoryError, match="cannot allocate 140737488355328 bytes") as info:
        _core.zeros([1 << 45], "float32")
    assert type(info.value) is diffcomm.ResourceExhausted
    for isolation in ("thread", "process"):
        with pytest.raises(diffcomm.ResourceExhausted,
                           match="cannot allocate 140737488355328 bytes") as info:
            sim.run(2, lambda rank, group: _core.zeros([1 << 45 if rank == 1 else 1], "float32"),
                    isolation=isolation)
        assert info.value.rank == 1, isolation


@pytest.mark.skipif(_core.HAVE_MPI, reason="this build has MPI")
def test_mpi_in_a_build_without_it_says_how_to_get_it():
    """The wheel (scripts/build-wheel) has no MPI: asking for it names the way to a build that has
    it and the transport that needs none."""
    import diffcomm.torch as dt  # noqa: PLC0415 (imports torch)

    with pytest.raises(diffcomm.BackendError, match=r"built without MPI .*pip install ./python"):
        dt.init_process_group("mpi")
