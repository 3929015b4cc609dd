"""Rewards: each built-in on hand-written cases; user rewards by file path and by module (sync, async, batched, with
args); weights; a raising reward skipped (counted, named) or stopping the run; a timeout; config errors."""

import asyncio
import textwrap
import threading

import numpy as np
import pytest

from learner.tasks import BUILTIN_REWARDS, REWARD_BOUND, Reward, RewardError, RewardSet, make_reward

RELEASE = threading.Event()  # lets the test's hanging rewards finish once the test is done


def _score(entry, completions, rows, **kwargs):
    rewards = RewardSet([make_reward(entry, "answer")], **kwargs)
    return rewards.score(completions, ["prompt"] * len(completions), rows)


def _reward(entry, completion, answer, **args):
    return make_reward({"name": entry, "args": args} if args else entry, "answer").fn(completion, "p",
                                                                                      {"answer": answer})


@pytest.mark.parametrize("completion, answer, expected", [
    ("42", "42", 1.0), ("  42\n", "42", 1.0), ("42.0", "42", 0.0), ("Paris", "paris", 0.0), ("", "42", 0.0)])
def test_exact_match(completion, answer, expected):
    assert _reward("exact_match", completion, answer) == expected


def test_exact_match_options():
    assert _reward("exact_match", "Paris", "paris", ignore_case=True) == 1.0
    assert _reward("exact_match", " 42", "42", strip=False) == 0.0


GSM8K_REFERENCE = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"


@pytest.mark.parametrize("completion, answer, expected", [
    ("48 + 24 = 72 clips.\n#### 72", GSM8K_REFERENCE, 1.0),  # the dataset's own answer form
    ("#### 72", "72", 1.0),  # or a bare number
    ("so #### 1,000", "1000", 1.0),  # thousands commas
    ("#### $1,000.", "1000", 1.0),  # dollar sign and trailing period
    ("#### 1000.00", "1,000", 1.0),  # compared by value
    ("#### -3", "-3", 1.0),
    ("first #### 5 then #### 72", "72", 1.0),  # the last one counts
    ("#### 71", GSM8K_REFERENCE, 0.0),  # wrong
    ("The answer is 72.", GSM8K_REFERENCE, 0.0),  # strict: no ####
    ("#### seventy-two", GSM8K_REFERENCE, 0.0),
    ("#### 7.2", "72", 0.0),
])
def test_gsm8k(completion, answer, expected):
    assert _reward("gsm8k", completion, answer) == expected


def test_gsm8k_flexible_and_format_score():
    assert _reward("gsm8k", "48 + 24 = 72 clips.", GSM8K_REFERENCE, method="flexible") == 1.0
    assert _reward("gsm8k", "72 clips, or 73", GSM8K_REFERENCE, method="flexible") == 0.0  # the last number
    assert _reward("gsm8k", "#### 71", GSM8K_REFERENCE, format_score=0.1) == pytest.approx(0.1)
    assert _reward("gsm8k", "no number", GSM8K_REFERENCE, format_score=0.1) == 0.0


@pytest.mark.parametrize("completion, answer, expected", [
    (r"So the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}", 1.0),  # nested braces
    (r"\boxed{\dfrac12}", "0.5", 1.0),  # \dfrac, \frac12 and decimals by value
    (r"\boxed{3/4}", r"\tfrac{3}{4}", 1.0),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{10\%}", "10", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{12\text{ cm}}", "12", 1.0),  # units after the number
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{\text{Monday}}", "Monday", 1.0),
    (r"\boxed{-\frac{6}{2}}", "-3", 1.0),
    (r"\boxed 7", "7", 1.0),  # \boxed without braces
    (r"\boxed{1} then \boxed{2}", "2", 1.0),  # the last one
    (r"answer: $\boxed{2}$", r"The answer is $\boxed{2}$.", 1.0),  # a reference with its own \boxed
    (r"\boxed{\sqrt{2}}", "2", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # unclosed
    (r"the answer is 1/2", r"\frac{1}{2}", 0.0),  # not boxed
])
def test_boxed(completion, answer, expected):
    assert _reward("boxed", completion, answer) == expected


