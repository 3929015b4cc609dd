"""The run config: one schema, every error naming the key the user wrote (in process, no JAX work)."""

import pytest

from learner.rl import RunConfig, load_config, to_dict
from learner.rl.config import (
    changed_keys,
    checkpoint_config,
    client_config,
    correction_config,
    engine_addresses,
    from_dict,
    optimizer_config,
    optimizer_updates,
    publish_policy,
    sampling_params,
    update_config,
)


@pytest.mark.parametrize("override, message", [
    # Holes of the old schema: each used to pass the config and fail later (or crash inside optax).
    ("optimizer.warmup_steps=60", "optimizer.warmup_steps=60: must be fewer than the run's 60 optimizer updates"),
    ("rollout.temperature=nan", "rollout.temperature=nan: must be a finite number > 0"),
    ("rollout.temperature=inf", "rollout.temperature=inf: must be a finite number > 0"),
    ("rollout.min_p=1.0", "rollout.min_p=1.0: must be in [0, 1)"),
    ("rollout.top_p=0.0", "rollout.top_p=0.0: must be in (0, 1]"),
    ("rollout.top_k=-1", "rollout.top_k=-1: must be >= 0"),
    # Library configs' own checks, reported under the user's key (not OptimizerConfig.peak_learning_rate).
    ("optimizer.learning_rate=-1.0", "optimizer.learning_rate=-1.0 must be a finite number >= 0."),
    ("optimizer.end_learning_rate=1.0", "optimizer.end_learning_rate=1.0 exceeds peak_learning_rate"),
    ("update.num_minibatches=0", "update.num_minibatches=0 must be an int >= 1."),
    ("update.scored_window=0", "update.scored_window=0 must be an int >= 1 or None"),
    ("update.scored_window='half'", "update.scored_window='half': must be an int >= 1, \"auto\" or \"off\""),
    ("update.scored_window=1.5", "update.scored_window=1.5: expected"),
    ("checkpoints.keep_last=0", "checkpoints.keep_last must be >= 1 or None, got 0"),
    ("server.generate_deadline_s=0", "server.generate_deadline_s=0.0: must be a finite number > 0"),
    # Section fields, by their declared bounds.
    ("loop.steps=0", "loop.steps=0: must be > 0"),
    ("rollout.num_samples=1", "rollout.num_samples=1: must be >= 2"),
    ("warmup.noise=1.5", "warmup.noise=1.5: must be >= 0 and <= 1"),
    ("server.engine='trtllm'", "server.engine='trtllm': must be one of tether, mlx, sglang, vllm"),
    ("rollout.logprob_mode='sampled'", "rollout.logprob_mode='sampled': must be one of raw, processed"),
    ("checkpoints.every=0", "checkpoints.every=0: must be > 0"),
    # Types, unknown keys, corrections.
    ("loop.steps=1.5", "loop.steps=1.5: expected int"),
    ("loop.checkpoint_every=2", "loop.checkpoint_every: unknown field;"),
    ("corrections.preset='nope'", "corrections.preset='nope': not one of corrections.PRESETS"),
    ("corrections.preset='decoupled_geo_rs_tokn_tis'", "corrections.preset='decoupled_geo_rs_tokn_tis': not one of "
     "corrections.PRESETS; did you mean 'decoupled_geo_rs_token_tis'"),
    ("corrections.overrides={clip=3}", "corrections.overrides:"),
])
def test_each_error_names_the_key_the_user_wrote(override, message):
    with pytest.raises(ValueError) as error:
        load_config(None, [override])
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.parametrize("override, message", [
    ("loop.stepz=3", "loop.stepz: unknown field; did you mean 'steps'? known: steps, seed,"),
    ("rollout.temprature=0.5", "rollout.temprature: unknown field; did you mean 'temperature'? known:"),
    ("model.lora.rnak=4", "model.lora.rnak: unknown field; did you mean 'rank'? known: rank, alpha,"),
    ("lop.steps=3", "lop: unknown field; did you mean 'loop'? known: run_dir, model,"),
    ("optimizer.zzz=1", "optimizer.zzz: unknown field; known: learning_rate,"),  # nothing close: no guess
])
def test_an_unknown_field_names_the_nearest_known_one(override, message):
    with pytest.raises(ValueError) as error:
        load_config(None, [override])
    assert str(error.value).startswith(message), str(error.value)


def test_warmup_steps_counts_every_optimizer_update_of_the_run():
    # 10 RL steps x 2 mini-batches x 2 epochs = 40 optimizer updates: 39 warmup steps fit, 40 do not.
    base = ["loop.steps=10", "update.num_minibatches=2", "update.ppo_epochs=2"]
    config = load_config(None, [*base, "optimizer.warmup_steps=39"])
    assert optimizer_config(config, optimizer_updates(config, update_config(config, correction_config(config), None))
                            ).total_steps == 40
    with pytest.raises(ValueError, match=r"optimizer.warmup_steps=40: must be fewer than the run's 40"):
        load_config(None, [*base, "optimizer.warmup_steps=40"])


def test_library_configs_are_built_from_the_sections():
    config = load_config(None, ["optimizer.learning_rate=3e-4", "optimizer.warmup_steps=5", "loop.steps=20",
                                "update.logprob_chunk_size=256", "rollout.temperature=0.7", "rollout.top_k=5",
                                "checkpoints.keep_last=4", "server.generate_deadline_s=12",
                                "corrections.overrides={kl_coef=0.05}"])
    correction = correction_config(config)
    assert correction.kl_coef == 0.05
    update = update_config(config, correction, length=128)
    assert (update.logprob_chunk_size, update.corrections) == (128, correction)  # the chunk is capped at the length
    optimizer = optimizer_config(config, 20)
    # No end_learning_rate: constant after the warmup.
    assert (optimizer.peak_learning_rate, optimizer.end_learning_rate, optimizer.warmup_steps,
            optimizer.total_steps) == (3e-4, 3e-4, 5, 20)
    assert checkpoint_config(config, "/ckpt").keep_last == 4
    sampling = sampling_params(config, max_new_tokens=9, stop_token_ids=(2, 7))
    assert (sampling.temperature, sampling.top_k, sampling.max_new_tokens, sampling.stop_token_ids) == (
        0.7, 5, 9, (2, 7))
    assert client_config(config, "127.0.0.1:5", auth_token="t").deadline_base_s == 12.0


