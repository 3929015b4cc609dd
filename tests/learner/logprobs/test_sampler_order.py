"""The sampler's order: the learner replays mlx-lm's (top-p, min-p, top-k on the temperature-1 logprobs, then
temperature) exactly, rows of both orders share one program, RAW logprobs are rebuilt as the sampling
distribution's, and `check_capabilities` refuses what cannot be replayed.

`mlx_sampling_logprobs` is a float64 NumPy reading of mlx-lm 0.31.3's ``mlx_lm/sample_utils.py`` (``make_sampler``,
``apply_top_p``, ``apply_min_p``, ``apply_top_k``, ``categorical_sampling``) and of mlx's CPU sorts
(``mlx/backend/cpu/sort.cpp``: ``argsort`` and ``argpartition`` order equal values by index), written
independently of the JAX code. Where the ``mlx`` package imports, mlx-lm's own functions are compared too.
"""

import importlib
import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings

from learner.logprobs.sampler_replay import SamplerParams, replayed_kept, replayed_token_stats
from learner.update.batch import TrainBatch
from learner.update.logprob_mode import rebuilt_rollout_logprobs, replay_params
from rollout_client import (
    EngineCapabilities,
    EngineCapabilityError,
    LogprobMode,
    PauseMode,
    TetherEngine,
    VersionReporting,
    WeightTransport,
    check_capabilities,
)
from rollout_client.engines.base import EngineRequirements
from rollout_client.sampling_params import SamplerOrder

FIRST, LAST = SamplerOrder.TEMPERATURE_FIRST, SamplerOrder.TEMPERATURE_LAST
MLX_ORDER = ("top_p", "min_p", "top_k", "temperature")  # make_sampler's chain, then categorical_sampling


def mlx_sampling_logprobs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
                          ) -> tuple[np.ndarray, float]:
    """mlx-lm's sampling distribution of one position (float64 logprobs, -inf outside), and the distance of the
    nearest top-p / min-p comparison from its cut (where float32 rounding could fall on either side)."""
    x = logits.astype(np.float64)
    x = x - (x.max() + np.log(np.sum(np.exp(x - x.max()))))  # generate.py: logits - logsumexp(logits)
    vocab, margin = x.size, np.inf
    if 0 < top_p < 1:  # apply_top_p: ascending argsort (ties by index), cumsum, keep cumulative > 1 - top_p
        ascending = np.lexsort((np.arange(vocab), x))
        cumulative = np.empty(vocab)
        cumulative[ascending] = np.cumsum(np.exp(x[ascending]))
        margin = min(margin, np.min(np.abs(cumulative - (1 - top_p))))
        x = np.where(cumulative > 1 - top_p, x, -np.inf)
    if min_p != 0:  # apply_min_p: remove logprobs < max + log(min_p)
        cut = x.max() + np.log(min_p)
        margin = min(margin, np.min(np.abs(x[np.isfinite(x)] - cut)))
        x = np.where(x < cut, -np.inf, x)
    if top_k > 0:  # apply_top_k: argpartition(-x, kth=k-1) ordered by (-x, index); positions k: are masked
        if not top_k < vocab:
            raise ValueError(f"`top_k` has to be an integer in the (0, {vocab}] interval, but is {top_k}.")
        x[np.lexsort((np.arange(vocab), -x))[top_k:]] = -np.inf
    scaled = x * (1 / temperature)  # categorical_sampling(logits, temp): logits * (1 / temp)
    return scaled - (scaled.max() + np.log(np.sum(np.exp(scaled - scaled.max())))), margin


def sampler(temperature, top_k, top_p, min_p, order) -> SamplerParams:
    rows = len(order)
    full = lambda value, dtype: jnp.broadcast_to(jnp.asarray(value, dtype), (rows,))
    return SamplerParams(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                         full(min_p, jnp.float32), jnp.asarray(order, jnp.int32))


@jax.jit
def replay(logits, params, targets):
    """Kept set ``[B, C, V]``, and the replayed logprob of ``targets`` ``[B, C]`` and log kept mass ``[B, C]``."""
    scaled = logits / params.temperature[:, None, None]
    kept = replayed_kept(logits, scaled, jax.nn.logsumexp(scaled, axis=-1), params)
    stats = replayed_token_stats(logits, targets, params)
    return kept, stats["logprobs"], stats["log_kept_mass"]