@pytest.mark.parametrize("completion, args, expected", [
    ("<think>2+2 is 4</think> <answer>4</answer>", {}, 1.0),
    ("<think>\nmulti\nline\n</think>\n<answer>4</answer>\n", {}, 1.0),
    ("<answer>4</answer>", {}, 0.0),
    ("<think>x</think><answer>4</answer> and more", {}, 0.0),
    ("blah #### 4", {"pattern": "#### -?[0-9]+", "match": "search"}, 1.0),
    ("blah", {"pattern": "#### -?[0-9]+", "match": "search"}, 0.0),
])
def test_format(completion, args, expected):
    assert _reward("format", completion, None, **args) == expected


def test_weighted_sum_and_per_reward_values():
    rewards = RewardSet([make_reward("gsm8k", "answer"),
                         make_reward({"name": "format", "weight": 0.5, "args": {"pattern": ".*####.*"}}, "answer")])
    scores = rewards.score(["#### 72", "#### 71", "72"], ["p"] * 3, [{"answer": "72"}] * 3)
    np.testing.assert_array_equal(scores.total, np.array([1.5, 0.5, 0.0], np.float32))
    np.testing.assert_array_equal(scores.per_reward["gsm8k"], [1, 0, 0])
    np.testing.assert_array_equal(scores.per_reward["format"], [1, 1, 0])
    assert scores.metrics() == {"reward/gsm8k/mean": pytest.approx(1 / 3), "reward/format/mean": pytest.approx(2 / 3),
                                "reward/skipped_samples": 0.0}


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user's reward file (loaded by path) that is also importable as the module ``my_rewards``."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        import asyncio

        def length_bonus(completion, prompt, row, scale=1.0):
            return scale * len(completion) + row["bonus"]

        async def async_match(completion, prompt, row):
            await asyncio.sleep(0)
            return float(completion == row["answer"])

        def batch_match(completions, prompts, rows):
            return [float(c == r["answer"]) for c, r in zip(completions, rows)]
        batch_match.batched = True

        def wrong_count(completions, prompts, rows):
            return [1.0]
        wrong_count.batched = True

        def picky(completion, prompt, row):
            if completion == "boom":
                raise KeyError("no such thing")
            if completion == "nan":
                return float("nan")
            return 1.0

        NOT_A_FUNCTION = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


ROWS = [{"answer": "ab", "bonus": 10}, {"answer": "x", "bonus": 20}]


@pytest.mark.parametrize("name", ["my_rewards.py:length_bonus", "my_rewards:length_bonus"])
def test_user_reward_by_file_path_or_module_with_args(user_rewards, name):
    path_name = name.replace("my_rewards.py", str(user_rewards / "my_rewards.py"))  # an absolute path works too
    for entry in (name, path_name):
        scores = _score({"name": entry, "args": {"scale": 2.0}}, ["ab", "xyz"], ROWS)
        np.testing.assert_array_equal(scores.total, [2 * 2 + 10, 2 * 3 + 20])
        assert list(scores.per_reward) == ["length_bonus"]


@pytest.mark.parametrize("name", ["my_rewards:async_match", "my_rewards.py:batch_match"])
def test_async_and_batched_user_rewards(user_rewards, name):
    np.testing.assert_array_equal(_score(name, ["ab", "y"], ROWS).total, [1.0, 0.0])


def test_async_rewards_run_inside_a_running_event_loop(user_rewards):
    async def from_a_notebook_cell():  # Jupyter runs cells inside an event loop: asyncio.run would refuse
        return _score("my_rewards:async_match", ["ab", "x"], ROWS).total
    np.testing.assert_array_equal(asyncio.run(from_a_notebook_cell()), [1.0, 1.0])


