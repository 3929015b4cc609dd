"""The calculator's warm-up (`learner.tasks.Calculator.noisy_demonstration`): ``tool_demonstrations`` of its
demonstrations call the tool, the others answer directly, so the warmed-up policy seldom calls it and RL has to
raise that (configs/tool_calculator.toml; the whole run: tests/e2e/test_tool_calculator_run.py)."""

import math

import numpy as np
import pytest

from learner.rl import load_config
from learner.tasks import load_task
from learner.tasks._calculator import CALL_TAG, calculate


def demonstrations(share, count, noise=0.0, seed=0):
    task = load_task("tool_calculator", {"num_prompts": 64, "tool_demonstrations": share})
    rng = np.random.default_rng(seed)
    records = task.prompts()
    return task, [(record, *task.noisy_demonstration(record["prompt_ids"], rng, noise))
                  for record in (records[i % len(records)] for i in range(count))]


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_the_share_of_demonstrations_that_call_the_calculator_is_tool_demonstrations(share):
    count = 800
    task, demos = demonstrations(share, count)
    tok = task.tokenizer
    calls = 0
    for record, ids, mask in demos:
        question = tok.decode(record["prompt_ids"][1:-1])
        if (mask == 0).any():  # the calculator's result is masked: a tool episode
            calls += 1
            assert tok.decode(ids[:np.argmax(mask == 0)]) == question + CALL_TAG
        else:  # a direct answer: the product (noise 0 here) and the end of the turn, every token the policy's
            assert tok.decode(ids[:-1]) == calculate(question) == record["answer"]
            assert ids[-1] in tok.eos_ids and CALL_TAG not in tok.decode(ids[:-1])
    # Binomial: within 4.5 standard deviations (fails by chance about once in 150,000 seeds; the seed is fixed).
    assert abs(calls / count - share) <= 4.5 * math.sqrt(share * (1 - share) / count)


def test_the_example_config_warms_up_on_few_tool_demonstrations():
    config = load_config("configs/tool_calculator.toml")
    assert config.task.args["tool_demonstrations"] <= 0.3 and config.loop.deterministic


def test_a_share_outside_zero_to_one_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"task.args.tool_demonstrations=1.5: must be a share in \[0, 1\]"):
        load_task("tool_calculator", {"tool_demonstrations": 1.5})
