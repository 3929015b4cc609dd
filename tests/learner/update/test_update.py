"""The one-call update: the same loss and gradients on every mesh and micro-batch count, the mini-batch scan equal
to the same updates one by one, exactly zero gradients from padding, PPO improving a bandit objective, shuffling,
skipped non-finite updates, and the server's sampling transform replayed in every logprob pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import corrections
from corrections import CorrectionConfig, ImportanceWeights, grpo_advantages
from learner.logprobs.chunked import token_logprobs
from learner.logprobs.sampler_replay import NEUTRAL, SamplerParams
from learner.model.sharding import make_mesh
from learner.model.transformer import model_config
from learner.update.batch import TrainBatch
from learner.update.bucketing import BucketConfig, pad_batch
from learner.update.optimizer import OptimizerConfig, make_optimizer
from learner.update.step import (
    UpdateConfig,
    make_update_fn,
    minibatch_gradients,
    minibatch_update,
    proximal_from_training_pass,
    recompute_logprobs,
    update_step,
)
from learner.update.train_state import create_sharded_train_state
from tests.support import update_problem
from tests.support.update_problem import EMPTY_ROW_TOKEN, FAST_COMPILE, MODEL, OPTIMIZER, PAD_TOKEN, ROWS, run_update


def _grads_and_loss(result):
    before, after, metrics = result
    return jax.tree.map(lambda b, a: b - a, before, after), metrics["actor/pg_loss"]


@pytest.fixture(scope="module")
def reference():
    """The update on one device with one micro-batch."""
    return run_update(make_mesh(1, 1, 1, devices=jax.devices()[:1]), num_microbatches=1)


@pytest.mark.parametrize("mesh_shape, num_microbatches", [((8, 1, 1), 2), ((2, 4, 1), 1), ((2, 2, 2), 4)])
def test_same_loss_gradients_and_metrics_on_every_mesh_and_microbatch_count(reference, mesh_shape,
                                                                             num_microbatches):
    want_grads, want_loss = _grads_and_loss(reference)
    result = run_update(make_mesh(*mesh_shape), num_microbatches)
    grads, loss = _grads_and_loss(result)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert abs(float(want_loss[0])) > 1e-3
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        want = functools.reduce(lambda tree, key: tree[key.key], path, want_grads)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    want_metrics, metrics = reference[2], result[2]
    assert metrics.keys() == want_metrics.keys()
    for name in want_metrics:  # maxima, moments and fractions of the whole batch, not micro-batch averages
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _assert_same_update(got, want):
    for path, value in jax.tree_util.tree_leaves_with_path(got[1]):
        expected = functools.reduce(lambda tree, key: tree[key.key], path, want[1])
        np.testing.assert_allclose(value, expected, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    for name in want[2]:
        np.testing.assert_allclose(got[2][name], want[2][name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_batch_normalized_weights_do_not_depend_on_the_microbatch_count():
    """Decoupled weights are divided by the whole batch's mean weight in every micro-batch (verl's divisor)."""
    config = CorrectionConfig(importance=ImportanceWeights("token", high=2.0, batch_normalize=True))
    whole = run_update(make_mesh(1, 1, 1, devices=jax.devices()[:1]), num_microbatches=1, corrections=config)
    split = run_update(make_mesh(2, 2, 2), num_microbatches=4, corrections=config)
    _assert_same_update(split, whole)
    metrics = whole[2]  # rollout_is_mean is verl's: the bounded weights before normalisation, whose mean is the divisor
    assert abs(float(metrics["rollout_corr/rollout_is_mean"][0]) / float(
        metrics["rollout_corr/rollout_is_batch_norm_factor"][0]) - 1.0) < 1e-5
    assert abs(float(whole[2]["actor/pg_loss"][0])) > 1e-3


def test_bfloat16_gradients_accumulate_in_float32():
    """The micro-batch accumulators (the scan's carry) are float32; the gradient handed on has the params' dtype."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, state, _ = create_sharded_train_state(model_config("tiny", param_dtype="bfloat16"), OPTIMIZER, mesh)
    config = UpdateConfig(corrections=update_problem.CORRECTIONS.replace(kl_coef=0.0), num_microbatches=4,
                          logprob_chunk_size=8, rows_per_chunk=0)
    batch = jax.tree.map(jnp.asarray, update_problem.rollout_batch())
    proximal = jnp.zeros(batch.tokens.shape, jnp.float32)
    fn = functools.partial(minibatch_gradients, graphdef=graphdef, config=config)
    jaxpr = jax.make_jaxpr(fn)(state.params, (batch, proximal, None), jnp.int32(0), jax.random.key(0))
    scan = next(eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan")
    carry = scan.params["jaxpr"].in_avals[scan.params["num_consts"]:][:scan.params["num_carry"]]
    assert len(carry) == len(jax.tree.leaves(state.params)) + 2  # gradient sums, numerator, denominator
    assert {aval.dtype for aval in carry} == {jnp.dtype(jnp.float32)}
    grads = jax.eval_shape(fn, state.params, (batch, proximal, None), jnp.int32(0), jax.random.key(0))[0]
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}


def test_masked_positions_get_exactly_zero_gradient(reference):
    grads, _ = _grads_and_loss(reference)
    embedding_grads = grads["embed"]["embedding"]
    assert np.all(embedding_grads[PAD_TOKEN] == 0.0)
    assert np.all(embedding_grads[EMPTY_ROW_TOKEN] == 0.0)
    batch = update_problem.rollout_batch()
    followed = np.unique(batch.tokens[:, :-1][batch.attention_mask[:, 1:]])  # tokens with a scored successor
    assert np.all(np.abs(embedding_grads[followed]).sum(axis=1) > 0)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(grads))  # NaN rollout logprobs in padding