@pytest.mark.parametrize("completions, error", [
    (["ok", "boom"], "KeyError: 'no such thing'"),
    (["ok", "nan"], "ValueError: returned nan, not a finite number"),
])
def test_a_failing_reward_is_skipped_and_named_or_stops(user_rewards, completions, error):
    names = ["prompt 0 (dataset row 7), sample 0", "prompt 0 (dataset row 7), sample 1"]
    rewards = RewardSet([make_reward("my_rewards:picky", None)], on_error="skip")
    scores = rewards.score(completions, ["p", "p"], ROWS, names)
    assert scores.total[0] == 1.0 and np.isnan(scores.total[1]) and scores.skipped == 1
    assert scores.errors == [f"reward 'picky' failed on prompt 0 (dataset row 7), sample 1: {error}"]
    assert scores.metrics()["reward/skipped_samples"] == 1.0 and scores.metrics()["reward/picky/mean"] == 1.0
    stopping = RewardSet([make_reward("my_rewards:picky", None)], on_error="stop")
    with pytest.raises(RewardError, match=r"reward 'picky' failed on prompt 0 \(dataset row 7\), sample 1: "
                                          + error.replace("(", r"\(").replace(")", r"\)")):
        stopping.score(completions, ["p", "p"], ROWS, names)


def _parsed(completion, prompt, row):
    return float(completion)


def test_rewards_beyond_the_float32_bound_are_skipped_and_named():
    """1e300 is finite in float64 and inf in float32, where rewards are trained: such samples are skipped like a
    reward that raised, and so is a weighted total beyond the bound."""
    assert REWARD_BOUND == 1e6
    scores = RewardSet([Reward("parsed", _parsed)]).score(["1.5", "1e300", "-2e6", "1e6"], ["p"] * 4, [{}] * 4)
    np.testing.assert_array_equal(scores.total[[0, 3]], [1.5, 1e6])
    assert np.isnan(scores.total[[1, 2]]).all() and scores.skipped == 2
    assert scores.errors == [
        "reward 'parsed' failed on sample 1: ValueError: returned 1e+300, beyond the bound |reward| <= 1e+06 "
        "(rewards are trained in float32): rescale it",
        "reward 'parsed' failed on sample 2: ValueError: returned -2000000.0, beyond the bound |reward| <= 1e+06 "
        "(rewards are trained in float32): rescale it"]
    weighted = RewardSet([Reward("parsed", _parsed, weight=1e6)]).score(["0.5", "2"], ["p"] * 2, [{}] * 2)
    assert weighted.total[0] == 5e5 and np.isnan(weighted.total[1])
    assert weighted.errors == ["rewards' weighted total 2e+06 on sample 1 is beyond |total| <= 1e+06 (rewards are "
                               "trained in float32): lower the weights"]
    with pytest.raises(RewardError, match="weighted total 2e"):
        RewardSet([Reward("parsed", _parsed, weight=1e6)], on_error="stop").score(["2"], ["p"], [{}])


def test_a_batched_reward_returning_the_wrong_count_fails_every_sample(user_rewards):
    scores = _score("my_rewards:wrong_count", ["a", "b"], ROWS)
    assert scores.skipped == 2 and "returned 1 values for 2 samples" in scores.errors[0]


def test_a_hanging_reward_times_out(tmp_path, monkeypatch):
    (tmp_path / "slow.py").write_text(textwrap.dedent("""
        import asyncio
        from tests.learner.tasks.test_rewards import RELEASE

        def hang(completion, prompt, row):
            if completion == "hang":
                RELEASE.wait(120)  # abandoned by the timeout; released when the test ends
            return 1.0

        async def async_hang(completion, prompt, row):
            if completion == "hang":
                await asyncio.sleep(120)  # cancelled by the timeout
            return 1.0
    """))
    monkeypatch.chdir(tmp_path)
    try:
        for name in ("slow.py:hang", "slow.py:async_hang"):
            scores = _score(name, ["fine", "hang"], ROWS, timeout_s=0.5)
            assert scores.total[0] == 1.0 and np.isnan(scores.total[1])
            assert scores.errors == [f"reward '{name.split(':')[1]}' failed on sample 1: TimeoutError: no result "
                                     "within reward_timeout_s = 0.5 s (the call was abandoned)"]
    finally:
        RELEASE.set()


