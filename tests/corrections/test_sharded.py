"""A batch sharded over devices (conftest: 8 CPU devices) stays sharded through ``compute`` and gives the
numbers of the unsharded batch, with Auto axes (the learner's mesh) and Explicit ones (``jax.make_mesh``'s
default, a notebook's)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import corrections

CONFIG = corrections.preset("decoupled_geo_rs_token_tis")


def _batch(batch=16, length=8192, seed=0):
    rng = np.random.default_rng(seed)
    mask = (np.arange(length)[None] < rng.integers(0, length + 1, batch)[:, None]).astype(np.float32)
    old = rng.uniform(-3, -0.1, (batch, length)).astype(np.float32)
    lp = old + rng.normal(0, 0.05, old.shape).astype(np.float32)
    roll = old + rng.normal(0, 0.001, old.shape).astype(np.float32)
    return lp, old, roll, mask, rng.normal(size=batch).astype(np.float32)


def _compute(lp, old, roll, mask, adv):
    return corrections.compute(lp, adv, mask, CONFIG, proximal_logprobs=old, rollout_logprobs=roll)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_batch_stays_sharded_and_matches_unsharded(axis_type):
    host = _batch()  # long rows: a single CPU device would walk them in chunks of 8 (CHUNK_ELEMENTS)
    want = _compute(*host)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(axis_type,))
    sharded = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in host]
    fn = jax.jit(_compute)
    got = fn(*sharded)
    compiled = fn.lower(*sharded).compile().as_text()
    assert "all-gather" not in compiled  # each device works on its own rows
    for name in ("weights", "mask", "per_token_loss"):
        assert getattr(got, name).sharding.spec[0] == "data", name
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
    for key, value in want.metrics.items():
        np.testing.assert_allclose(got.metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
