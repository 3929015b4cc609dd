"""``compute``'s value checks (``config.check_values``) and empty-batch errors: every input it trains on is checked
where the mask is 1, eagerly with the first bad position, under jit through ``chex.chexify``; checks never change
the outputs of good inputs."""

import re

import chex
import jax
import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig

NAN = np.nan
MASK = np.float32([[1, 1, 0], [1, 0, 0]])
GOOD = {
    "logprobs": np.float32([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]]),
    "advantages": np.float32([1.0, -1.0]),
    "proximal_logprobs": np.float32([[-1.1, -1.9, NAN], [-0.4, 0.0, NAN]]),
    "rollout_logprobs": np.float32([[-1.2, -1.8, 0.0], [-0.6, 5.0, NAN]]),
    "ref_logprobs": np.float32([[-1.0, -1.0, NAN], [-1.0, NAN, NAN]]),
}
CONFIG = CorrectionConfig(importance=corrections.ImportanceWeights("token", high=2.0), kl_coef=0.1)


def run(arrays, config=CONFIG, mask=MASK):
    arrays = dict(arrays)
    return corrections.compute(arrays.pop("logprobs"), arrays.pop("advantages"), mask, config, **arrays)


def with_value(name, position, value):
    arrays = {key: array.copy() for key, array in GOOD.items()}
    arrays[name][position] = value
    return arrays


BAD = [  # (argument, position, value, message of an eager call)
    ("logprobs", (1, 0), NAN,
     "logprobs must be finite where the mask is 1; first bad value nan at (row, column) = (1, 0)"),
    ("logprobs", (0, 1), 0.5,
     "logprobs must be <= 0.001 where the mask is 1; first bad value 0.5 at (row, column) = (0, 1)"),
    ("advantages", (1,), NAN,
     "advantages must be finite where the mask is 1; first bad value nan at (row, column) = (1, 0)"),
    ("proximal_logprobs", (0, 1), NAN,
     "proximal_logprobs must be finite where the mask is 1; first bad value nan at (row, column) = (0, 1)"),
    ("ref_logprobs", (0, 0), -np.inf,
     "ref_logprobs must be finite where the mask is 1; first bad value -inf at (row, column) = (0, 0)"),
    ("rollout_logprobs", (1, 0), np.inf,
     "rollout_logprobs must be finite where the mask is 1; first bad value inf at (row, column) = (1, 0)"),
]


def checked_under_jit(config):
    """The jitted call with its value checks turned into a synchronous raise."""
    return chex.chexify(jax.jit(lambda arrays: run(arrays, config)), async_check=False)


@pytest.mark.parametrize("check_values", [None, True])
@pytest.mark.parametrize("name, position, value, message", BAD)
def test_eager_call_names_argument_position_and_value(name, position, value, message, check_values):
    """Eager calls check by default; the bound on logprobs (the +0.5 case) only with check_values=True."""
    if value == 0.5 and check_values is None:
        assert np.isfinite(float(run(with_value(name, position, value)).loss))
        return
    with pytest.raises(AssertionError, match=f"^{re.escape(message)}$"):
        run(with_value(name, position, value), CONFIG.replace(check_values=check_values))


@pytest.mark.parametrize("name, position, value, message", BAD)
def test_checked_call_under_jit_raises_naming_argument(name, position, value, message):
    with pytest.raises(AssertionError, match=re.escape(message.split(";")[0])):
        checked_under_jit(CONFIG.replace(check_values=True))(with_value(name, position, value))


@pytest.mark.parametrize("name, position, value, message", BAD)
def test_unchecked_calls_return_as_before(name, position, value, message):
    """check_values=False (eager) and the default under jit run no check and give the same outputs."""
    arrays = with_value(name, position, value)
    eager = run(arrays, CONFIG.replace(check_values=False))
    jitted = jax.jit(lambda arrays: run(arrays))(arrays)
    chex.assert_trees_all_close(eager, jitted, rtol=1e-6)


def test_checks_leave_good_outputs_unchanged():
    """Checked and unchecked calls on good inputs (NaN / inf / positive values only in padding) are identical."""
    unchecked = run(GOOD, CONFIG.replace(check_values=False))
    chex.assert_trees_all_equal(run(GOOD), unchecked)
    chex.assert_trees_all_equal(run(GOOD, CONFIG.replace(check_values=True)), unchecked)
    chex.assert_trees_all_equal(checked_under_jit(CONFIG.replace(check_values=True))(GOOD),
                                jax.jit(lambda arrays: run(arrays, CONFIG.replace(check_values=False)))(GOOD))


def test_advantages_of_a_padded_row_are_not_checked():
    arrays = dict(GOOD, advantages=np.float32([1.0, NAN]))
    assert np.isfinite(float(run(arrays, mask=np.float32([[1, 1, 0], [0, 0, 0]])).loss))


def test_bypass_nan_advantages_raise_instead_of_nan_gradients():
    """Before: eager and jitted gradients held NaN; now the eager gradient raises, and so does the checked jit."""
    roll, mask = GOOD["rollout_logprobs"], MASK
    advantages = np.float32([[1.0, NAN, 1.0], [1.0, 1.0, 1.0]])

    def loss(lp, config):
        return corrections.compute(lp, advantages, mask, config, rollout_logprobs=roll).loss

    bypass = CorrectionConfig(mode="bypass")
    lp = GOOD["logprobs"]
    with pytest.raises(AssertionError, match=r"^advantages must be finite .* \(row, column\) = \(0, 1\)"):
        jax.grad(loss)(lp, bypass)
    checked = chex.chexify(jax.jit(jax.grad(lambda lp: loss(lp, bypass.replace(check_values=True)))),
                           async_check=False)
    with pytest.raises(AssertionError, match="advantages must be finite where the mask is 1"):
        checked(lp)
    assert np.isnan(jax.grad(loss)(lp, bypass.replace(check_values=False))).any()


def test_checked_call_under_jit_needs_chexify():
    """Without the wrapper, check_values=True fails while tracing: never a silent unchecked run."""
    with pytest.raises(RuntimeError, match="chexify"):
        jax.jit(lambda arrays: run(arrays, CONFIG.replace(check_values=True)))(GOOD)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
@pytest.mark.parametrize("jit", [False, True])
def test_empty_batch_names_the_shape(shape, jit):
    arrays = {name: np.zeros(shape[:1] if name == "advantages" else shape, np.float32) for name in GOOD}
    call = jax.jit(lambda arrays: run(arrays, mask=np.ones(shape))) if jit else lambda arrays: run(arrays,
                                                                                                 mask=np.ones(shape))
    with pytest.raises(ValueError, match=re.escape(f"logprobs: shape {shape} is empty; compute needs B >= 1 rows")):
        call(arrays)
