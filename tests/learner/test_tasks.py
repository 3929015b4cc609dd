"""Tasks: exact-match rewards on hand cases, tokenizer round trip, per-seed determinism, demonstrations score 1."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.model import model_config
from learner.tasks import _registry as registry
from learner.tasks import (
    EOS_ID,
    PAD_ID,
    TOKENIZER,
    Addition,
    Task,
    TextTask,
    batch_rewards,
    get_task,
    prompt_example,
    register_task,
    task_names,
)

PROMPT_12_PLUS_79 = np.concatenate([[TOKENIZER.bos_id], TOKENIZER.encode("12+79"), [TOKENIZER.sep_id]])


def _completion(text, *tail):
    return np.concatenate([TOKENIZER.encode(text), np.asarray(tail, np.int32)]).astype(np.int32)


@pytest.mark.parametrize(
    "completion, expected",
    [
        (_completion("91", EOS_ID), 1.0),  # correct
        (_completion("91", EOS_ID, PAD_ID, PAD_ID), 1.0),  # padding after eos is ignored
        (_completion("91", EOS_ID, *TOKENIZER.encode("7")), 1.0),  # so is anything else after eos
        (_completion("92", EOS_ID), 0.0),  # wrong
        (_completion("91"), 0.0),  # truncated: no eos
        (_completion("910", EOS_ID), 0.0),  # extra digit
        (_completion(" 91", EOS_ID), 0.0),  # extra character
        (_completion("9", EOS_ID), 0.0),  # too short
        (_completion("", EOS_ID), 0.0),  # empty answer
        (np.array([PAD_ID, *TOKENIZER.encode("91"), EOS_ID]), 0.0),  # a special id before the answer
    ],
)
def test_addition_reward_hand_cases(completion, expected):
    assert Addition(digits=2).reward(PROMPT_12_PLUS_79, completion) == expected


def test_reward_accepts_right_padded_prompt():
    padded = np.concatenate([PROMPT_12_PLUS_79, [PAD_ID, PAD_ID]])
    assert Addition(digits=2).reward(padded, _completion("91", EOS_ID)) == 1.0


def test_reward_rejects_malformed_prompt():
    with pytest.raises(ValueError, match="not a prompt"):
        Addition(digits=2).reward(TOKENIZER.encode("12+79"), _completion("91", EOS_ID))


@pytest.mark.parametrize("name, question, answer", [
    ("addition_1digit", "9+8", "17"),
    ("addition_2digit", "99+99", "198"),
    ("sort_digits", "90210", "00129"),
    ("reverse_digits", "90210", "01209"),
])
def test_solutions(name, question, answer):
    assert get_task(name).solve(question) == answer


def test_batch_rewards():
    task = get_task("addition_2digit")
    prompts = [PROMPT_12_PLUS_79, PROMPT_12_PLUS_79, PROMPT_12_PLUS_79]
    completions = [_completion("91", EOS_ID), _completion("19", EOS_ID), _completion("91")]
    np.testing.assert_array_equal(batch_rewards(task, prompts, completions), [1.0, 0.0, 0.0])


@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40))
def test_tokenizer_round_trip(text):
    ids = TOKENIZER.encode(text)
    assert ids.dtype == np.int32
    assert TOKENIZER.decode(ids) == text
    assert np.all((ids > TOKENIZER.sep_id) & (ids < TOKENIZER.vocab_size))


def test_tokenizer_fits_tiny_model_and_rejects_non_characters():
    assert TOKENIZER.vocab_size <= model_config("tiny").vocab_size
    assert len({TOKENIZER.pad_id, TOKENIZER.bos_id, TOKENIZER.eos_id, TOKENIZER.sep_id}) == 4
    assert TOKENIZER.pad_id == 0
    with pytest.raises(ValueError):
        TOKENIZER.encode("tab\t")
    with pytest.raises(ValueError):
        TOKENIZER.decode([TOKENIZER.eos_id])


@pytest.mark.parametrize("name", task_names())
def test_prompts_are_deterministic_per_seed_and_index(name):
    task = get_task(name)
    first = [prompt_example(task, seed=7, index=i) for i in range(20)]
    again = [prompt_example(task, seed=7, index=i) for i in range(20)]
    other_seed = [prompt_example(task, seed=8, index=i) for i in range(20)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["prompt_ids"], b["prompt_ids"])
        assert a["prompt_length"] == b["prompt_length"]
    assert any(not np.array_equal(a["prompt_ids"], c["prompt_ids"]) for a, c in zip(first, other_seed))
    assert len({a["prompt_ids"].tobytes() for a in first}) > 1


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(task_names()), seed=st.integers(0, 2**32 - 1), index=st.integers(0, 2**20))
def test_demonstrations_always_score_one(name, seed, index):
    task = get_task(name)
    example = prompt_example(task, seed, index)
    prompt = example["prompt_ids"]
    length = int(example["prompt_length"])
    assert prompt.shape == (task.max_prompt_tokens,) and 3 <= length <= task.max_prompt_tokens
    assert np.all(prompt[length:] == PAD_ID)
    demonstration = task.demonstration(prompt)
    assert len(demonstration) <= task.max_completion_tokens and demonstration[-1] == EOS_ID
    assert task.reward(prompt, demonstration) == 1.0
    assert task.reward(prompt[:length], demonstration) == 1.0


@pytest.mark.parametrize("name", task_names())
def test_noisy_demonstrations(name):
    task = get_task(name)
    rng = np.random.default_rng(0)
    prompts = [prompt_example(task, 0, i)["prompt_ids"] for i in range(200)]
    for prompt in prompts[:20]:
        np.testing.assert_array_equal(task.noisy_demonstration(prompt, rng, noise=0.0), task.demonstration(prompt))
    noisy = [task.noisy_demonstration(p, rng, noise=0.5) for p in prompts]
    assert all(len(n) == len(task.demonstration(p)) and n[-1] == EOS_ID for n, p in zip(noisy, prompts))
    mean_reward = batch_rewards(task, prompts, noisy).mean()
    assert 0.0 < mean_reward < 0.6


def test_a_user_task_in_a_few_lines(monkeypatch):
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))  # keep the global registry as it was

    class Parity(TextTask):
        name, max_question_chars, max_answer_chars = "test_parity", 4, 1

        def make_question(self, rng):
            return "".join(map(str, rng.integers(2, size=4)))

        def solve(self, question):
            return str(question.count("1") % 2)

    register_task(Parity())
    task = get_task("test_parity")
    assert isinstance(task, Task)
    prompt, answer = task.make_prompt(np.random.default_rng(0))
    assert task.reward(prompt, _completion(answer, EOS_ID)) == 1.0
    assert task.reward(prompt, _completion(str(1 - int(answer)), EOS_ID)) == 0.0
    with pytest.raises(ValueError, match="already registered"):
        register_task(Parity())
