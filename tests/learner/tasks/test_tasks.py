"""Tasks: exact-match rewards on hand cases, tokenizer round trip, per-seed determinism, demonstrations score 1;
loading by name or import path, with args, and every loading error."""

import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.model.transformer import model_config
from learner.tasks import (
    EOS_ID,
    PAD_ID,
    TOKENIZER,
    Addition,
    Demonstrations,
    SortDigits,
    Task,
    TextTask,
    Tokenizer,
    load_task,
    register_task,
    task_names,
)
from learner.tasks import _registry as registry

# The dataset task needs a file; the calculator is an environment (its tests: tests/learner/rl/test_episodes.py).
DIGIT_TASKS = [name for name in task_names() if name not in ("dataset", "tool_calculator")]
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
    assert load_task(name).solve(question) == answer


def test_rewards_need_only_the_prompt_ids():
    task = load_task("addition_2digit")
    rows = [{"prompt_ids": PROMPT_12_PLUS_79}] * 3
    completions = [_completion("91", EOS_ID), _completion("19", EOS_ID), _completion("91")]
    np.testing.assert_array_equal(task.rewards(rows, completions), [1.0, 0.0, 0.0])


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


@pytest.mark.parametrize("name", DIGIT_TASKS)
def test_prompts_are_deterministic_per_seed_and_index(name):
    first = load_task(name, {"num_prompts": 20, "seed": 7}).prompts()
    again = load_task(name, {"num_prompts": 20, "seed": 7}).prompts()
    other_seed = load_task(name, {"num_prompts": 20, "seed": 8}).prompts()
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["prompt_ids"], b["prompt_ids"])
        assert a["answer"] == b["answer"]
    assert any(not np.array_equal(a["prompt_ids"], c["prompt_ids"]) for a, c in zip(first, other_seed))
    assert len({a["prompt_ids"].tobytes() for a in first}) > 1


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(DIGIT_TASKS), seed=st.integers(0, 2**32 - 1), index=st.integers(0, 2**20))
def test_demonstrations_always_score_one(name, seed, index):
    task = load_task(name, {"num_prompts": index + 1, "seed": seed})
    prompt = task.prompts()[index]["prompt_ids"]
    assert prompt.dtype == np.int32 and 3 <= len(prompt) <= task.max_prompt_tokens
    padded = np.pad(prompt, (0, task.max_prompt_tokens - len(prompt)), constant_values=PAD_ID)
    demonstration = task.demonstration(prompt)
    assert len(demonstration) <= task.max_completion_tokens and demonstration[-1] == EOS_ID
    np.testing.assert_array_equal(task.demonstration(padded), demonstration)
    assert task.rewards([{"prompt_ids": prompt}, {"prompt_ids": padded}], [demonstration] * 2).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("name", DIGIT_TASKS)
def test_noisy_demonstrations(name):
    task = load_task(name)
    rng = np.random.default_rng(0)
    rows = [task.prompts()[i] for i in range(200)]
    prompts = [row["prompt_ids"] for row in rows]
    for prompt in prompts[:20]:
        np.testing.assert_array_equal(task.noisy_demonstration(prompt, rng, noise=0.0), task.demonstration(prompt))
    noisy = [task.noisy_demonstration(p, rng, noise=0.5) for p in prompts]
    assert all(len(n) == len(task.demonstration(p)) and n[-1] == EOS_ID for n, p in zip(noisy, prompts))
    mean_reward = task.rewards(rows, noisy).mean()
    assert 0.0 < mean_reward < 0.6


def test_a_registered_user_task_in_a_few_lines(monkeypatch):
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))  # keep the global registry as it was

    class Parity(TextTask):
        name, max_question_chars, max_answer_chars = "test_parity", 4, 1

        def make_question(self, rng):
            return "".join(map(str, rng.integers(2, size=4)))

        def solve(self, question):
            return str(question.count("1") % 2)

    register_task("test_parity", Parity)
    task = load_task("test_parity", {"num_prompts": 10})
    assert isinstance(task, Task) and isinstance(task, Demonstrations) and len(task.prompts()) == 10
    prompt, answer = task.make_prompt(np.random.default_rng(0))
    assert task.reward(prompt, _completion(answer, EOS_ID)) == 1.0
    assert task.reward(prompt, _completion(str(1 - int(answer)), EOS_ID)) == 0.0
    with pytest.raises(ValueError, match="already registered"):
        register_task("test_parity", Parity)
    with pytest.raises(ValueError, match="':' marks an import path"):
        register_task("my:parity", Parity)


USER_TASKS = """
    import numpy as np
    from learner.tasks import CharTokenizer

    class Copy:
        name, tokenizer = "copy", CharTokenizer()
        max_prompt_tokens = max_completion_tokens = 4

        def __init__(self, n):
            self.n = n

        def prompts(self):
            return [{"prompt_ids": self.tokenizer.encode(f"{i:03d}"), "answer": f"{i:03d}"} for i in range(self.n)]

        def rewards(self, rows, completions):
            targets = [np.append(self.tokenizer.encode(row["answer"]), self.tokenizer.eos_ids) for row in rows]
            return np.array([np.array_equal(c, t) for c, t in zip(completions, targets)], np.float32)

    COPY_3 = Copy(3)

    class NoRewards(Copy):
        rewards = None  # not callable: as good as missing

    class NoEosIds:
        vocab_size, pad_id = 10, 0
        def encode(self, text): return np.zeros(len(text), np.int32)
        def decode(self, ids): return ""

    class BadTokenizer(Copy):
        tokenizer = NoEosIds()

    def no_prompts():
        class Incomplete:
            name, tokenizer, max_prompt_tokens, max_completion_tokens = "t", CharTokenizer(), 1, 1
            def rewards(self, rows, completions): return np.zeros(len(rows), np.float32)
        return Incomplete()
"""


