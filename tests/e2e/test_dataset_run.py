"""`learner.rl.Run` trains the `dataset` task from the run config alone (no glue code): a jsonl file, the character
tokenizer, a built-in reward and warm-up demonstrations from the answer column, against the real embedded server."""

import json

import numpy as np
import pytest

from learner.rl import Run, load_config
from learner.tasks import DatasetTask


@pytest.mark.slow  # ~90 s on the shared 2-core machine: a server process, warm-up, two updates
def test_run_trains_on_a_jsonl_file_from_the_config_alone(tmp_path):
    rows = [{"question": f"{a}+{b}", "answer": str(a + b), "level": a} for a in range(10) for b in range(10)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = {"path": str(tmp_path / "sums.jsonl"), "prompt_column": "question", "answer_column": "answer",
            "demonstration_column": "answer", "tokenizer": "char", "rewards": ["exact_match"],
            "max_completion_tokens": 3, "validation": {"fraction": 0.1}}
    config = load_config("configs/default.toml", [
        "task.name='dataset'", f"task.args={_toml(args)}", "loop.steps=2", "warmup.steps=2", "warmup.batch_size=16",
        "rollout.prompts_per_step=4", "rollout.num_samples=4", "server.max_batch_size=16",
        "update.fast_compile=true", f"run_dir={json.dumps(str(tmp_path / 'run'))}"])
    with Run(config, hooks=[]) as run:
        assert isinstance(run.task, DatasetTask) and len(run.task.prompts()) == 90
        records = list(run.steps())
    held_out = {r["index"] for r in run.task.validation_records()}
    assert [r.step for r in records] == [1, 2]
    for record in records:
        assert record.samples == 16 and set(np.unique(record.rewards)) <= {0.0, 1.0}
        prompts = record.batch.tokens[:record.samples, :5]  # [bos] a + b [sep]
        questions = {run.task.tokenizer.decode(p[1:4]) for p in prompts}
        assert questions <= {row["question"] for i, row in enumerate(rows) if i not in held_out}


def _toml(table: dict) -> str:
    """An inline TOML table (JSON strings and numbers are TOML's)."""
    items = (f"{key} = {_toml(value) if isinstance(value, dict) else json.dumps(value)}"
             for key, value in table.items())
    return "{" + ", ".join(items) + "}"