def check_against_mlx_reference(logits: np.ndarray, temperature, top_k, top_p, min_p, seed=0) -> int:
    """The replay of ``logits`` ``[B, C, V]`` (float32) in mlx-lm's order equals the reference: the kept set at
    every position, the logprob of a token drawn from the reference and the kept mass. Positions with a cut within
    float32 rounding of a comparison (either side is right) are left out; returns how many were compared."""
    rng = np.random.default_rng(seed)
    want = [mlx_sampling_logprobs(logits[p], temperature, top_k, top_p, min_p) for p in np.ndindex(*logits.shape[:2])]
    targets = np.array([rng.choice(logits.shape[-1], p=np.exp(w)) for w, _ in want]).reshape(logits.shape[:2])
    kept, logprobs, log_mass = replay(jnp.asarray(logits), sampler(temperature, top_k, top_p, min_p,
                                                                   [LAST] * len(logits)), jnp.asarray(targets))
    compared = 0
    for position, (processed, margin) in zip(np.ndindex(*logits.shape[:2]), want):
        if margin < 1e-5:
            continue
        keep = processed > -np.inf
        np.testing.assert_array_equal(np.asarray(kept[position]), keep, err_msg=str(position))
        # float32 logits / temperature: absolute error ~1e-7 x |logits| / temperature.
        tolerance = 2e-6 * (1 + np.abs(logits[position]).max() / temperature)
        np.testing.assert_allclose(logprobs[position], processed[targets[position]], rtol=1e-6, atol=tolerance)
        scaled = logits[position].astype(np.float64) / temperature
        mass = np.sum(np.exp(scaled[keep] - scaled.max())) / np.sum(np.exp(scaled - scaled.max()))
        np.testing.assert_allclose(log_mass[position], np.log(mass), rtol=1e-5, atol=tolerance)
        compared += 1
    return compared


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([6, 64, 300, 2100]),
       levels=st.sampled_from([0, 3, 7]), scale=st.floats(0.3, 8.0),
       temperature=st.sampled_from([0.05, 0.3, 0.7, 1.0, 1.6, 20.0]), top_k=st.sampled_from([0, 1, 2, 5, 40]),
       top_p=st.sampled_from([1.0, 0.05, 0.5, 0.9, 0.999]), min_p=st.sampled_from([0.0, 0.01, 0.2, 0.9]))
def test_replay_equals_mlx_lm_transform(seed, vocab, levels, scale, temperature, top_k, top_p, min_p):
    """Random logits, with ties at every cut when ``levels`` > 0 (broken by token id as mlx-lm breaks them),
    extreme temperatures, every path of the threshold search (all sorted, bitonic candidates, ``lax.top_k``
    candidates, full-sort fallback)."""
    assume(top_k < vocab)  # mlx-lm raises otherwise (check_capabilities refuses it)
    rng = np.random.default_rng(seed)
    shape = (2, 3, vocab)
    logits = rng.integers(0, levels, shape) * scale / levels if levels else rng.standard_normal(shape) * scale
    check_against_mlx_reference(logits.astype(np.float32), temperature, top_k, top_p, min_p, seed)


@pytest.mark.parametrize("top_k, top_p, min_p", list(itertools.product([0, 3], [1.0, 0.6], [0.0, 0.1])))
@pytest.mark.parametrize("temperature", [1.0, 0.4])
def test_every_combination_of_steps_equals_mlx_lm(temperature, top_k, top_p, min_p):
    """Each of the 16 on/off combinations, on logits with a tied group at every cut."""
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal((2, 4, 24)) * 2) / 2  # steps of 0.5: many ties
    assert check_against_mlx_reference(logits.astype(np.float32), temperature, top_k, top_p, min_p) == 8


def test_ties_are_broken_by_token_id_like_mlx_lm():
    """Five equal tokens: top-p 0.5 keeps the three highest ids (ascending cumulative sum), top-k 2 then keeps the
    lowest two of those (argpartition of the negated logprobs)."""
    logits, target = jnp.zeros((1, 1, 5)), jnp.full((1, 1), 3)
    kept, _, _ = replay(logits, sampler(1.0, 0, 0.5, 0.0, [LAST]), target)
    assert kept[0, 0].tolist() == [False, False, True, True, True]
    kept, logprob, log_mass = replay(logits, sampler(0.5, 2, 0.5, 0.0, [LAST]), target)
    assert kept[0, 0].tolist() == [False, False, True, True, False]
    np.testing.assert_allclose([logprob[0, 0], log_mass[0, 0]], np.log([0.5, 0.4]), rtol=1e-6)
    kept, _, _ = replay(logits, sampler(1.0, 2, 0.5, 0.0, [FIRST]), target)  # Tether's order keeps ties together
    assert kept[0, 0].all()