@pytest.fixture
def user_tasks(tmp_path, monkeypatch):
    """A module ``user_tasks`` on ``sys.path``, written by a user who does not touch learner.tasks."""
    (tmp_path / "user_tasks.py").write_text(textwrap.dedent(USER_TASKS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_tasks", raising=False)


def test_user_task_loads_from_an_import_path_with_args(user_tasks):
    task = load_task("user_tasks:Copy", {"n": 5})
    assert type(task).__name__ == "Copy" and task.n == 5 and isinstance(task, Task)
    assert not isinstance(task, Demonstrations)
    rows = task.prompts()
    assert len(rows) == 5
    np.testing.assert_array_equal(rows[3]["prompt_ids"], TOKENIZER.encode("003"))
    completions = [_completion("000", EOS_ID), _completion("001", EOS_ID), _completion("002"), _completion("1", EOS_ID)]
    np.testing.assert_array_equal(task.rewards(rows[:4], completions), [1.0, 1.0, 0.0, 0.0])


def test_user_task_instance_loads_without_args(user_tasks):
    task = load_task("user_tasks:COPY_3")
    assert task is sys.modules["user_tasks"].COPY_3 and len(task.prompts()) == 3


@pytest.mark.parametrize("name, args, message", [
    ("user_tasks:Nope", None, "task.name='user_tasks:Nope': module 'user_tasks' has no attribute 'Nope'"),
    ("no_such_module:Copy", None, "task.name='no_such_module:Copy': No module named 'no_such_module'"),
    ("foo", None, "task.name='foo': unknown task; registered: addition_1digit, addition_2digit, dataset, "
                  "reverse_digits, sort_digits, tool_calculator (or give an import path "
                  "'package.module:attribute')"),
    ("user_tasks:Copy", {"n": 5, "m": 1}, "task.args: Copy() got an unexpected keyword argument 'm'; valid: n"),
    ("user_tasks:Copy", None, "task.args: Copy() missing a required argument: 'n'"),
    ("sort_digits", {"digits": 3}, "task.args: sort_digits() got an unexpected keyword argument 'digits'; valid: "
                                    "min_length, max_length, num_prompts, seed, length_exponent"),
    ("user_tasks:COPY_3", {"n": 5}, "task.args: 'user_tasks:COPY_3' is a task instance, which takes no args; "
                                    "got ['n']"),
    ("user_tasks:NoRewards", {"n": 5}, "task.name='user_tasks:NoRewards': NoRewards is not a Task: it lacks rewards"),
    ("user_tasks:BadTokenizer", {"n": 5},
     "task.name='user_tasks:BadTokenizer': BadTokenizer is not a Task: it lacks tokenizer.eos_ids"),
    ("user_tasks:no_prompts", None, "task.name='user_tasks:no_prompts': Incomplete is not a Task: it lacks prompts"),
    ("user_tasks:np", None, "task.name='user_tasks:np': module is not a Task: it lacks name, tokenizer, "
                            "max_prompt_tokens, max_completion_tokens, prompts, rewards"),
])
def test_load_task_errors_name_the_config_key(user_tasks, name, args, message):
    with pytest.raises(ValueError) as error:
        load_task(name, args)
    assert str(error.value) == message


def test_registered_digit_tasks_take_args():
    task = load_task("sort_digits", {"num_prompts": 10, "seed": 3})
    assert task == SortDigits(num_prompts=10, seed=3) and len(task.prompts()) == 10
    assert load_task("addition_2digit", {"seed": 5}) == Addition(digits=2, seed=5)
    for i in (0, 9, -1):
        prompt_ids, answer = task.make_prompt(np.random.default_rng((3, range(10)[i])))
        np.testing.assert_array_equal(task.prompts()[i]["prompt_ids"], prompt_ids)
        assert task.prompts()[i]["answer"] == answer
    with pytest.raises(IndexError):
        task.prompts()[10]


def test_default_prompts_are_todays_stream():
    task = load_task("addition_1digit")
    assert task == Addition(digits=1, num_prompts=4096, seed=0)
    rows = task.prompts()
    assert len(rows) == 4096
    assert [TOKENIZER.decode(rows[i]["prompt_ids"][1:-1]) for i in range(4)] == ["8+6", "5+8", "9+0", "5+8"]
    assert [rows[i]["answer"] for i in range(4)] == ["14", "13", "9", "13"]
    for i in range(50):
        prompt_ids, answer = task.make_prompt(np.random.default_rng((0, i)))
        assert rows[i]["prompt_ids"].dtype == np.int32 and rows[i]["answer"] == answer
        np.testing.assert_array_equal(rows[i]["prompt_ids"], prompt_ids)


@pytest.mark.parametrize("name", DIGIT_TASKS)
def test_rewards_are_the_per_row_reward(name):
    task = load_task(name)
    rng = np.random.default_rng(1)
    rows = [task.prompts()[i] for i in range(100)]
    completions = [task.noisy_demonstration(row["prompt_ids"], rng, noise=0.3) for row in rows]
    completions[0] = completions[0][:-1]  # truncated: no eos
    rewards = task.rewards(rows, completions)
    assert rewards.dtype == np.float32 and rewards.shape == (100,) and 0 < rewards.sum() < 100 and rewards[0] == 0
    np.testing.assert_array_equal(rewards, [task.reward(row["prompt_ids"], c) for row, c in zip(rows, completions)])
    with pytest.raises(ValueError, match="2 prompt records but 1 completions"):
        task.rewards(rows[:2], completions[:1])


def test_char_tokenizer_is_a_tokenizer():
    assert isinstance(TOKENIZER, Tokenizer) and TOKENIZER.eos_ids == (EOS_ID,)
