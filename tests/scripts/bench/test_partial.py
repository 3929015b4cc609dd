"""scripts/bench/partial.py: its summary of one run's metrics records against the same numbers computed by hand, and
its exact policy reward of a checkpoint against a float64 NumPy reference."""

import math

import numpy as np
import optax
import pytest
from flax import nnx

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.model.transformer import Transformer, model_config
from learner.rl.config import load_config, to_dict
from learner.tasks import load_task
from learner.update.train_state import create_train_state
from scripts.bench import partial as bench_partial
from scripts.bench.partial import CONFIG, EVAL_SEED, LAST, policy_reward, summary


def records(steps: int, partial: bool) -> list[dict]:
    """``steps`` metrics records as a run writes them: 64 samples a step, step times 0.5 s + 0.01 s x step."""
    out = []
    for step in range(1, steps + 1):
        record = {"rollout/samples": 64.0, "perf/step_s": 0.5 + 0.01 * step, "reward/mean": step / 100,
                  "rollout_corr/staleness_mean": 2.0 - 1.0 / step, "buffer/stale_dropped": float(step // 10),
                  "perf/update_s": 0.4, "perf/publish_s": 0.02 * (step % 2), "perf/rollout_wait_s": 0.1}
        if partial:
            record |= {"rollout/partial_fraction": (step % 4 == 0) / 8,
                       "rollout/versions_per_sample_max": 1.0 + (step % 5 == 0)}
        out.append(record)
    return out


def test_the_summary_equals_a_hand_computation():
    steps = 30
    result = summary(records(steps, partial=True))
    seconds = sum(0.5 + 0.01 * s for s in range(1, steps + 1))
    assert result["samples_per_s"] == pytest.approx(64 * steps / seconds, rel=1e-12)
    rates = sorted(64 / (0.5 + 0.01 * s) for s in range(1, steps + 1))
    assert result["median_samples_per_s"] == pytest.approx((rates[14] + rates[15]) / 2, rel=1e-12)
    assert result["reward_first"] == pytest.approx(sum(range(1, LAST + 1)) / 100 / LAST, rel=1e-12)
    assert result["reward_last"] == pytest.approx(sum(range(steps - LAST + 1, steps + 1)) / 100 / LAST, rel=1e-12)
    assert result["partial_fraction"] == pytest.approx(7 / 8 / steps, rel=1e-12)  # 7 steps of 30 at 1/8
    assert result["versions_max"] == 2.0
    assert result["stale_dropped"] == 3.0  # the counter's last value, not a sum
    assert result["update_s"] == pytest.approx(0.4, rel=1e-12)
    assert result["publish_s"] == pytest.approx(0.02 * 15 / steps, rel=1e-12)
    assert result["rollout_wait_s"] == pytest.approx(0.1, rel=1e-12)
    assert result["all_finite"] is True


def test_a_run_without_partial_metrics_reads_as_one_version_and_a_nan_is_flagged():
    result = summary(records(25, partial=False))
    assert result["partial_fraction"] == 0.0 and result["versions_max"] == 1.0
    broken = records(25, partial=False)
    broken[7]["perf/update_s"] = math.nan
    assert summary(broken)["all_finite"] is False


def saved_run(tmp_path, overrides=()):
    """A run directory of configs/partial_rollouts.toml whose one checkpoint holds a tiny model of seed 4."""
    run_dir = tmp_path / "partial=true-0"
    config = to_dict(load_config(str(CONFIG), [f"run_dir={run_dir}", *overrides]))
    model = Transformer(model_config("tiny"), rngs=nnx.Rngs(4))
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), keep_last=None, async_save=False)) as saver:
        saver.save(60, create_train_state(model, optax.adam(1e-3)), policy_version=60, config=config)
    return run_dir, model, config


def answer_probability(model, prompt, answer, temperature):
    """float64: the product over the answer's tokens of softmax(logits / temperature), from the full logits."""
    tokens = np.concatenate([prompt, answer])[None].astype(np.int32)
    logits = np.asarray(model.logits(model(tokens, np.arange(tokens.shape[1])[None])), np.float64)[0] / temperature
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return np.exp(sum(logp[prompt.size - 1 + t, token] for t, token in enumerate(answer)))


@pytest.mark.parametrize("overrides", [(), ("rollout.temperature=0.5", "rollout.max_new_tokens=3")])
def test_the_policy_reward_is_the_mean_probability_of_the_answers(tmp_path, monkeypatch, overrides):
    monkeypatch.setattr(bench_partial, "EVAL_PROMPTS", 48)
    run_dir, model, config = saved_run(tmp_path, overrides)
    task = load_task(config["task"]["name"], config["task"]["args"])
    temperature = config["rollout"]["temperature"]
    rng = np.random.default_rng(EVAL_SEED)
    want = []
    for _ in range(48):
        prompt = task.make_prompt(rng)[0]
        answer = task.demonstration(prompt)
        # a completion cut at rollout.max_new_tokens has no eos: reward 0
        fits = answer.size <= (config["rollout"]["max_new_tokens"] or task.max_completion_tokens)
        want.append(answer_probability(model, prompt, answer, temperature) if fits else 0.0)
    assert 0 < np.count_nonzero(want) < 48 if overrides else np.count_nonzero(want) == 48
    # float32 logits on the device: each answer's logprob within ~1e-5 of the float64 one
    assert policy_reward(run_dir) == pytest.approx(np.mean(want), rel=1e-4)


def test_the_policy_reward_refuses_a_truncating_sampler(tmp_path):
    run_dir, _, _ = saved_run(tmp_path, ["rollout.top_k=5"])
    with pytest.raises(SystemExit, match="needs a sampler without top-k, top-p or min-p"):
        policy_reward(run_dir)
