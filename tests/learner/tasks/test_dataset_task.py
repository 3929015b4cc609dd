"""The `dataset` task: column mapping through the chat template (ids as transformers gives them), the prompt length
filter and its counts, the validation split and its metrics, rewards with the row and per-reward metrics, args errors
that name the key, demonstrations with pad == eos, and the prompt stream over it (epochs without replacement, resume
mid-epoch in the same order)."""

import importlib
import itertools
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.rl import demonstration_batch
from learner.rl.prompt_stream import PromptStream
from learner.tasks import Demonstrations, Task, load_task, pass_at_k
from rollout_client import LogprobMode, SamplingParams
from tests.support.hf_files import write_tokenizer

transformers = importlib.import_module("transformers")

QUESTIONS = [f"What is {a} + {b}?" + " Think step by step." * (a % 4) for a in range(6) for b in range(5)]
ROWS = [{"question": q, "answer": f"{i} so #### {i}", "id": i} for i, q in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dataset")
    (directory / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    write_tokenizer(directory / "qwen")
    write_tokenizer(directory / "pad_is_eos", pad_token=None, eos_token="<|endoftext|>", generation_eos=())
    return directory


def _task(files, **args):
    return load_task("dataset", {"path": str(files / "train.jsonl"), "prompt_column": "question",
                                 "answer_column": "answer", "tokenizer": str(files / "qwen"), "rewards": ["gsm8k"],
                                 **args})


def test_prompts_are_the_chat_templates_ids_as_transformers_gives_them(files):
    task = _task(files, system_prompt="Answer after ####.")
    assert isinstance(task, Task) and isinstance(task, Demonstrations) and task.name == "dataset(train.jsonl)"
    reference = transformers.AutoTokenizer.from_pretrained(files / "qwen")
    records = task.prompts()
    assert len(records) == len(ROWS)
    for i in (0, 7, 29):
        messages = [{"role": "system", "content": "Answer after ####."}, {"role": "user", "content": QUESTIONS[i]}]
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert records[i]["prompt"] == text and records[i]["row"] == ROWS[i] and records[i]["index"] == i
        assert records[i]["prompt_ids"].dtype == np.int32
        assert records[i]["prompt_ids"].tolist() == reference(text, add_special_tokens=False)["input_ids"]
    assert task.max_prompt_tokens == max(len(r["prompt_ids"]) for r in records)  # none given: the longest


def test_messages_column_and_prompt_format(files, tmp_path):
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    pq.write_table(pa.Table.from_pylist([{"chat": m, "answer": "1"} for m in messages]), tmp_path / "chat.parquet")
    chat = load_task("dataset", {"path": str(tmp_path / "chat.parquet"), "messages_column": "chat",
                                 "answer_column": "answer", "tokenizer": str(files / "qwen")})
    plain = _task(files)
    for i in range(4):  # a user message of the question, as the prompt column with the template gives
        np.testing.assert_array_equal(chat.prompts()[i]["prompt_ids"], plain.prompts()[i]["prompt_ids"])
    formatted = _task(files, prompt_column=None, prompt_format="Q{id}: {question}\nA:", chat_template=False)
    tokenizer = formatted.tokenizer
    assert formatted.prompts()[3]["prompt"] == f"Q3: {QUESTIONS[3]}\nA:"
    np.testing.assert_array_equal(formatted.prompts()[3]["prompt_ids"], tokenizer.encode(f"Q3: {QUESTIONS[3]}\nA:"))


def test_the_length_filter_drops_and_counts_long_prompts(files):
    lengths = [len(r["prompt_ids"]) for r in _task(files).prompts()]
    limit = int(np.median(lengths))
    task = _task(files, max_prompt_tokens=limit, validation={"fraction": 0.2})
    kept = [r["index"] for r in task.prompts()] + [r["index"] for r in task.validation_records()]
    assert sorted(kept) == [i for i, n in enumerate(lengths) if n <= limit]
    assert task.dropped_too_long + task.validation_dropped == sum(n > limit for n in lengths) > 0
    assert all(len(r["prompt_ids"]) <= limit for r in task.prompts()) and task.max_prompt_tokens == limit
    metrics = task.metrics()
    assert metrics["data/prompts_dropped_too_long"] == task.dropped_too_long
    assert metrics["data/prompts"] == len(task.prompts())
    with pytest.raises(ValueError, match=r"task.args.max_prompt_tokens: none of the 30 training prompts .* 30 are "
                                         r"longer than 3 tokens"):
        _task(files, max_prompt_tokens=3)


def test_prompts_beyond_the_models_context_are_dropped_and_counted(files):
    """The loop passes the model's context (max_position_embeddings): a prompt that leaves fewer positions than
    max_completion_tokens is too long, whatever max_prompt_tokens says."""
    lengths = [len(r["prompt_ids"]) for r in _task(files).prompts()]
    limit = int(np.median(lengths))
    task = load_task("dataset", {"path": str(files / "train.jsonl"), "prompt_column": "question",
                                 "answer_column": "answer", "tokenizer": str(files / "qwen"),
                                 "max_completion_tokens": 16}, model_context=limit + 16)
    assert task.max_prompt_tokens == limit
    assert sorted(r["index"] for r in task.prompts()) == [i for i, n in enumerate(lengths) if n <= limit]
    assert task.metrics()["data/prompts_dropped_too_long"] == sum(n > limit for n in lengths) > 0
    with pytest.raises(ValueError, match=r"task.args.max_prompt_tokens: none of the 30 training prompts .* 30 are "
                                         r"longer than 3 tokens \(the model's context of 19 positions less "
                                         r"max_completion_tokens = 16\)"):
        _task(files, max_completion_tokens=16, max_context_tokens=19)
    with pytest.raises(ValueError, match=r"task.args.max_completion_tokens: 16 leaves no room for a prompt in the "
                                         r"model's context of 16 positions"):
        _task(files, max_completion_tokens=16, max_context_tokens=16)


def test_validation_fraction_is_held_out_and_a_second_file_works(files, tmp_path):
    task = _task(files, validation={"fraction": 0.2, "every": 10})
    train = {r["index"] for r in task.prompts()}
    valid = {r["index"] for r in task.validation_records()}
    assert len(valid) == 6 and not train & valid and train | valid == set(range(30)) and task.validation_every == 10
    again = _task(files, validation={"fraction": 0.2, "every": 10})
    assert {r["index"] for r in again.validation_records()} == valid  # split_seed fixes the split
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS[:5]))
    other = _task(files, validation={"path": str(tmp_path / "test.jsonl"), "max_prompts": 3})
    assert len(other.prompts()) == 30 and [r["row"] for r in other.validation_records()] == ROWS[:3]
    assert len(_task(files).validation_records()) == 0 and _task(files).validation_every is None


