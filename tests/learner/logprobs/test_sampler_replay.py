"""Sampler replay: the learner's PROCESSED logprobs equal the server's, in `token_logprobs` and inside the update
step; RAW logprobs rebuilt equal the server's PROCESSED ones; the sampled token stays in the support."""

import signal
import sys
import types

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings

from corrections import CorrectionConfig, ImportanceWeights, mismatch_metrics
from learner.logprobs.chunked import logprobs_from_hidden, token_logprobs
from learner.logprobs.sampler_replay import SamplerParams, replayed_thresholds, replayed_token_stats
from learner.logprobs.sampling_transform import processed_logprobs
from learner.logprobs.truncation_bias import log_kept_mass, truncation_bias_metrics
from learner.model.param_paths import parameter_names
from learner.model.sharding import make_mesh
from learner.model.transformer import Transformer, model_config
from learner.update.batch import TrainBatch
from learner.update.logprob_mode import check_logprob_mode, rebuild_batch_logprobs, replay_params
from learner.update.step import UpdateConfig, make_update_fn
from learner.update.train_state import create_sharded_train_state
from rollout_client import ClientConfig, LogprobMode, RolloutClient, RolloutRequest, SamplingParams, collate
from tests.rollout_client.conftest import ServerProcess
from tests.support.sort_reference import full_sort_cut
from tests.support.update_problem import FAST_COMPILE

B, T, D, V = 3, 9, 16, 40
TRUNCATED = dict(top_k=5, top_p=0.9, min_p=0.05)


def sampler(temperature, top_k, top_p, min_p) -> SamplerParams:
    return SamplerParams(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                         jnp.asarray(top_p, jnp.float32), jnp.asarray(min_p, jnp.float32))


@jax.jit  # eagerly, every op of the truncation compiles on its own
def reference_stats(logits, targets, sampling):
    """Unchunked: the server's `processed_logprobs` at every position, gathered at the targets."""
    per_row = jax.vmap(jax.vmap(processed_logprobs, (0, None, None, None, None)))
    logp = per_row(logits, *sampling[:4])
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * logp, 0.0), axis=-1)
    return target_logp, entropy


# `logprobs_from_hidden` jitted, as the update step runs it (eagerly, every op of each chunk compiles on its own).
logprobs_from_hidden_jitted = jax.jit(logprobs_from_hidden, static_argnames=("chunk_size", "return_entropy",
                                                                             "temperature"))


@pytest.fixture(scope="module")
def head():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    sampling = sampler([0.7, 1.0, 1.3], [5, 0, 12], [0.9, 0.8, 1.0], [0.05, 0.0, 0.1])
    return hidden, kernel, tokens, sampling


def test_chunked_replay_equals_unchunked_server_transform(head):
    hidden, kernel, tokens, sampling = head
    logits = jnp.einsum("btd,dv->btv", hidden, kernel)[:, :-1]
    want_lp, want_ent = reference_stats(logits, tokens[:, 1:], sampling)
    kept = want_lp > -jnp.inf  # Random targets: only those the server could have sampled are comparable.
    lp, ent = logprobs_from_hidden_jitted(hidden, kernel, tokens, chunk_size=4, sampling=sampling,
                                          return_entropy=True)
    np.testing.assert_allclose(np.where(kept, lp[:, 1:], 0), np.where(kept, want_lp, 0), atol=1e-5)
    np.testing.assert_allclose(np.where(kept, ent[:, 1:], 0), np.where(kept, want_ent, 0), atol=1e-5)
    assert 0 < kept.mean() < 1 and np.isfinite(np.asarray(lp)).all()


def test_replay_gradient_equals_unchunked_gradient(head):
    hidden, kernel, tokens, sampling = head
    logits_fn = lambda h, k: jnp.einsum("btd,dv->btv", h, k)[:, :-1]
    targets = jnp.argmax(logits_fn(hidden, kernel), axis=-1)  # Always kept, so the reference is finite.
    tokens = tokens.at[:, 1:].set(targets)

    def chunked(h, k):
        return jnp.sum(logprobs_from_hidden(h, k, tokens, chunk_size=4, sampling=sampling)[:, 1:] ** 2)

    def plain(h, k):
        return jnp.sum(reference_stats(logits_fn(h, k), targets, sampling)[0] ** 2)

    for got, want in zip(jax.jit(jax.grad(chunked, (0, 1)))(hidden, kernel), jax.jit(jax.grad(plain, (0, 1)))(hidden,
                                                                                                              kernel)):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_temperature_only_replay_equals_plain_logprobs(head):
    hidden, kernel, tokens, _ = head
    replayed = logprobs_from_hidden_jitted(hidden, kernel, tokens,
                                           sampling=sampler([0.6] * B, [0] * B, [1.0] * B, [0.0] * B))
    np.testing.assert_allclose(replayed, logprobs_from_hidden_jitted(hidden, kernel, tokens, temperature=0.6),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="leave temperature at 1.0"):
        logprobs_from_hidden(hidden, kernel, tokens, temperature=0.6, sampling=head[3])