def test_orders_differ_where_the_steps_do_not_commute():
    """Temperature before top-p changes the cut: 0.7 of [0.5, 0.3, 0.15, 0.05] keeps 2 tokens at temperature 1
    (mlx-lm cuts there), 3 at temperature 2 (Tether cuts the flattened distribution)."""
    logits = jnp.log(jnp.array([[[0.5, 0.3, 0.15, 0.05]]] * 2))
    kept, _, _ = replay(logits, sampler(2.0, 0, 0.7, 0.0, [LAST, FIRST]), jnp.zeros((2, 1), jnp.int32))
    assert kept[:, 0].sum(-1).tolist() == [2, 3]


@pytest.mark.parametrize("vocab", [40, 1500])
def test_one_program_serves_both_orders_and_leaves_temperature_first_unchanged(vocab):
    """Rows of both orders in one call equal each order alone; temperature-first rows equal, bit for bit, the
    replay without order codes (the program every run compiled before)."""
    rng = np.random.default_rng(vocab)
    logits = jnp.asarray(rng.standard_normal((4, 3, vocab)) * 3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (4, 3)), jnp.int32)
    values = dict(temperature=[0.7, 0.7, 1.3, 1.3], top_k=[5, 5, 0, 0], top_p=[0.9, 0.9, 0.8, 0.8],
                  min_p=[0.05, 0.05, 0.0, 0.0])
    mixed = sampler(**{k: np.asarray(v) for k, v in values.items()}, order=[FIRST, LAST, FIRST, LAST])
    stats, unordered, last = jax.jit(lambda *params: [replayed_token_stats(logits, targets, p, True) for p in params])(
        mixed, mixed._replace(order=None), mixed._replace(order=jnp.full(4, LAST, jnp.int32)))
    for name in ("logprobs", "log_kept_mass", "entropy"):
        np.testing.assert_array_equal(stats[name][::2], unordered[name][::2], err_msg=name)
        np.testing.assert_array_equal(stats[name][1::2], last[name][1::2], err_msg=name)
    assert not np.allclose(stats["logprobs"][1], unordered["logprobs"][1])  # the orders differ on this problem


def test_replay_gradient_flows_through_the_kept_temperature_scaled_logits():
    """d logprob / d logits of a temperature-last row: (onehot(target) - processed probs) / T on the kept set."""
    logits = jnp.asarray(np.random.default_rng(5).standard_normal((1, 1, 12)) * 2, jnp.float32)
    params = sampler(0.6, 4, 0.8, 0.02, [LAST])
    target = jnp.argmax(logits, axis=-1)
    grad = jax.jit(jax.grad(lambda x: replayed_token_stats(x, target, params)["logprobs"].sum()))(logits)[0, 0]
    want, _ = mlx_sampling_logprobs(np.asarray(logits[0, 0]), 0.6, 4, 0.8, 0.02)
    expected = (np.eye(12)[int(target[0, 0])] - np.exp(want)) / 0.6
    np.testing.assert_allclose(grad, np.where(want > -np.inf, expected, 0.0), atol=1e-6)


# --- mlx-lm's own sampler functions, where mlx imports. ---

def mlx_lm_logprobs(logits: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The distribution mlx-lm's ``make_sampler`` draws from: its chain of ``apply_*`` functions on the
    logprobs, then ``categorical_sampling``'s ``logits * (1 / temp)``, normalised."""
    mx = importlib.import_module("mlx.core")
    sample_utils = importlib.import_module("mlx_lm.sample_utils")
    sample = sample_utils.make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    chain = dict(zip(sample.__code__.co_freevars, (cell.cell_contents for cell in sample.__closure__)))
    x = mx.array(logits[None])
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    for step in chain["sampling_methods"]:
        x = step(x)
    x = x * (1 / chain["temp"])
    return np.asarray(x - mx.logsumexp(x, axis=-1, keepdims=True))[0]


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.9, 0.0), (0, 1.0, 0.1), (7, 1.0, 0.0), (7, 0.9, 0.05),
                                                 (2, 0.5, 0.0)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("levels", [0, 4])
