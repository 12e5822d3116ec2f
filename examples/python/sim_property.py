"""A property test of the encoder-parallel exchange in the simulated world.

    python examples/python/sim_property.py        # or: pytest examples/python/sim_property.py

hypothesis draws a decoder mesh (cp, tp, SP, contiguous/zigzag CP) and a
batch of image sizes; diffcomm.sim.run runs the torch training step on every
rank (one OS thread each, one at a time, seeded); every rank's decoder shard
and encoder gradient must equal the single-rank float64 reference. A failure
prints the example and its seed, which reproduces the same interleaving.
"""
import os
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import diffcomm.sim as sim  # noqa: E402
from encoder_parallel_step import StepConfig, check, step  # noqa: E402


@settings(max_examples=20, deadline=None)
@given(cp=st.integers(1, 3), tp=st.integers(1, 3), sp=st.booleans(), zigzag=st.booleans(),
       images=st.lists(st.lists(st.tuples(st.integers(28, 500), st.integers(28, 500)),
                                max_size=3), min_size=1, max_size=3),
       seed=st.integers(0, 10**6))
def test_exchange_matches_reference(cp, tp, sp, zigzag, images, seed):
    cfg = StepConfig(cp=cp, tp=tp, sp=sp and tp > 1, layout="zigzag" if zigzag else "contiguous",
                     ffn=2 * tp, images=images, seed=seed)
    result = sim.run(cfg.world_size, lambda rank, group: step(rank, group, cfg), seed=seed)
    check(cfg, result.results)


if __name__ == "__main__":
    test_exchange_matches_reference()
    print("sim_property: 20 random meshes and batches equal the single-rank reference")