@pytest.mark.parametrize("top_k, top_p, min_p", [(20, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.02), (50, 0.95, 0.01),
                                                 (0, 0.999, 0.0), (3000, 1.0, 0.0)])
def test_candidate_thresholds_equal_full_sort(top_k, top_p, min_p):
    """Vocabulary beyond the candidate blocks; the last two settings need the full-sort fallback."""
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 3000)) * 2, jnp.float32)
    params = sampler([1.0, 1.0], [top_k] * 2, [top_p] * 2, [min_p] * 2)
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    got = jax.jit(replayed_thresholds)(logits, log_normalizer, params)
    cut = full_sort_cut(logits, log_normalizer, *(x[:, None] for x in params[1:4]))
    np.testing.assert_array_equal(got, cut.threshold)
    assert bool(cut.determined.all())


server_transform = jax.jit(jax.vmap(jax.vmap(processed_logprobs, (0, None, None, None, None))))


@jax.jit
def replayed_logprobs_of_every_token(logits, params):
    """[V, B, C]: the replayed logprob of each vocabulary token at each position (one target at a time)."""
    targets = jnp.broadcast_to(jnp.arange(logits.shape[-1])[:, None, None], (logits.shape[-1], *logits.shape[:2]))
    return jax.vmap(lambda t: replayed_token_stats(logits, t, params)["logprobs"])(targets)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), levels=st.integers(2, 6), vocab=st.sampled_from([7, 64, 2100]),
       temperature=st.floats(0.3, 2.0), top_k=st.integers(0, 10), top_p=st.floats(0.05, 1.0),
       min_p=st.floats(0.0, 0.9), jitter=st.booleans())
def test_sampled_token_never_gets_minus_inf(seed, levels, vocab, temperature, top_k, top_p, min_p, jitter):
    """Few distinct logit values (ties at every cutoff); server logits optionally bf16-rounded (jitter)."""
    rng = np.random.default_rng(seed)
    learner_logits = jnp.asarray(rng.integers(0, levels, (1, 4, vocab)) * 0.37 + rng.normal(0, 1e-3, (1, 4, 1)),
                                 jnp.float32)
    server_logits = learner_logits.astype(jnp.bfloat16).astype(jnp.float32) if jitter else learner_logits
    params = sampler([temperature], [top_k], [top_p], [min_p])
    server = server_transform(server_logits, *params[:4])
    np.testing.assert_allclose(jnp.exp(server).sum(-1), 1.0, atol=1e-5)
    sampled = jax.random.categorical(jax.random.key(seed), server)  # [1, 4], drawn like the server draws.
    every_token = replayed_logprobs_of_every_token(learner_logits, params)  # Includes tokens it could not draw.
    assert np.isfinite(np.asarray(every_token)).all() and (every_token <= 1e-6).all()
    if not jitter:
        replayed = jnp.take_along_axis(every_token, sampled[None], axis=0)[0]
        np.testing.assert_allclose(replayed, jnp.take_along_axis(server, sampled[..., None], -1)[..., 0], atol=1e-5)


def test_ties_at_a_cutoff_are_kept_together():
    logits = jnp.log(jnp.array([0.4, 0.2, 0.2, 0.2]))
    processed = jax.jit(processed_logprobs)  # one program for the three settings
    assert jnp.isfinite(processed(logits, 1.0, 2, 1.0, 0.0)).tolist() == [True] * 4
    assert jnp.isfinite(processed(logits, 1.0, 0, 0.5, 0.0)).tolist() == [True] * 4
    assert jnp.isfinite(processed(logits, 1.0, 0, 0.3, 0.0)).tolist() == [True, False, False, False]


