"""learner/tools/check_rollout_logprobs.py on a run directory written by the real checkpointer and rollout log writer:
two policy versions, a sample drawn by both, rollout logprobs from a float64 NumPy reference, one of them wrong."""


import numpy as np
import optax
import pytest
from flax import nnx

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.model.transformer import Transformer, model_config
from learner.reporting.rollout_log import LoggedBatch, RolloutLogWriter
from learner.rl.config import load_config, to_dict
from learner.tools.check_rollout_logprobs import main
from learner.update.train_state import create_train_state

T = 12
PROMPT = 4  # tokens 0-3 are the prompt; 4-11 the completion


def reference_logprobs(model, tokens, temperature=1.0):
    """float64 log softmax of the full logits at ``temperature``, aligned on the scored token (column t:
    log p(tokens[t] | < t))."""
    logits = np.asarray(model.logits(model(tokens, np.broadcast_to(np.arange(T), tokens.shape))), np.float64)
    logits /= temperature
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    out = np.zeros(tokens.shape)
    out[:, 1:] = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return out


def output_rows(text: str) -> dict[str, list[str]]:
    return {line[:44].strip(): line[44:].split() for line in text.splitlines()[2:]}


def write_run(run_dir, overrides=(), temperature=1.0):
    """Batch 1: row 0 drawn by version 7; row 1 by 7 up to column 8, by 8 after (a publish mid-sample), one of its
    version-8 logprobs off by 0.5; row 2 by version 9, which has no checkpoint. Rollout logprobs at ``temperature``."""
    config = to_dict(load_config(None, [f"run_dir={run_dir}", *overrides]))
    models = {7: Transformer(model_config("tiny"), rngs=nnx.Rngs(1)), 8: Transformer(model_config("tiny"),
                                                                                      rngs=nnx.Rngs(2))}
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), keep_last=None, async_save=False)) as saver:
        for step, (version, model) in enumerate(models.items(), start=1):
            saver.save(step, create_train_state(model, optax.adam(1e-3)), policy_version=version, config=config)
    tokens = np.random.default_rng(0).integers(3, 100, (3, T)).astype(np.int32)
    versions = np.array([[7] * T, [7] * 8 + [8] * 4, [9] * T], np.int32)
    rollout = np.where(versions == 7, reference_logprobs(models[7], tokens, temperature),
                       reference_logprobs(models[8], tokens, temperature)).astype(np.float32)
    rollout[1, 10] += 0.5
    loss_mask = (np.arange(T) >= PROMPT)[None].repeat(3, 0).astype(np.float32)
    with RolloutLogWriter(run_dir / "rollout_log", max_length=16) as writer:
        writer.append(LoggedBatch(step=1, tokens=tokens, loss_mask=loss_mask, rollout_logprobs=rollout,
                                  proximal_logprobs=np.zeros_like(rollout), rewards=np.zeros(3, np.float32),
                                  advantages=np.zeros_like(rollout), policy_version=versions, learner_version=9))
    return run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("run"))


def test_each_group_is_checked_against_its_versions_checkpoint(run_dir, capsys):
    main([str(run_dir)])
    rows = output_rows(capsys.readouterr().out)
    checked = {group: int(rows[group][0]) for group in rows}
    assert checked == {"one version": 8, "several versions, before a publish": 4,
                       "several versions, after a publish": 4, "no checkpoint of their version": 8}
    # float32 logits against the float64 reference: ~1e-6; the corrupted token: 0.5
    assert float(rows["one version"][1]) < 1e-4
    assert float(rows["several versions, before a publish"][1]) < 1e-4
    assert float(rows["several versions, after a publish"][1]) == pytest.approx(0.5, abs=1e-4)
    assert float(rows["several versions, after a publish"][2]) == pytest.approx(0.5 / 4, abs=1e-4)  # the mean


def test_max_diff_fails_on_the_corrupted_group_unless_the_run_kept_its_cache(run_dir, tmp_path, capsys):
    main([str(run_dir), "--max-diff", "0.6"])
    with pytest.raises(SystemExit, match="above --max-diff 0.01: several versions, after a publish"):
        main([str(run_dir), "--max-diff", "0.01"])
    kept = write_run(tmp_path / "kept", ["rollout.partial=true", "rollout.max_staleness=1",
                                         "rollout.partial_kv='keep'"])
    main([str(kept), "--max-diff", "0.01"])  # "keep": the tokens after a publish are approximate, not bounded


@pytest.mark.parametrize("logprob_mode, agrees", [("processed", True), ("raw", False)])
def test_raw_logprobs_are_checked_at_temperature_one(tmp_path, capsys, logprob_mode, agrees):
    """Logprobs drawn at temperature 0.7: PROCESSED ones are those of softmax(logits / 0.7); RAW ones (as an MLX
    engine reports them) of softmax(logits), so under RAW the check reads the 0.7 ones as off."""
    run = write_run(tmp_path / "run", ["rollout.temperature=0.7", f"rollout.logprob_mode='{logprob_mode}'"],
                    temperature=0.7)
    main([str(run)])
    worst = float(output_rows(capsys.readouterr().out)["one version"][1])
    assert (worst < 1e-4) == agrees


def test_refuses_a_truncating_sampler_and_a_run_without_a_log(tmp_path):
    run = write_run(tmp_path / "run", ["rollout.top_k=5"])
    with pytest.raises(SystemExit, match="needs a sampler without top-k, top-p or min-p"):
        main([str(run)])
    with pytest.raises(SystemExit, match="no rollout_log directory"):
        main([str(tmp_path)])