def test_rewards_see_the_decoded_completion_and_row_and_metrics_are_per_reward(files):
    task = _task(files, rewards=["gsm8k", {"name": "format", "weight": 0.5, "args": {"pattern": ".*####.*"}}])
    tokenizer = task.tokenizer
    im_end, endoftext = tokenizer.eos_ids
    rows = [task.prompts()[i] for i in (4, 9)]
    completions = [np.append(tokenizer.encode("#### 4"), im_end),  # right, stops on <|im_end|>
                   np.append(tokenizer.encode("#### 9"), [endoftext, im_end]),  # right, stops on <|endoftext|>
                   tokenizer.encode("#### 9"),  # no stop id (truncated at the length limit): scored as it is
                   np.append(tokenizer.encode("nine"), im_end)]
    records = [rows[0], rows[1], rows[1], rows[1]]
    np.testing.assert_array_equal(task.rewards(records, completions), [1.5, 1.5, 1.5, 0.0])
    task.rewards(records[:2], completions[:2])
    metrics = task.metrics()  # over both calls: 6 samples
    assert metrics["reward/gsm8k/mean"] == 5 / 6 and metrics["reward/format/mean"] == 5 / 6
    assert metrics["reward/skipped_samples"] == 0.0
    assert "reward/gsm8k/mean" not in task.metrics()  # reset by each call