def test_logprob_modes_must_agree():
    assert check_logprob_mode("raw", LogprobMode.RAW) == LogprobMode.RAW
    with pytest.raises(ValueError, match="learner computes PROCESSED .* server returns RAW"):
        check_logprob_mode(LogprobMode.PROCESSED, "RAW")
    with pytest.raises(ValueError, match="'sampled' is not RAW or PROCESSED"):
        check_logprob_mode("sampled", "RAW")
    batch = types.SimpleNamespace(logprob_mode=LogprobMode.PROCESSED, temperature=np.array([0.7]),
                                  top_k=np.array([5]), top_p=np.array([0.9]), min_p=np.array([0.05]))
    params = replay_params("PROCESSED", batch)
    assert params.top_k.tolist() == [5] and params.top_p.dtype == jnp.float32
    with pytest.raises(ValueError, match="learner computes RAW"):
        replay_params("RAW", batch)
    plain = types.SimpleNamespace(logprob_mode=LogprobMode.PROCESSED, temperature=np.array([1.0, 1.0]),
                                  top_k=np.array([0, 0]), top_p=np.array([1.0, 1.0]), min_p=np.array([0.0, 0.0]))
    assert replay_params("PROCESSED", plain) is None
    assert replay_params("PROCESSED", types.SimpleNamespace(**{**vars(plain), "top_p": np.array([1.0, 0.9])})) \
        is not None


# --- Against the real reference server (float32), over gRPC. ---

PROMPTS = ([3, 17, 42, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11])


MODEL_SEED = 7


@pytest.fixture(scope="module")
def model():
    return Transformer(model_config("tiny"), rngs=nnx.Rngs(MODEL_SEED))


@pytest.fixture(scope="module")
def server_client(tmp_path_factory, model):
    server = ServerProcess([sys.executable, "-m", "learner.serving", "--dtype", "float32",
                            "--max-batch-size", "4", "--max-seq-len", "64"], tmp_path_factory.mktemp("replay"))
    client = RolloutClient(ClientConfig(target=server.target, ready_timeout_s=60))
    state = nnx.state(model)
    names, _ = parameter_names(state)
    client.publish_weights(1, weights={n: np.asarray(leaf) for n, leaf in zip(names, jax.tree.leaves(state))})
    yield client
    client.close()
    server.stop(signal.SIGKILL)


def rollouts(client, mode, temperatures):
    samples = [s for prompt, temperature in zip(PROMPTS, temperatures)
               for s in client.generate(RolloutRequest(prompt, SamplingParams(
                   temperature=temperature, max_new_tokens=20, stop_token_ids=(), seed=11, **TRUNCATED),
                   num_samples=2, logprob_mode=mode))]
    return collate(samples, pad_to_multiple=8)


def learner_pass(model, batch, sampling):
    tokens = jnp.asarray(batch.tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return token_logprobs(model, tokens, positions, jnp.ones(tokens.shape, bool), chunk_size=8, sampling=sampling)


@pytest.mark.slow  # 19 s on a quiet 2-core run: out of the default run's 15 minutes
def test_processed_logprobs_equal_server_and_unreplayed_ones_do_not(server_client, model):
    batch = rollouts(server_client, LogprobMode.PROCESSED, temperatures=(0.8, 1.0))
    mask = batch.loss_mask
    replayed = learner_pass(model, batch, replay_params("PROCESSED", batch))
    assert batch.top_k.tolist() == [5] * 4
    np.testing.assert_allclose(batch.temperature, [0.8, 0.8, 1.0, 1.0])
    np.testing.assert_allclose(np.where(mask, replayed, 0), batch.rollout_logprobs, atol=1e-5)
    metrics = mismatch_metrics(replayed, batch.rollout_logprobs, mask)
    assert abs(float(metrics["rollout_corr/kl"])) < 1e-6 and abs(float(metrics["rollout_corr/chi2_token"])) < 1e-5

    temperature_only = batch.__class__(**{**batch.__dict__, "top_k": np.zeros(4, np.int32),
                                          "top_p": np.ones(4, np.float32), "min_p": np.zeros(4, np.float32)})
    unreplayed = learner_pass(model, batch, SamplerParams.from_batch(temperature_only))
    metrics = mismatch_metrics(unreplayed, batch.rollout_logprobs, mask)
    # Without truncation replay the trainer's ratio is the kept mass (< 1) on every token.
    assert float(metrics["rollout_corr/kl"]) > 0.5 and float(metrics["rollout_corr/chi2_token"]) < -0.5
    hidden = model(jnp.asarray(batch.tokens), jnp.broadcast_to(jnp.arange(batch.tokens.shape[1]), batch.tokens.shape),
                   jnp.ones(batch.tokens.shape, bool))
    log_mass = log_kept_mass(hidden, model.output_kernel(), jnp.asarray(batch.tokens), jnp.ones(mask.shape, bool),
                             sampling=SamplerParams.from_batch(batch), chunk_size=8)
    np.testing.assert_allclose(np.where(mask, unreplayed - replayed, 0), np.where(mask, log_mass, 0), atol=1e-5)


def train_batch(collated, sampling) -> TrainBatch:
    shape = collated.tokens.shape
    lengths = collated.prompt_lengths + collated.completion_lengths
    return TrainBatch(tokens=collated.tokens, positions=np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape),
                      attention_mask=np.arange(shape[1]) < lengths[:, None], loss_mask=collated.loss_mask,
                      advantages=collated.loss_mask * np.array([[1.0], [-1.0], [0.5], [-0.5]], np.float32),
                      rollout_logprobs=collated.rollout_logprobs, policy_version=collated.policy_versions,
                      sampling=sampling)