def test_replay_equals_mlx_lm_own_sampler(levels, temperature, top_k, top_p, min_p):
    """mlx-lm's functions on mx arrays (CPU) against the replay, to 1e-6, with and without ties."""
    rng = np.random.default_rng(levels + 7)
    shape = (2, 3, 50)
    logits = (rng.integers(0, levels, shape) * 1.5 if levels else rng.standard_normal(shape) * 2).astype(np.float32)
    want = np.stack([mlx_lm_logprobs(logits[p], temperature, top_k, top_p, min_p) for p in np.ndindex(*shape[:2])])
    targets = np.argmax(want + rng.gumbel(size=want.shape), axis=-1).reshape(shape[:2])  # drawn from mlx-lm's
    kept, logprobs, _ = replay(jnp.asarray(logits), sampler(temperature, top_k, top_p, min_p, [LAST, LAST]),
                               jnp.asarray(targets))
    want = want.reshape(shape)
    np.testing.assert_array_equal(np.asarray(kept), want > -np.inf)
    np.testing.assert_allclose(logprobs, np.take_along_axis(want, targets[..., None], -1)[..., 0], atol=1e-6)


def test_mlx_lm_refuses_top_k_at_the_vocabulary():
    """Hence the MLX backend sends a top-k at or above the vocabulary as 0 (off), which the replay keeps all for."""
    importlib.import_module("mlx.core")
    with pytest.raises(ValueError, match="top_k"):
        mlx_lm_logprobs(np.zeros(8, np.float32), 1.0, 8, 1.0, 0.0)
    with pytest.raises(ValueError, match="top_k"):
        mlx_sampling_logprobs(np.zeros(8, np.float32), 1.0, 8, 1.0, 0.0)


# --- RAW logprobs rebuilt as the sampling distribution's. ---

def test_raw_logprobs_are_rebuilt_as_the_sampling_distributions():
    """An engine whose RAW logprobs differ from the learner's by ``delta``: the rebuilt logprob is the reference
    processed logprob plus ``delta / T`` (exact at ``delta = 0``); masked tokens keep their values."""
    rng = np.random.default_rng(11)
    B, T, D, V = 2, 6, 8, 30
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
    logits = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64), np.asarray(kernel, np.float64))
    params = sampler(0.7, 6, 0.85, 0.01, [LAST, LAST])
    want = np.zeros((B, T))
    tokens = np.zeros((B, T), np.int32)
    for b, t in np.ndindex(B, T - 1):  # tokens[t + 1] is drawn from the distribution at position t
        processed, _ = mlx_sampling_logprobs(logits[b, t], 0.7, 6, 0.85, 0.01)
        tokens[b, t + 1] = rng.choice(V, p=np.exp(processed))
        want[b, t + 1] = processed[tokens[b, t + 1]]
    raw = np.zeros((B, T))
    for b, t in np.ndindex(B, T - 1):
        raw[b, t + 1] = logits[b, t, tokens[b, t + 1]] - np.log(np.sum(np.exp(logits[b, t])))
    delta = rng.normal(0, 1e-3, (B, T)) * (np.arange(T) > 0)
    loss_mask = np.broadcast_to(np.arange(T) >= 2, (B, T)).astype(np.float32)  # column 1 is a "prompt" token
    batch = TrainBatch(tokens=jnp.asarray(tokens), positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
                       attention_mask=jnp.ones((B, T), bool), loss_mask=jnp.asarray(loss_mask),
                       advantages=jnp.zeros((B, T)), rollout_logprobs=jnp.asarray(raw + delta, jnp.float32),
                       policy_version=jnp.zeros((B, T), jnp.int32), sampling=params)
    out = jax.jit(rebuilt_rollout_logprobs, static_argnames="chunk_size")(hidden, kernel, batch, chunk_size=4)
    expected = np.where(loss_mask > 0, want + delta / 0.7, raw + delta)
    np.testing.assert_allclose(out["rollout_logprobs"], expected, atol=2e-5)
    assert (np.asarray(out["log_kept_mass"])[loss_mask > 0] < 0).all()


def test_replay_params_carry_the_engines_order_in_either_mode():
    import types
    batch = types.SimpleNamespace(logprob_mode=LogprobMode.RAW, temperature=np.array([0.7, 0.7]),
                                  top_k=np.array([0, 0]), top_p=np.array([0.9, 0.9]), min_p=np.array([0.0, 0.0]))
    params = replay_params("raw", batch, LAST)
    assert params.order.tolist() == [LAST, LAST] and params.top_p.dtype == jnp.float32
    assert replay_params("raw", batch).order is None  # temperature-first: the program without order codes
    plain = types.SimpleNamespace(**{**vars(batch), "temperature": np.array([1.0, 1.0]), "top_p": np.ones(2)})
    assert replay_params("raw", plain, LAST) is None


# --- Which configurations an engine can honour. ---

MLX_LIKE = EngineCapabilities(frozenset({LogprobMode.RAW}), MLX_ORDER, frozenset(), WeightTransport.RESTART,
                              VersionReporting.NONE, native_n=False, honours_seed=False)
