"""corrections._fused_reductions: many token reductions as one variadic reduction, statistics run in lockstep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from corrections._fused_reductions import Reductions, reduce_together, reduce_tokens, vmap_statistic


@pytest.mark.parametrize("length", [1, 31, 32, 33, 100, 4096])
def test_reduce_tokens_matches_float64_sums_and_exact_extrema(length):
    rng = np.random.default_rng(length)
    x, y = rng.normal(size=(2, length)).astype(np.float32) * 10
    out = reduce_tokens(Reductions(sums={"x": x, "y": y}, maxima={"x": x}, minima={"y": y}))
    # float32 sums in windows of 32 (XLA:CPU's tree reduction): relative error ~1e-7 of the absolute sum, never
    # the ~length * 6e-8 of a sequential float32 sum.
    for name, values in (("x", x), ("y", y)):
        want = values.astype(np.float64).sum()
        assert abs(float(out.sums[name]) - want) <= 1e-6 * np.abs(values).astype(np.float64).sum()
    assert float(out.maxima["x"]) == x.max() and float(out.minima["y"]) == y.min()  # exact: no rounding
    assert set(out.maxima) == {"x"} and set(out.minima) == {"y"}


def test_reduce_tokens_of_nothing_and_of_mixed_shapes():
    assert reduce_tokens(Reductions()) == Reductions()
    with pytest.raises(ValueError, match="one shape"):
        reduce_tokens(Reductions(sums={"a": jnp.ones(3), "b": jnp.ones(4)}))


def _centred(x):
    """A two-round statistic: the sum, then the sum of squared deviations from the mean."""
    first = yield Reductions(sums={"x": x, "n": jnp.ones_like(x)})
    mean = first.sums["x"] / first.sums["n"]
    second = yield Reductions(sums={"m2": (x - mean) ** 2})
    return {"mean": mean, "m2": second.sums["m2"]}


def _largest(x):
    reduced = yield Reductions(maxima={"x": x})
    return reduced.maxima["x"]


def test_reduce_together_runs_statistics_of_different_rounds_and_keeps_other_leaves():
    x = jnp.array([1.0, 2.0, 6.0])
    out = reduce_together({"moments": _centred(x), "largest": (_largest(-x),), "kept": x, "none": None})
    np.testing.assert_allclose([float(out["moments"]["mean"]), float(out["moments"]["m2"])], [3.0, 14.0], rtol=1e-6)
    assert float(out["largest"][0]) == -1.0
    assert out["kept"] is x and out["none"] is None


def test_statistics_vmapped_under_jit_and_grad_give_per_row_values_and_no_gradient():
    rows = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)

    def loss_and_stats(values):
        stats = vmap_statistic(_centred)(values)
        return jnp.sum(values**2), stats

    (loss, stats), grad = jax.jit(jax.value_and_grad(loss_and_stats, has_aux=True))(jnp.asarray(rows))
    want = rows.astype(np.float64)
    # float32 sums of 50 values of order 1: a relative tolerance of 1e-5 covers any summation order.
    np.testing.assert_allclose(stats["mean"], want.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["m2"], ((want - want.mean(1, keepdims=True)) ** 2).sum(1), rtol=1e-5)
    np.testing.assert_allclose(grad, 2 * rows, rtol=1e-6)  # the statistics add nothing to the gradient