def test_raw_logprobs_are_rebuilt_as_the_servers_processed_ones(server_client, model):
    """The same seeded requests in both modes draw the same tokens; the RAW logprobs rebuilt with the weights that
    sampled equal the server's PROCESSED ones, and at temperature 1 differ from them by the log kept mass."""
    raw = rollouts(server_client, LogprobMode.RAW, temperatures=(0.8, 1.0))
    processed = rollouts(server_client, LogprobMode.PROCESSED, temperatures=(0.8, 1.0))
    np.testing.assert_array_equal(raw.tokens, processed.tokens)
    mask = raw.loss_mask
    batch = jax.tree.map(jnp.asarray, train_batch(raw, replay_params("RAW", raw)))
    rebuilt = jax.jit(rebuild_batch_logprobs, static_argnums=0, static_argnames="chunk_size")(
        *nnx.split(model), batch, chunk_size=8)
    np.testing.assert_allclose(rebuilt["rollout_logprobs"], processed.rollout_logprobs, atol=1e-5)
    temperature_1 = mask * (raw.temperature[:, None] == 1.0)
    np.testing.assert_allclose(np.where(temperature_1, raw.rollout_logprobs - processed.rollout_logprobs, 0),
                               np.where(temperature_1, rebuilt["log_kept_mass"], 0), atol=1e-5)
    metrics = truncation_bias_metrics(rebuilt["log_kept_mass"], mask)
    assert float(metrics["sampler/log_kept_mass_mean"]) < -0.5
    assert float(metrics["sampler/log_kept_mass_min"]) <= float(metrics["sampler/log_kept_mass_mean"])


@pytest.mark.slow  # 25 s on a quiet 2-core run: out of the default run's 15 minutes
def test_update_step_replays_the_servers_processed_logprobs(server_client):
    """Inside the update (proximal recompute, decoupled mode), the train/rollout mismatch is ~0 with the replay."""
    collated = rollouts(server_client, LogprobMode.PROCESSED, temperatures=(0.8, 1.0))
    batch = train_batch(collated, replay_params("PROCESSED", collated))
    mesh = make_mesh(2, 1, 1, devices=jax.devices()[:2])
    optimizer = optax.sgd(0.0)
    graphdef, _, shardings = create_sharded_train_state(model_config("tiny"), optimizer, mesh, seed=MODEL_SEED)
    config = UpdateConfig(corrections=CorrectionConfig(importance=ImportanceWeights("token", high=2.0)),
                          logprob_chunk_size=8, rows_per_chunk=0)
    update = make_update_fn(graphdef, optimizer, config, mesh, shardings, FAST_COMPILE)

    def mismatch(batch):  # the server's weights are the train state's (same seed); the update donates its state
        state = create_sharded_train_state(model_config("tiny"), optimizer, mesh, seed=MODEL_SEED)[1]
        metrics = update(state, batch, None)[1]
        return float(metrics["rollout_corr/kl"][0]), float(metrics["rollout_corr/chi2_token"][0])

    kl, chi2 = mismatch(batch)
    assert abs(kl) < 1e-5 and abs(chi2) < 1e-5
    temperature_only = batch.sampling._replace(top_k=np.zeros(4, np.int32), top_p=np.ones(4, np.float32),
                                               min_p=np.zeros(4, np.float32))
    kl, chi2 = mismatch(batch.replace(sampling=temperature_only))  # the same program: sampling params are data
    assert kl > 0.5 and chi2 < -0.5
