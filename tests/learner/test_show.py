"""``python -m learner.show``: a logged step's completions as text, with rewards, advantages and versions, decoded
with the run's tokenizer (the default task's character tokenizer here)."""

import json

import numpy as np
import optax
import pytest
from flax import nnx

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.model.transformer import Transformer, model_config
from learner.reporting.rollout_log import LoggedBatch, RolloutLogWriter
from learner.rl.config import load_config, to_dict
from learner.show import main
from learner.tasks import TOKENIZER
from learner.update.train_state import create_train_state


def _row(prompt: str, completion: str, length: int = 12) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([[TOKENIZER.bos_id], TOKENIZER.encode(prompt), [TOKENIZER.sep_id],
                          TOKENIZER.encode(completion), [TOKENIZER.eos_id]])
    tokens, mask = np.zeros(length, np.int32), np.zeros(length, np.float32)
    tokens[:ids.size] = ids
    mask[len(prompt) + 2:ids.size] = 1
    return tokens, mask


@pytest.fixture
def run_dir(tmp_path):
    run_dir = tmp_path / "run"
    config = to_dict(load_config(None, [f"run_dir={json.dumps(str(run_dir))}"]))
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), async_save=False)) as saver:
        model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
        saver.save(2, create_train_state(model, optax.adam(1e-3)), policy_version=4, config=config)
    log = RolloutLogWriter(run_dir / "rollout_log", max_length=12)
    for step in (1, 2):
        rows = [_row("3+5", "8"), _row("3+5", "9"), _row("7+7", "14")]
        tokens, mask = (np.stack(parts) for parts in zip(*rows))
        versions = np.full(tokens.shape, step + 1, np.int32)
        versions[2] = step  # the third sample is one version older
        log.append(LoggedBatch(step=step, tokens=tokens, loss_mask=mask, rollout_logprobs=-mask,
                               proximal_logprobs=-mask, rewards=np.array([1.0, 0.0, 1.0], np.float32),
                               advantages=mask * np.array([[0.5], [-0.5], [0.0]], np.float32),
                               policy_version=versions, learner_version=step + 1))
    log.close()
    return run_dir


def test_a_step_is_printed_as_text_per_prompt(run_dir, capsys):
    main([str(run_dir), "--step", "1"])
    assert capsys.readouterr().out.splitlines() == [
        "step 1: 3 samples, reward mean 0.667, trained by learner version 2",
        'prompt: "3+5"',
        '  reward 1.000  advantage +0.500  sampled by v2 (learner v2)  "8"',
        '  reward 0.000  advantage -0.500  sampled by v2 (learner v2)  "9"',
        'prompt: "7+7"',
        '  reward 1.000  advantage +0.000  sampled by v1 (learner v2)  "14"']


def test_the_last_step_by_default_samples_capped_and_a_missing_step_is_one_line(run_dir, capsys):
    main([str(run_dir), "--samples", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 2: ") and len(lines) == 5  # header, 2 prompts, 1 sample each
    with pytest.raises(SystemExit, match=r"^error: --step 7: not in the rollout log \(steps 1-2\)$"):
        main([str(run_dir), "--step", "7"])
