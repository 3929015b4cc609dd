"""The ``dataset`` task: prompts from a local dataset file, rewards from built-in or user functions.

Run config::

    [task]
    name = "dataset"
    args = { path = "data/gsm8k/train.parquet", prompt_column = "question", answer_column = "answer",
             rewards = ["gsm8k"], max_prompt_tokens = 256, max_completion_tokens = 512,
             validation = { fraction = 0.05, every = 50 } }

Each row becomes a prompt: the prompt column's text (or ``prompt_format`` filled from the row), or the chat
``messages`` column, put through the tokenizer's chat template when it has one (``chat_template``), and encoded.
Prompts longer than ``max_prompt_tokens`` (or empty) are left out and counted. The loop shuffles the kept prompts,
epoch after epoch, without replacement (`learner.rl.prompt_stream.PromptStream`). Each completion is decoded up to its
stop
token and scored by the rewards (`learner.tasks._rewards`) with the prompt text and the row.

For an evaluation, `DatasetTask.validation_records` are the held-out prompts and `DatasetTask.score` scores
completions without touching the training metrics. With ``demonstration_column``, the task also feeds the supervised
warm-up (`learner.tasks.Demonstrations`): the column's text, then the first stop id, is the demonstration.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from learner.tasks._dataset_files import read_rows
from learner.tasks._evaluation import evaluation_metrics
from learner.tasks._hf_tokenizer import HFTokenizer
from learner.tasks._rewards import RewardScores, RewardSet, make_reward
from learner.tasks._tokenizer import CharTokenizer

_VALIDATION_KEYS = ("path", "format", "split", "fraction", "every", "max_prompts")
_LOGGED_REWARD_ERRORS = 5  # reward failures logged per call (all are counted)
_PENDING_DEMONSTRATIONS = 1 << 16  # prompts from make_prompt awaiting noisy_demonstration, at most

logger = logging.getLogger(__name__)


def _error(key: str, message: str) -> ValueError:
    return ValueError(f"task.args.{key}: {message}")


def decode_completion(tokenizer, ids) -> str:
    """The text of a completion up to its first stop id (``tokenizer.eos_ids``), special tokens dropped.

    An id outside the tokenizer's vocabulary (a model's embedding table is often larger, and a sampler may pick an
    unused row) decodes to U+FFFD, the replacement character, so a completion holding one matches no answer.
    """
    ids = np.asarray(ids, np.int64)
    stops = np.flatnonzero(np.isin(ids, tokenizer.eos_ids))
    ids = ids[:stops[0]] if stops.size else ids
    unknown = np.flatnonzero((ids < 0) | (ids >= tokenizer.vocab_size))
    pieces = np.split(ids, unknown)  # every piece after the first starts with an unknown id
    pieces = [pieces[0], *(piece[1:] for piece in pieces[1:])]
    return "\ufffd".join(tokenizer.decode(piece, skip_special_tokens=True) for piece in pieces)


class PromptRecordsView(Sequence):
    """Prompt records ``{"prompt_ids", "prompt", "row", "index"}`` of some dataset rows, built when read."""

    def __init__(self, rows: Sequence[Mapping], indices: np.ndarray, texts: list[str], ids: list[np.ndarray]):
        self._rows, self._indices, self._texts, self._ids = rows, indices, texts, ids

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = range(len(self))[operator.index(i)]
        index = int(self._indices[i])
        return {"prompt_ids": self._ids[i], "prompt": self._texts[i], "row": self._rows[index], "index": index}


class DatasetTask:
    """Prompts from a dataset file and rewards of the decoded completions (see the module docstring).

    Args:
      path: a jsonl, parquet or arrow file, a glob of them, or a ``datasets.save_to_disk`` folder.
      format: ``jsonl``, ``parquet``, ``arrow`` or ``save_to_disk``; None: from the path.
      split: the split of a ``DatasetDict.save_to_disk`` folder.
      prompt_column: the column holding the prompt text.
      messages_column: instead, a column of chat messages ``[{"role", "content"}, ...]`` (or their JSON).
      prompt_format: instead, a ``str.format`` template filled from the row, e.g. ``"{question}\\nAnswer:"``.
      answer_column: the reference answer, for the built-in rewards (the whole row reaches every reward anyway).
      demonstration_column: a column holding a correct completion as text (e.g. GSM8K's ``answer``): the
        warm-up's demonstrations. None: the task has none (set ``warmup.steps = 0``).
      tokenizer: a checkpoint directory with ``tokenizer.json`` (`HFTokenizer`), or ``"char"`` (`CharTokenizer`:
        prompts are ``[bos] + text + [sep]``); None: ``model_path``.
      model_path: the run's ``model.hf_path`` (the loop passes it), the default tokenizer directory.
      chat_template: put prompts through the tokenizer's chat template; None: when it has one.
      system_prompt: a system message before the prompt column's text (chat template only).
      max_prompt_tokens: longer prompts (in tokens, after the chat template) are left out and counted; None:
        keep all, and the longest sets the padding.
      max_completion_tokens: new tokens sampled per completion (unless ``rollout.max_new_tokens`` says otherwise).
      max_context_tokens: the model's context (``max_position_embeddings``; the loop passes it): prompts that leave
        fewer than ``max_completion_tokens`` positions are too long (left out and counted); None: no limit.
      rewards: names (``exact_match``, ``gsm8k``, ``boxed``, ``format``, ``package.module:function``,
        ``path/to/file.py:function``) or tables ``{name, weight, args, batched, label}``; the reward is the
        weighted sum.
      on_reward_error: ``"skip"``: a sample whose reward raised, timed out or was not a number gets reward NaN and
        the loop leaves it out of its group (counted as ``reward/skipped_samples``); ``"stop"``: the run stops with an
        error naming the sample.
      reward_timeout_s: wall-clock limit of each reward call; None: none.
      reward_workers: reward calls in flight at once.
      success_threshold: a sample whose weighted reward reaches this is correct (pass@k in `validation_metrics`).
      validation: ``{path, format, split}`` (another dataset) or ``{fraction}`` (held out of this one by
        ``split_seed``), plus ``every`` (steps between evaluations, for the loop: `validation_every`) and
        ``max_prompts`` (the first ones only).
      split_seed: the seed of the held-out fraction.
      max_rows: read only the first rows (quick experiments); None: all.
      name: for logs; None: ``dataset(<file name>)``.
    """

    def __init__(self, path: str, format: str | None = None, split: str | None = None,
                 prompt_column: str | None = None, messages_column: str | None = None,
                 prompt_format: str | None = None, answer_column: str | None = None,
                 demonstration_column: str | None = None, tokenizer: str | None = None,
                 model_path: str | None = None, chat_template: bool | None = None, system_prompt: str | None = None,
                 max_prompt_tokens: int | None = None, max_completion_tokens: int = 256,
                 rewards: Sequence[str | Mapping[str, Any]] = ("exact_match",), on_reward_error: str = "skip",
                 reward_timeout_s: float | None = 60.0, reward_workers: int = 16, success_threshold: float = 1.0,
                 validation: Mapping[str, Any] | None = None, split_seed: int = 0, max_rows: int | None = None,
                 name: str | None = None, max_context_tokens: int | None = None):
        sources = [key for key, value in (("prompt_column", prompt_column), ("messages_column", messages_column),
                                          ("prompt_format", prompt_format)) if value is not None]
        if len(sources) != 1:
            raise _error("prompt_column", f"give exactly one of prompt_column, messages_column, prompt_format "
                                          f"(got {sources or 'none'})")
        for key, value in (("max_prompt_tokens", max_prompt_tokens), ("max_completion_tokens", max_completion_tokens),
                           ("max_rows", max_rows), ("reward_workers", reward_workers)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise _error(key, f"{value!r}: a positive integer")
        self.path = pathlib.Path(path)
        self.name = name or f"dataset({self.path.name})"
        self.prompt_column, self.messages_column, self.prompt_format = prompt_column, messages_column, prompt_format
        self.answer_column, self.demonstration_column = answer_column, demonstration_column
        self.system_prompt = system_prompt
        self.max_completion_tokens = max_completion_tokens
        if isinstance(success_threshold, bool) or not isinstance(success_threshold, (int, float)):
            raise _error("success_threshold", f"{success_threshold!r}: a number")
        self.success_threshold = float(success_threshold)
        self.tokenizer = self._load_tokenizer(tokenizer or model_path)
        self.chat_template = self._use_chat_template(chat_template)
        if system_prompt is not None and not self.chat_template:
            raise _error("system_prompt", "needs a chat template (chat_template = true and a tokenizer with one)")
        self.reward_set = RewardSet(
            [make_reward(entry, answer_column, key=f"task.args.rewards[{i}]") for i, entry in enumerate(rewards)],
            on_error=on_reward_error, timeout_s=reward_timeout_s, workers=reward_workers)

        rows = self._read("path", path, format, split)
        validation = dict(validation or {})
        unknown = sorted(set(validation) - set(_VALIDATION_KEYS))
        if unknown:
            raise _error("validation", f"unknown keys {unknown}; known: {', '.join(_VALIDATION_KEYS)}")
        if validation and ("path" in validation) == ("fraction" in validation):
            raise _error("validation", "give path (another dataset) or fraction (held out of this one), not both "
                                       "and not neither")
        for key in ("every", "max_prompts"):
            value = validation.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise _error(f"validation.{key}", f"{value!r}: a positive integer")
        self.validation_every: int | None = validation.get("every")  # steps between evaluations; None: none asked
        indices = np.arange(len(rows) if max_rows is None else min(max_rows, len(rows)))
        validation_rows, validation_indices = rows, indices[:0]
        if "fraction" in validation:
            fraction = validation["fraction"]
            if not (isinstance(fraction, float) and 0 < fraction < 1):
                raise _error("validation.fraction", f"{fraction!r}: a number strictly between 0 and 1")
            held_out = np.random.default_rng(split_seed).permutation(indices)
            count = max(1, round(fraction * len(indices)))
            validation_indices, indices = np.sort(held_out[:count]), np.sort(held_out[count:])
        elif "path" in validation:
            validation_rows = self._read("validation.path", validation["path"], validation.get("format"),
                                         validation.get("split"))
            validation_indices = np.arange(len(validation_rows))
        if "max_prompts" in validation:
            validation_indices = validation_indices[:validation["max_prompts"]]

        train = self._encode(rows, indices)
        valid = self._encode(validation_rows, validation_indices)
        longest = max((len(ids) for ids in [*train[2], *valid[2]]), default=0)
        self.max_prompt_tokens = max_prompt_tokens or max(longest, 1)
        if max_context_tokens is not None:
            if max_context_tokens <= max_completion_tokens:
                raise _error("max_completion_tokens", f"{max_completion_tokens} leaves no room for a prompt in the "
                                                      f"model's context of {max_context_tokens} positions")
            self.max_prompt_tokens = min(self.max_prompt_tokens, max_context_tokens - max_completion_tokens)
        self.dropped_too_long = int(sum(len(ids) > self.max_prompt_tokens for ids in train[2]))
        self.dropped_empty = int(sum(len(ids) == 0 for ids in train[2]))
        self.validation_dropped = int(sum(not 0 < len(ids) <= self.max_prompt_tokens for ids in valid[2]))
        self._train = self._keep(rows, *train)
        self._validation = self._keep(validation_rows, *valid)
        if not len(self._train):
            context = ("" if max_context_tokens is None else f" (the model's context of {max_context_tokens} "
                       f"positions less max_completion_tokens = {max_completion_tokens})")
            raise _error("max_prompt_tokens", f"none of the {len(train[0])} training prompts of {path} is kept: "
                                              f"{self.dropped_too_long} are longer than {self.max_prompt_tokens} "
                                              f"tokens{context}, {self.dropped_empty} are empty")
        self._reward_sums: dict[str, list[float]] = {}
        self._skipped = 0
        self._pending_demonstrations: dict[bytes, str] = {}

    # --- construction ----------------------------------------------------------------------------------------

    @staticmethod
    def _load_tokenizer(source):
        if source is None:
            raise _error("tokenizer", "no tokenizer: set task.args.tokenizer to a directory with tokenizer.json "
                                      "(or 'char'), or model.hf_path")
        if source == "char":
            return CharTokenizer()
        try:
            return HFTokenizer.from_directory(source)
        except (FileNotFoundError, ValueError) as err:
            raise _error("tokenizer", str(err)) from None

    def _use_chat_template(self, chat_template: bool | None) -> bool:
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        if chat_template and not has_template:
            raise _error("chat_template", "the tokenizer has no chat_template; set chat_template = false")
        use = has_template if chat_template is None else bool(chat_template)
        if self.messages_column is not None and not use:
            raise _error("messages_column", "chat messages need a chat template (a tokenizer with one, "
                                            "chat_template = true); or use prompt_column")
        return use

    def _read(self, key: str, path, format, split):
        try:
            rows = read_rows(path, format, split)
        except ValueError as err:
            raise _error(key, str(err)) from None
        for column_key in ("prompt_column", "messages_column", "answer_column", "demonstration_column"):
            column = getattr(self, column_key)
            if column is not None and column not in rows.columns:
                raise _error(column_key, f"{column!r} is not a column of {path}; its columns: {rows.columns}")
        return rows

    def _prompt_text(self, row: Mapping[str, Any], index: int) -> str:
        """The prompt of a row as text: after the chat template if there is one."""
        if self.messages_column is not None:
            messages = row[self.messages_column]
            try:
                messages = json.loads(messages) if isinstance(messages, str) else list(messages)
            except (json.JSONDecodeError, TypeError) as err:
                raise _error("messages_column", f"row {index}: not a list of messages ({err})") from None
            return self._render(messages, "messages_column", index)
        if self.prompt_format is not None:
            try:
                text = self.prompt_format.format_map(row)
            except (KeyError, IndexError, ValueError) as err:
                raise _error("prompt_format", f"row {index}: {type(err).__name__}: {err}") from None
        else:
            text = row[self.prompt_column]
            if not isinstance(text, str):
                raise _error("prompt_column", f"row {index}: {text!r} is not text")
        if not self.chat_template:
            return text
        system = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return self._render([*system, {"role": "user", "content": text}], "chat_template", index)

    def _render(self, messages, key: str, index: int) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, TypeError) as err:  # ChatTemplateError is a ValueError
            raise _error(key, f"row {index}: {err}") from None

    def _encode(self, rows, indices) -> tuple[np.ndarray, list[str], list[np.ndarray]]:
        texts = [self._prompt_text(rows[int(i)], int(i)) for i in indices]
        tok = self.tokenizer
        if isinstance(tok, CharTokenizer):
            ids = [np.concatenate([[tok.bos_id], tok.encode(text), [tok.sep_id]]).astype(np.int32) for text in texts]
        else:  # a chat template writes its own special tokens; plain text gets the post-processor's (e.g. bos)
            ids = tok.encode_batch(texts, add_special_tokens=not self.chat_template)
        return indices, texts, ids

    def _keep(self, rows, indices, texts, ids) -> PromptRecordsView:
        keep = [i for i, prompt in enumerate(ids) if 0 < len(prompt) <= self.max_prompt_tokens]
        return PromptRecordsView(rows, indices[keep], [texts[i] for i in keep], [ids[i] for i in keep])

    # --- the Task protocol -----------------------------------------------------------------------------------

    def prompts(self) -> PromptRecordsView:
        """The training prompt records ``{"prompt_ids", "prompt", "row", "index"}`` (``index``: the row's)."""
        return self._train

    def validation_records(self) -> PromptRecordsView:
        """The validation prompt records (empty without ``validation``), as `prompts`."""
        return self._validation

    def score(self, records: Sequence[Mapping[str, Any]], completions: Sequence) -> RewardScores:
        """Every reward of completion ``b`` (ids as sampled) for ``records[b]``; changes nothing (the eval's
        entry point)."""
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} prompt records but {len(completions)} completions")
        texts = [decode_completion(self.tokenizer, ids) for ids in completions]
        return self.reward_set.score(texts, [r["prompt"] for r in records], [r["row"] for r in records],
                                     _sample_names(records))

    def validation_metrics(self, records: Sequence[Mapping[str, Any]], completions: Sequence, num_samples: int,
                           prefix: str = "eval") -> dict[str, float]:
        """Evaluation metrics of ``num_samples`` completions per record (``completions[i * num_samples + j]`` is
        sample ``j`` of ``records[i]``): `learner.tasks.evaluation_metrics` of their `score`, with
        ``success_threshold``. Greedy pass@1: one greedy completion per record, ``num_samples = 1``."""
        repeated = [record for record in records for _ in range(num_samples)]
        return evaluation_metrics(self.score(repeated, completions), num_samples, self.success_threshold, prefix)

    def rewards(self, records: Sequence[Mapping[str, Any]], completions: Sequence) -> np.ndarray:
        """float32 ``[n]``: the weighted reward of each completion; NaN for a skipped sample (see
        ``on_reward_error``). Adds to the means `metrics` reports."""
        scores = self.score(records, completions)
        for label, values in scores.per_reward.items():
            sums = self._reward_sums.setdefault(label, [0.0, 0])
            sums[0] += float(np.nansum(values))
            sums[1] += int(np.isfinite(values).sum())
        self._skipped += scores.skipped
        for line in scores.errors[:_LOGGED_REWARD_ERRORS]:
            logger.warning("%s (skipped: on_reward_error = 'skip')", line)
        if len(scores.errors) > _LOGGED_REWARD_ERRORS:
            logger.warning("... and %d more reward failures", len(scores.errors) - _LOGGED_REWARD_ERRORS)
        return scores.total

    def metrics(self) -> dict[str, float]:
        """Per-reward means (``reward/<label>/mean``) and skipped samples (``reward/skipped_samples``) of the
        `rewards` calls since the last call, and the dataset's counts (``data/...``)."""
        out = {f"reward/{label}/mean": total / count if count else math.nan
               for label, (total, count) in self._reward_sums.items()}
        out |= {"reward/skipped_samples": float(self._skipped), "data/prompts": float(len(self._train)),
                "data/prompts_dropped_too_long": float(self.dropped_too_long),
                "data/prompts_dropped_empty": float(self.dropped_empty),
                "data/validation_prompts": float(len(self._validation))}
        self._reward_sums, self._skipped = {}, 0
        return out

    # --- Demonstrations (the warm-up) ------------------------------------------------------------------------

    def make_prompt(self, rng: np.random.Generator) -> tuple[np.ndarray, Mapping[str, Any]]:
        """A random training prompt: its int32 ids and its record (for `noisy_demonstration`)."""
        if self.demonstration_column is None:
            raise _error("demonstration_column", "not set, and the warm-up needs demonstrations: name the column "
                                                 "holding correct completions (e.g. the answer), or set "
                                                 "warmup.steps = 0")
        record = self._train[int(rng.integers(len(self._train)))]
        if len(self._pending_demonstrations) >= _PENDING_DEMONSTRATIONS:
            self._pending_demonstrations.clear()
        self._pending_demonstrations[record["prompt_ids"].tobytes()] = str(record["row"][self.demonstration_column])
        return record["prompt_ids"], record

    def noisy_demonstration(self, prompt_ids, rng: np.random.Generator, noise: float) -> np.ndarray:
        """The int32 ids of the demonstration of a prompt from `make_prompt`, then the first stop id; each token
        before the stop id is replaced, with probability ``noise``, by a token drawn from the same demonstration."""
        key = np.asarray(prompt_ids, np.int32).tobytes()
        if key not in self._pending_demonstrations:
            raise ValueError("noisy_demonstration: not a prompt from make_prompt (or asked for twice)")
        tokenizer = self.tokenizer
        text = self._pending_demonstrations.pop(key)
        completion = np.append(tokenizer.encode(text), tokenizer.eos_ids[0]).astype(np.int32)
        body = completion[:-1]
        replace = rng.random(body.shape) < noise
        if body.size:
            body[replace] = rng.choice(body, size=int(replace.sum()))
        return completion


def _sample_names(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """``"prompt g (dataset row i), sample s"`` per sample: consecutive samples of one record form a group."""
    names, group, sample = [], -1, 0
    for b, record in enumerate(records):
        if b == 0 or record is not records[b - 1]:
            group, sample = group + 1, 0
        else:
            sample += 1
        names.append(f"prompt {group} (dataset row {record.get('index')}), sample {sample}")
    return names