def test_config_round_trips_through_plain_data():
    config = load_config("configs/default.toml", ["task.args={num_prompts=64}", "loop.steps=7"])
    assert from_dict(to_dict(config)) == config


def test_changed_keys_lists_what_a_resume_must_not_change():
    saved = to_dict(load_config("configs/default.toml"))
    same_run = load_config("configs/default.toml", ["loop.steps=500", "optimizer.learning_rate=5e-4"])
    assert changed_keys(saved, same_run) == []  # a longer run, another learning rate: a resume may change these
    other = load_config("configs/default.toml", ["task.args={num_prompts=10}", "rollout.num_samples=8",
                                                 "corrections.preset=decoupled_geo_rs_token_tis", "model.name=small"])
    assert changed_keys(saved, other) == ["corrections.preset", "model.name", "rollout.num_samples",
                                          "task.args.num_prompts"]  # each leaf of a table: every changed key
    both = load_config("configs/default.toml", ["task.args={num_prompts=10, digits=2}"])
    assert changed_keys(saved, both) == ["task.args.digits", "task.args.num_prompts"]


def test_defaults_are_a_valid_config():
    assert RunConfig().rollout.num_samples == 8


@pytest.mark.parametrize("override, message", [
    ('server.address=[]', 'server.address=[]: give at least one "host:port"'),
    ('server.address=["10.0.0.1"]', "server.address: '10.0.0.1' is not \"host:port\""),
    ('server.address=["a:1", 5]', "server.address: 5 is not \"host:port\""),
    ('server.address=["a:1", "a:1"]', "server.address=['a:1', 'a:1']: an address is listed twice"),
    ("server.max_relaunches=-1", "server.max_relaunches=-1: must be >= 0"),
])
def test_engine_address_errors_name_the_key(override, message):
    with pytest.raises(ValueError) as error:
        load_config(None, [override])
    assert message in str(error.value)


def test_engine_addresses_accept_one_address_a_list_or_a_unix_socket():
    assert engine_addresses(load_config(None, ['server.address="h:1"'])) == ["h:1"]
    assert engine_addresses(load_config(None, ['server.address=["h:1", "unix:engine.sock"]'])) == [
        "h:1", "unix:engine.sock"]
    assert engine_addresses(load_config(None, [])) == []


@pytest.mark.parametrize("window, length, max_new_tokens, expected", [
    ("auto", 64, 20, 24),  # the completion budget, rounded up to a multiple of 8
    ("auto", 64, 24, 24),
    ("auto", 16, 20, 16),  # never longer than the batch
    ("auto", None, 20, 24),
    ("auto", 64, None, None),  # no completion budget given: every token
    ("off", 64, 20, None),
    (40, 64, 20, 40),  # as written
])
def test_scored_window_is_the_completion_budget_unless_set(window, length, max_new_tokens, expected):
    config = load_config(None, [f"update.scored_window={window!r}".replace("'", '"')])
    update = update_config(config, correction_config(config), length=length, max_new_tokens=max_new_tokens)
    assert update.scored_window == expected
    assert RunConfig().update.scored_window == "auto"


@pytest.mark.parametrize("overrides, expected", [
    # (in_flight, max_staleness, prefetch, drain, partial, pause_mode, kv_cache); prompts_per_step = 4
    ([], (4, 1, True, False, False, "WAIT", "RECOMPUTE")),  # asynchronous, one version per sample
    (["rollout.max_staleness=0"], (4, 0, False, False, False, "KEEP", "RECOMPUTE")),  # synchronous: nothing in flight
    (["rollout.max_staleness=3"], (12, 3, True, False, False, "WAIT", "RECOMPUTE")),
    (["rollout.fixed_staleness=true"], (4, 1, True, True, False, "WAIT", "RECOMPUTE")),
    (["loop.deterministic=true", "rollout.max_staleness=2"], (8, 2, True, True, False, "WAIT", "RECOMPUTE")),
    (["rollout.partial=true"], (4, 1, True, False, True, "KEEP", "RECOMPUTE")),
    (["rollout.partial=true", "rollout.partial_kv='keep'"], (4, 1, True, False, True, "KEEP", "KEEP")),
])
def test_publish_policy_is_computed_once_from_the_rollout_and_loop_sections(overrides, expected):
    policy = publish_policy(load_config(None, ["rollout.prompts_per_step=4", *overrides]))
    assert (policy.in_flight, policy.max_staleness, policy.prefetch, policy.drain, policy.partial,
            policy.pause_mode.name, policy.kv_cache.name) == expected
    assert policy.recomputes_kv == (policy.partial and policy.kv_cache.name == "RECOMPUTE")


@pytest.mark.parametrize("overrides, message", [
    (["rollout.partial=true", "rollout.max_staleness=0"], "rollout.partial=true with rollout.max_staleness=0"),
    (["rollout.partial=true", "rollout.fixed_staleness=true"], "rollout.partial=true with rollout.fixed_staleness"),
    (["rollout.partial=true", "loop.deterministic=true"], "rollout.partial=true with loop.deterministic=true"),
])
def test_a_publish_policy_that_contradicts_itself_is_refused_at_load_time(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)