# An order neither replay matches: min-p before top-p, so top-p cuts the mass of the min-p set.
MIN_P_FIRST = EngineCapabilities(frozenset(LogprobMode), ("temperature", "min_p", "top_k", "top_p"),
                                 frozenset(PauseMode), WeightTransport.FROM_DISK, VersionReporting.PER_TOKEN,
                                 native_n=True, honours_seed=True)
STEPS = ("temperature", "top_k", "top_p", "min_p")


@pytest.mark.parametrize("used", [tuple(s for s, on in zip(STEPS, bits) if on)
                                  for bits in itertools.product([False, True], repeat=4)])
def test_mlx_order_is_replayed_for_every_combination_at_staleness_zero(used):
    """RAW at staleness 0 is honoured with any steps; temperature-first is chosen where the orders act alike
    (temperature with top-k, top-k alone, ...), temperature-last where they do not."""
    check_capabilities("mlx", MLX_LIKE, EngineRequirements(LogprobMode.RAW, used))
    tempered_cut = "temperature" in used and ("top_p" in used or "min_p" in used)
    differs = tempered_cut or {"top_k", "top_p"} <= set(used)  # top-p over the top-k set or the vocabulary
    assert MLX_LIKE.replayed_order(used) == (LAST if differs else FIRST)
    assert TetherEngine.capabilities.replayed_order(used) == FIRST


@pytest.mark.parametrize("needs, lines", [
    (EngineRequirements(LogprobMode.PROCESSED, ("top_p",)),
     ["rollout.logprob_mode='processed': it returns only raw logprobs"]),
    (EngineRequirements(LogprobMode.RAW, ("temperature",), max_staleness=2),
     ["rollout.logprob_mode='raw' with rollout.temperature at rollout.max_staleness=2: the learner rebuilds",
      "rollout.max_staleness=2: requests kept running across a weight update need per-token versions"]),
])
def test_mlx_like_engine_refusals_name_the_keys(needs, lines):
    with pytest.raises(EngineCapabilityError) as error:
        check_capabilities("mlx", MLX_LIKE, needs)
    got = str(error.value).splitlines()
    assert got[0] == "engine 'mlx' cannot honour this run:" and len(got) == len(lines) + 1
    for line, start in zip(got[1:], lines):
        assert line.startswith(f"- {start}")


def test_raw_staleness_is_refused_only_with_a_transform():
    """Per-token versions allow staleness; RAW logprobs still need the weights that sampled to rebuild."""
    check_capabilities("tether", TetherEngine.capabilities, EngineRequirements(LogprobMode.RAW, (), max_staleness=3))
    check_capabilities("tether", TetherEngine.capabilities,
                       EngineRequirements(LogprobMode.PROCESSED, ("top_p",), max_staleness=3))
    with pytest.raises(EngineCapabilityError, match=r"rollout.logprob_mode='raw' with rollout.top_p at "
                                                    r"rollout.max_staleness=3: .*set rollout.max_staleness=0"):
        check_capabilities("tether", TetherEngine.capabilities,
                           EngineRequirements(LogprobMode.RAW, ("top_p",), max_staleness=3))


def test_an_order_the_learner_cannot_replay_is_refused_with_the_fix():
    with pytest.raises(EngineCapabilityError) as error:
        check_capabilities("other", MIN_P_FIRST, EngineRequirements(LogprobMode.PROCESSED, ("top_p", "min_p")))
    assert str(error.value).splitlines()[1] == (
        "- rollout.top_p with rollout.min_p: it applies them in the order min_p, top_p, and the learner replays "
        "(temperature, top_k, top_p, min_p) or (top_p, min_p, top_k, temperature) (set rollout.min_p=0 or "
        "rollout.top_p=1)")
    for alone in (("top_p",), ("min_p", "top_k"), ("temperature", "top_k", "top_p")):
        check_capabilities("other", MIN_P_FIRST, EngineRequirements(LogprobMode.PROCESSED, alone))
    missing = EngineCapabilities(*[getattr(MIN_P_FIRST, f) for f in ("logprob_modes",)], ("temperature", "top_k"),
                                 *[getattr(MIN_P_FIRST, f) for f in ("pause_modes", "weight_transport",
                                                                     "version_reporting", "native_n", "honours_seed")])
    with pytest.raises(EngineCapabilityError, match=r"rollout.min_p: it does not apply min_p .*set rollout.min_p=0"):
        check_capabilities("other", missing, EngineRequirements(LogprobMode.PROCESSED, ("temperature", "min_p")))