def test_a_raising_reward_is_skipped_with_the_sample_named(files, tmp_path, caplog):
    (tmp_path / "strict.py").write_text("def strict(completion, prompt, row):\n"
                                        "    if row['id'] == 9: raise ZeroDivisionError('row 9')\n    return 1.0\n")
    task = _task(files, rewards=[f"{tmp_path / 'strict.py'}:strict"])
    a, b = task.prompts()[4], task.prompts()[9]
    completion = task.tokenizer.encode("x")
    rewards = task.rewards([a, a, b, b], [completion] * 4)
    assert rewards[:2].tolist() == [1.0, 1.0] and np.isnan(rewards[2:]).all()
    assert task.metrics()["reward/skipped_samples"] == 2.0
    assert "reward 'strict' failed on prompt 1 (dataset row 9), sample 1: ZeroDivisionError: row 9" in caplog.text
    stopping = _task(files, rewards=[f"{tmp_path / 'strict.py'}:strict"], on_reward_error="stop")
    with pytest.raises(RuntimeError, match=r"failed on prompt 1 \(dataset row 9\), sample 0: ZeroDivisionError"):
        stopping.rewards([a, b, b], [completion] * 3)


def test_validation_metrics_score_without_touching_the_training_metrics(files):
    task = _task(files, validation={"fraction": 0.2})
    records = list(task.validation_records())[:2]
    tokenizer = task.tokenizer
    right = [np.append(tokenizer.encode(f"#### {r['index']}"), tokenizer.eos_ids[0]) for r in records]
    wrong = np.append(tokenizer.encode("#### -1"), tokenizer.eos_ids[0])
    completions = [right[0], wrong, wrong, wrong, wrong]  # 2 samples per record; then one greedy each
    metrics = task.validation_metrics(records, completions[:4], num_samples=2)
    assert metrics == {"eval/gsm8k/mean": 0.25, "eval/skipped_samples": 0.0, "eval/reward_mean": 0.25,
                       "eval/pass@1": 0.25, "eval/pass@2": 0.5}
    greedy = task.validation_metrics(records, [right[0], right[1]], num_samples=1, prefix="eval_greedy")
    assert greedy["eval_greedy/pass@1"] == 1.0
    assert "reward/gsm8k/mean" not in task.metrics()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=1, max_size=4), st.integers(1, 5))
def test_pass_at_k_is_the_mean_over_all_k_subsets(correct, k):
    expected = np.mean([np.mean([any(row[i] for i in subset) for subset in itertools.combinations(range(5), k)])
                        for row in correct])
    assert math.isclose(pass_at_k(correct, k), expected, rel_tol=1e-12, abs_tol=1e-12)


def test_demonstrations_keep_the_eos_in_the_loss_when_pad_is_eos(files):
    task = _task(files, tokenizer=str(files / "pad_is_eos"), chat_template=False, demonstration_column="answer")
    tokenizer = task.tokenizer
    assert tokenizer.pad_id == tokenizer.eos_ids[0]  # no pad token: the usual HF setup
    batch = demonstration_batch(task, np.random.default_rng(0), size=4, noise=0.0, length=256, row_multiple=4)
    for row in range(4):
        real = int(batch.attention_mask[row].sum())
        trained = np.flatnonzero(batch.loss_mask[row])
        assert trained[-1] == real - 1 and batch.tokens[row, real - 1] == tokenizer.pad_id  # eos, trained on
        assert (batch.tokens[row, trained[0]:real] != tokenizer.pad_id).sum() == len(trained) - 1  # a pad mask
        answer = tokenizer.decode(batch.tokens[row, trained[:-1]])  # would have dropped it
        assert answer.endswith(" so #### " + answer.split()[0])


def test_noisy_demonstrations_and_their_errors(files):
    task = _task(files, demonstration_column="answer")
    rng = np.random.default_rng(1)
    prompt, record = task.make_prompt(rng)
    clean = np.append(task.tokenizer.encode(record["row"]["answer"]), task.tokenizer.eos_ids[0])
    noisy = task.noisy_demonstration(prompt, rng, noise=1.0)
    assert len(noisy) == len(clean) and noisy[-1] == clean[-1] and set(noisy[:-1]) <= set(clean[:-1])
    with pytest.raises(ValueError, match="not a prompt from make_prompt"):
        task.noisy_demonstration(prompt, rng, noise=0.0)
    with pytest.raises(ValueError, match="task.args.demonstration_column: not set, and the warm-up needs"):
        _task(files).make_prompt(rng)