def test_minibatch_scan_equals_the_same_updates_one_by_one():
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=1e-2, warmup_steps=1, total_steps=4))
    config = update_problem.update_config(num_microbatches=1)
    config = UpdateConfig(corrections=config.corrections.replace(kl_coef=0.0), num_minibatches=2, ppo_epochs=2,
                          shuffle=False, logprob_chunk_size=8, rows_per_chunk=0)
    graphdef, state, _ = create_sharded_train_state(MODEL, optimizer, mesh)
    batch = jax.tree.map(jnp.asarray, update_problem.rollout_batch())
    step = functools.partial(update_step, graphdef=graphdef, optimizer=optimizer, config=config)
    scanned, metrics, proximal_returned = jax.jit(step, compiler_options=FAST_COMPILE)(state, batch)

    proximal = jax.jit(recompute_logprobs, static_argnums=(0, 3), compiler_options=FAST_COMPILE)(
        graphdef, state.params, batch, config)
    np.testing.assert_allclose(proximal_returned, proximal, rtol=1e-6, atol=1e-6)  # the update returns what it used
    one_update = jax.jit(functools.partial(minibatch_update, graphdef=graphdef, optimizer=optimizer, config=config),
                         compiler_options=FAST_COMPILE)
    losses = []
    for _ in range(config.ppo_epochs):
        for k in range(config.num_minibatches):
            rows = jax.tree.map(lambda x: x[k::config.num_minibatches], (batch, proximal, None))  # noqa: B023
            state, one_metrics, _ = one_update(state, rows, jax.random.key(0))
            losses.append(one_metrics["actor/pg_loss"])

    np.testing.assert_allclose(metrics["actor/pg_loss"], losses, rtol=1e-5, atol=1e-6)
    assert int(scanned.step) == int(state.step) == 4
    assert int(scanned.policy_version) == 1
    for got, want in zip(jax.tree.leaves(scanned.params), jax.tree.leaves(state.params), strict=True):
        # Adam divides by sqrt(v): float32 rounding of tiny gradients shows up at 1e-3 of a step (lr 1e-2).
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_microbatches", [1, 4])
@pytest.mark.slow  # 23 s on a quiet 2-core run: out of the default run's 15 minutes
def test_on_policy_update_takes_the_proximal_logprobs_from_its_training_pass(monkeypatch, num_microbatches):
    """One epoch of one mini-batch (shuffled, 1 or 4 micro-batches): no separate proximal pass is traced, and the
    update equals the same update given the separately recomputed proximal logprobs (two compiled programs compute
    the same logprobs: equal to float32 rounding), returning those logprobs in the batch's row order."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=1e-2, total_steps=4))
    config = UpdateConfig(corrections=update_problem.CORRECTIONS.replace(kl_coef=0.0),
                          num_microbatches=num_microbatches, logprob_chunk_size=8, rows_per_chunk=0)
    assert proximal_from_training_pass(config)
    graphdef, state, _ = create_sharded_train_state(MODEL, optimizer, mesh)
    batch = jax.tree.map(jnp.asarray, update_problem.rollout_batch())
    proximal = jax.jit(recompute_logprobs, static_argnums=(0, 3), compiler_options=FAST_COMPILE)(
        graphdef, state.params, batch, config)
    explicit = jax.jit(functools.partial(minibatch_update, graphdef=graphdef, optimizer=optimizer, config=config),
                       compiler_options=FAST_COMPILE)
    # update_step's shuffle: one epoch, one mini-batch, the rows in order[...]
    epoch_key = jax.random.split(jax.random.split(jax.random.wrap_key_data(state.rng))[1], 1)[0]
    shuffle_key, minibatch_key = jax.random.split(epoch_key)
    order = jax.random.permutation(shuffle_key, ROWS)
    rows = jax.tree.map(lambda x: x[order], (batch, proximal, None))
    want_state, want_metrics, none = explicit(state, rows, jax.random.split(minibatch_key, 1)[0])
    assert none is None  # given proximal logprobs are not handed back

    recomputes = []
    monkeypatch.setattr("learner.update.step.recompute_logprobs", lambda *args: recomputes.append(args))
    step = functools.partial(update_step, graphdef=graphdef, optimizer=optimizer, config=config)
    got_state, got_metrics, got_proximal = jax.jit(step, compiler_options=FAST_COMPILE)(state, batch)
    assert recomputes == []
    np.testing.assert_allclose(got_proximal, proximal, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got_proximal)[~update_problem.rollout_batch().attention_mask] == 0)
    for name in want_metrics:
        np.testing.assert_allclose(got_metrics[name], want_metrics[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert abs(float(got_metrics["actor/pg_loss"][0])) > 1e-3
    for got, want in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # Adam: see the scan test above


def test_only_on_policy_decoupled_updates_skip_the_proximal_pass():
    decoupled = update_problem.CORRECTIONS
    normalized = CorrectionConfig(importance=ImportanceWeights("token", high=2.0, batch_normalize=True))
    assert proximal_from_training_pass(UpdateConfig(corrections=decoupled, num_microbatches=4))
    assert proximal_from_training_pass(UpdateConfig(corrections=normalized))
    assert not proximal_from_training_pass(UpdateConfig(corrections=normalized, num_microbatches=2))
    assert not proximal_from_training_pass(UpdateConfig(corrections=decoupled, ppo_epochs=2))
    assert not proximal_from_training_pass(UpdateConfig(corrections=decoupled, num_minibatches=2))
    assert not proximal_from_training_pass(UpdateConfig(corrections=corrections.preset("bypass_ppo_clip")))
    assert not proximal_from_training_pass(UpdateConfig(corrections=decoupled, fuse_proximal=False))  # a study's


def test_donation_choices_are_checked_before_anything_is_built():
    with pytest.raises(ValueError, match=r"make_update_fn\(donate='all'\): must be one of \('none', 'state'"):
        make_update_fn(None, None, UpdateConfig(), None, None, donate="all")


BANDIT_ARMS = 12  # one prompt, 12 distinct one-token completions, the first half rewarded.
BANDIT_PROMPT = np.array([5, 9, 2, 7])


def _bandit_batch(advantages: np.ndarray, rollout_logprob: float) -> TrainBatch:
    """Rows ``prompt + arm``; padded with fully masked rows to 16 (2 mini-batches x 2 micro-batches x 4)."""
    arms = 10 + np.arange(BANDIT_ARMS)
    tokens = np.concatenate([np.tile(BANDIT_PROMPT, (BANDIT_ARMS, 1)), arms[:, None]], axis=1)
    length = tokens.shape[1]
    loss_mask = np.zeros(tokens.shape, np.float32)
    loss_mask[:, -1] = 1.0
    batch = TrainBatch(tokens=tokens.astype(np.int32),
                         positions=np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape),
                         attention_mask=np.ones(tokens.shape, bool), loss_mask=loss_mask,
                         advantages=np.broadcast_to(advantages[:, None], tokens.shape).astype(np.float32),
                         rollout_logprobs=np.full(tokens.shape, rollout_logprob, np.float32),
                         policy_version=np.zeros(tokens.shape, np.int32))
    return pad_batch(batch, BucketConfig(min_length=8), row_multiple=16)


@pytest.fixture(scope="module")
def bandit():
    """A jitted PPO update (Adam, non-finite skipping, 2 x 2 x 2 scans, shuffled) on a (4, 1, 2) mesh."""
    mesh = make_mesh(4, 1, 2)
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=3e-2, total_steps=100, max_consecutive_skips=3))
    corrections = CorrectionConfig(importance=ImportanceWeights("token", high=2.0))
    config = UpdateConfig(corrections=corrections, num_minibatches=2, num_microbatches=2, ppo_epochs=2,
                          logprob_chunk_size=8, rows_per_chunk=0)
    graphdef, _, shardings = create_sharded_train_state(MODEL, optimizer, mesh, seed=3)
    update = make_update_fn(graphdef, optimizer, config, mesh, shardings, FAST_COMPILE)
    logprobs = jax.jit(recompute_logprobs, static_argnums=(0, 3), compiler_options=FAST_COMPILE)
    rewards = (np.arange(BANDIT_ARMS) < BANDIT_ARMS // 2).astype(np.float32)
    advantages = np.asarray(grpo_advantages(rewards, group_size=BANDIT_ARMS))
    batch = _bandit_batch(advantages, rollout_logprob=-np.log(128.0))

    def expected_reward(state):
        arm_logprobs = np.asarray(logprobs(graphdef, state.params, batch, config))[:BANDIT_ARMS, len(BANDIT_PROMPT)]
        return float(np.sum(np.exp(arm_logprobs) * rewards) / np.sum(np.exp(arm_logprobs)))

    def fresh_state():  # the update donates its input state
        return create_sharded_train_state(MODEL, optimizer, mesh, seed=3)[1]

    return update, fresh_state, batch, expected_reward


def test_ppo_improves_a_bandit_objective_and_shuffles_minibatches(bandit):
    update, fresh_state, batch, expected_reward = bandit
    state = fresh_state()
    start = expected_reward(state)
    denominators = []
    for _ in range(5):
        state, metrics, _ = update(state, batch, None)
        denominators.append(np.asarray(metrics["actor/loss_denominator"]).reshape(2, 2))
    assert start == pytest.approx(0.5, abs=0.05)
    assert expected_reward(state) > 0.9
    assert int(state.step) == 20 and int(state.policy_version) == 5
    denominators = np.stack(denominators)  # [call, epoch, mini-batch]: real rows per mini-batch
    np.testing.assert_array_equal(denominators.sum(axis=-1), BANDIT_ARMS)
    assert len({tuple(d) for d in denominators.reshape(-1, 2)}) > 1


def test_nonfinite_loss_skips_the_update_and_is_counted(bandit):
    update, fresh_state, batch, _ = bandit
    advantages = batch.advantages.copy()
    advantages[0, len(BANDIT_PROMPT)] = np.nan
    state, metrics, _ = update(fresh_state(), batch.replace(advantages=advantages), None)
    newly_skipped = np.diff(metrics["actor/skipped_updates"], prepend=0)  # the metric is a running total
    np.testing.assert_array_equal(newly_skipped, np.isnan(metrics["actor/pg_loss"]))
    assert newly_skipped.sum() == 2  # row 0 lands in one mini-batch per epoch
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state.params))
    assert int(state.step) == 4


def test_update_makes_no_host_transfer_and_consumes_the_donated_state(bandit):
    """No host sync inside the call (a transfer to or from the host would raise), and every leaf of the state is
    donated: its buffers are reused by the new state, not copied."""
    update, fresh_state, batch, _ = bandit
    state, device_batch = fresh_state(), jax.device_put(batch)
    with jax.transfer_guard_host_to_device("disallow"), jax.transfer_guard_device_to_host("disallow"):
        new_state, metrics, proximal = update(state, device_batch, None)
        jax.block_until_ready((new_state, metrics, proximal))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    assert int(new_state.step) == 4


@pytest.mark.parametrize("fields, message", [
    (dict(num_minibatches=0), "num_minibatches"),
    (dict(ppo_epochs=1.0), "ppo_epochs"),
    (dict(temperature=0.0), "temperature"),
    (dict(rows_per_chunk=-1), "rows_per_chunk"),
    (dict(logprob_remat="auto"), "logprob_remat"),
    (dict(scored_window=0), "scored_window=0 must be an int >= 1 or None"),
    (dict(scored_window=True), "scored_window=True"),
])
def test_invalid_update_configs_are_rejected(fields, message):
    with pytest.raises(ValueError, match=message):
        UpdateConfig(**fields)


def test_rows_must_split_evenly_into_micro_batches():
    batch = update_problem.rollout_batch()
    with pytest.raises(ValueError, match="not a multiple of num_minibatches"):
        update_step(None, batch, graphdef=None, optimizer=None, config=UpdateConfig(num_microbatches=3))


# Per-row sampling parameters (PROCESSED logprobs): every truncation, alone and together, at several temperatures.
SAMPLING = SamplerParams(temperature=np.linspace(0.6, 1.4, ROWS).astype(np.float32),
                         top_k=np.tile(np.array([5, 0, 0, 20], np.int32), ROWS // 4),
                         top_p=np.tile(np.array([1.0, 0.9, 1.0, 0.8], np.float32), ROWS // 4),
                         min_p=np.tile(np.array([0.0, 0.0, 0.05, 0.02], np.float32), ROWS // 4))
SINGLE_DEVICE = dict(data=1, fsdp=1, tensor=1)


def _sampled_batch() -> TrainBatch:
    return update_problem.rollout_batch().replace(sampling=SAMPLING)


@pytest.fixture(scope="module")
def replayed():
    """The update problem with `SAMPLING`, on one device with one micro-batch."""
    return run_update(make_mesh(**SINGLE_DEVICE, devices=jax.devices()[:1]), batch=_sampled_batch())


def _by_hand(sampling):
    """Loss, metrics and gradient of the update problem from `token_logprobs(..., sampling=sampling)` directly."""
    mesh = make_mesh(**SINGLE_DEVICE, devices=jax.devices()[:1])
    graphdef, state, _ = create_sharded_train_state(MODEL, OPTIMIZER, mesh, seed=0)
    _, reference, _ = create_sharded_train_state(MODEL, OPTIMIZER, mesh, seed=1)
    batch = jax.tree.map(jnp.asarray, update_problem.rollout_batch())
    config = update_problem.update_config(num_microbatches=1)

    def logprobs(params):
        return token_logprobs(nnx.merge(graphdef, params), batch.tokens, batch.positions, batch.attention_mask,
                              chunk_size=config.logprob_chunk_size, sampling=sampling)

    def loss(params):
        current = logprobs(params)
        out = corrections.compute(
            current, batch.advantages, batch.loss_mask, config.corrections,
            proximal_logprobs=jax.lax.stop_gradient(current), rollout_logprobs=batch.rollout_logprobs,
            ref_logprobs=logprobs(reference.params), policy_lag=-batch.policy_version, key=jax.random.key(0),
            rows_per_chunk=config.rows_per_chunk)
        return out.loss, out.metrics

    (_, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state.params)
    return jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(grads))


@pytest.mark.slow  # 21 s on a quiet 2-core run: out of the default run's 15 minutes
def test_update_replays_the_sampling_params_in_every_logprob_pass(replayed):
    """Proximal, reference and current logprobs all replayed: loss, corrections metrics and gradient by hand."""
    grads, loss = _grads_and_loss(replayed)
    metrics = replayed[2]
    want_metrics, want_grads = _by_hand(jax.tree.map(jnp.asarray, SAMPLING))
    np.testing.assert_allclose(loss[0], want_metrics["actor/pg_loss"], rtol=1e-5, atol=1e-6)
    for name in ("rollout_corr/kl", "rollout_corr/chi2_token", "actor/kl_loss", "actor/ppo_kl"):
        np.testing.assert_allclose(metrics[name][0], want_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        want = functools.reduce(lambda tree, key: tree[key.key], path, want_grads)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    unreplayed, _ = _by_hand(None)  # the replay matters in this problem
    assert abs(unreplayed["rollout_corr/kl"] - metrics["rollout_corr/kl"][0]) > 0.1


def test_padded_rows_get_neutral_sampling_params_and_change_nothing(replayed):
    padded = pad_batch(_sampled_batch(), BucketConfig(min_length=update_problem.LENGTH), row_multiple=2 * ROWS)
    assert padded.tokens.shape == (2 * ROWS, update_problem.LENGTH)
    assert padded.sampling.order is None  # temperature-first rows: no order codes
    for got, want, neutral in zip(padded.sampling[:4], SAMPLING[:4], NEUTRAL[:4], strict=True):
        np.testing.assert_array_equal(got, np.concatenate([want, np.full(ROWS, neutral, want.dtype)]))
    want_grads, want_loss = _grads_and_loss(replayed)
    grads, loss = _grads_and_loss(run_update(make_mesh(2, 2, 2), num_microbatches=2, batch=padded))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        want = functools.reduce(lambda tree, key: tree[key.key], path, want_grads)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_sampling_params_and_a_config_temperature_are_exclusive():
    config = UpdateConfig(temperature=0.7)
    with pytest.raises(ValueError, match="leave UpdateConfig.temperature at 1.0"):
        update_step(None, _sampled_batch(), graphdef=None, optimizer=None, config=config)
    with pytest.raises(ValueError, match="leave UpdateConfig.temperature at 1.0"):
        recompute_logprobs(None, None, _sampled_batch(), config)