@pytest.mark.parametrize("entry, message", [
    ("nope", "rewards: unknown reward 'nope'; built-in: exact_match, gsm8k, boxed, format, or "
             "'package.module:function'"),
    ({"name": "gsm8k", "wieght": 2}, r"rewards: unknown keys \['wieght'\]; an entry is a name or a table with "
                                     "the keys"),
    ({"weight": 2}, "rewards: no name"),
    ({"name": "gsm8k", "weight": "2"}, r"rewards.weight='2': a finite number"),
    ({"name": "gsm8k", "args": {"methd": "strict"}}, "rewards.args: gsm8k: got an unexpected keyword argument 'methd'"),
    ("my_rewards.py:nothing", "my_rewards.py has no function 'nothing'"),
    ("my_rewards:NOT_A_FUNCTION", "my_rewards has no function 'NOT_A_FUNCTION'"),
    ("missing.py:f", "'missing.py:f': no file"),
    ("no_such_module_here:f", "No module named 'no_such_module_here'"),
])
def test_reward_config_errors_name_the_entry(user_rewards, entry, message):
    with pytest.raises(ValueError, match=message):
        make_reward(entry, "answer")


def test_builtins_that_compare_need_an_answer_column():
    for name in BUILTIN_REWARDS:
        if name != "format":
            with pytest.raises(ValueError, match=f"the '{name}' reward compares with the answer: set answer_column"):
                make_reward(name, None)
    assert make_reward("format", None).label == "format"


def test_reward_set_errors():
    with pytest.raises(ValueError, match=r"labels \['gsm8k', 'gsm8k'\] repeat"):
        RewardSet([make_reward("gsm8k", "a"), make_reward("gsm8k", "a")])
    with pytest.raises(ValueError, match="on_reward_error='ignore': use 'skip' or 'stop'"):
        RewardSet([make_reward("gsm8k", "a")], on_error="ignore")
    with pytest.raises(ValueError, match="reward_timeout_s=0"):
        RewardSet([make_reward("gsm8k", "a")], timeout_s=0)


def test_a_reward_file_loaded_from_several_threads_at_once_is_whole_in_each(tmp_path):
    # The module is registered before its body runs; without a lock a second thread found it half-imported and
    # raised "has no function". The sleep keeps the first import in its body while the others arrive.
    from learner.tasks._rewards import load_function

    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(0.2)\n\ndef score(completion, prompt, row):\n"
                                             "    return 1.0\n")
    target = f"{tmp_path / 'slow_import.py'}:score"
    results, barrier = [], threading.Barrier(4)

    def load():
        barrier.wait()
        try:
            results.append(load_function(target)("", "", {}))
        except ValueError as error:
            results.append(error)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [1.0] * 4


def _two_args(completion, prompt):
    return 1.0


def _none(completion, prompt, row):
    return None


def _raises_on_empty(completion, prompt, row):
    return 1.0 / len(completion)


def test_check_callable_finds_a_wrong_signature_or_a_none_before_training():
    from learner.rl.preflight import ConfigError, probe_rewards

    assert RewardSet([Reward("ok", _parsed)]).check_callable(["1"], ["p"], [{}]) is None
    assert RewardSet([Reward("empty", _raises_on_empty)]).check_callable([""], ["p"], [{}]) is None  # may depend on it
    problem = RewardSet([Reward("ok", _parsed), Reward("two", _two_args)]).check_callable(["1"], ["p"], [{}])
    assert problem.startswith("reward 'two': TypeError: ") and "positional argument" in problem
    assert (RewardSet([Reward("none", _none)]).check_callable([""], ["p"], [{}])
            == "reward 'none': NotANumberError: returned None, not a finite number")

    class Task:
        reward_set = RewardSet([Reward("none", _none)])

        def prompts(self):
            return [{"prompt": "2+2=", "row": {"answer": "4"}}]

    with pytest.raises(ConfigError, match=r"task.args.rewards: reward 'none': NotANumberError: returned None, .* "
                                          r"before training\); fix the reward function"):
        probe_rewards(Task())