def _stream_indices(task, state=None, batches=6, batch_size=4):
    stream = PromptStream(task.prompts(), batch_size, seed=3, sampling=SamplingParams(max_new_tokens=4),
                          num_samples=2, logprob_mode=LogprobMode.PROCESSED)
    if state is not None:
        stream.set_state(state)
    requests = stream.requests()
    order = []
    for _ in range(batches):
        for _ in range(batch_size):
            next(requests)
            order.append(stream.next_record()["index"])
    return order, stream


def test_prompt_stream_epochs_are_without_replacement_and_resume_mid_epoch_in_order(files):
    task = _task(files, validation={"fraction": 0.2})  # 24 training prompts: 6 batches of 4 per epoch
    order, stream = _stream_indices(task, batches=15)
    epochs = [order[i:i + 24] for i in range(0, 72, 24)][:2]
    train = sorted(r["index"] for r in task.prompts())
    assert [sorted(epoch) for epoch in epochs] == [train, train] and epochs[0] != epochs[1]  # reshuffled
    resumed, _ = _stream_indices(task, state=stream.position(8), batches=7)  # mid-epoch 2, as a checkpoint saves it
    assert resumed == order[8 * 4:]


@pytest.mark.parametrize("args, message", [
    ({"prompt_column": None}, "task.args.prompt_column: give exactly one of prompt_column, messages_column, "
                              "prompt_format"),
    ({"messages_column": "chat"}, r"give exactly one .* \(got \['prompt_column', 'messages_column'\]\)"),
    ({"prompt_column": "q"}, r"task.args.prompt_column: 'q' is not a column of .*train.jsonl; its columns: "
                             r"\['question', 'answer', 'id'\]"),
    ({"answer_column": "solution"}, "task.args.answer_column: 'solution' is not a column"),
    ({"path": "nowhere.jsonl"}, "task.args.path: nowhere.jsonl: no such file or folder"),
    ({"tokenizer": None}, "task.args.tokenizer: no tokenizer: set task.args.tokenizer to a directory"),
    ({"tokenizer": "/nonexistent"}, "task.args.tokenizer: /nonexistent: no tokenizer.json"),
    ({"tokenizer": "char", "chat_template": True}, "task.args.chat_template: the tokenizer has no chat_template"),
    ({"tokenizer": "char", "system_prompt": "x"}, "task.args.system_prompt: needs a chat template"),
    ({"max_prompt_tokens": 0}, "task.args.max_prompt_tokens: 0: a positive integer"),
    ({"rewards": ["gsm8k", "nope"]}, r"task.args.rewards\[1\]: unknown reward 'nope'"),
    ({"on_reward_error": "ignore"}, "on_reward_error='ignore': use 'skip' or 'stop'"),
    ({"validation": {"fraction": 2.0}}, "task.args.validation.fraction: 2.0: a number strictly between 0 and 1"),
    ({"validation": {"every": 5}}, "task.args.validation: give path .* or fraction .*, not both and not neither"),
    ({"validation": {"fraction": 0.1, "evry": 5}}, r"task.args.validation: unknown keys \['evry'\]"),
    ({"validation": {"fraction": 0.1, "every": 0}}, "task.args.validation.every: 0: a positive integer"),
    ({"prompt_column": None, "prompt_format": "{nope}"}, "task.args.prompt_format: row 0: KeyError: 'nope'"),
    ({"colour": "red"}, "task.args: dataset.* got an unexpected keyword argument 'colour'"),
])
def test_args_errors_name_the_key(files, args, message):
    with pytest.raises(ValueError, match=message):
        _task(files, **args)


def test_the_tokenizer_defaults_to_the_models_directory(files):
    task = load_task("dataset", {"path": str(files / "train.jsonl"), "prompt_column": "question",
                                 "answer_column": "answer"}, model_path=str(files / "qwen"))
    assert task.tokenizer.source == str(files / "qwen")
