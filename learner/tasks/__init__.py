"""Tasks: the prompts an RL run samples from and the rewards of the completions, behind one small protocol.

A `Task` is a tokenizer (the `Tokenizer` protocol), random-access prompt records (``prompts()``) and a reward
function (``rewards(rows, completions)``). The loop loads it from the run config with `load_task`:
``task.name`` is a registered name (`task_names`: the digit tasks, `register_task` adds more) or an import path
``"package.module:attribute"``, and ``task.args`` are the keyword arguments of that class or factory. The loop
shuffles, batches and checkpoints its position in ``prompts()``, so a task knows nothing of epochs or processes.
A task that also has ``make_prompt`` and ``noisy_demonstration`` (`Demonstrations`) can feed the supervised
warm-up. A multi-turn task is an `EnvironmentTask`: its ``environment()`` answers each policy turn (docs/multiturn.md).

A task is any class with these members; no base class is needed. Copy a digit string:

>>> import numpy as np
>>> from learner.tasks import CharTokenizer, Task
>>> class Copy:
...     name, tokenizer = "copy", CharTokenizer()
...     def __init__(self, n=1000, digits=4, seed=0):
...         self.max_prompt_tokens = self.max_completion_tokens = digits + 1  # digits, then sep / eos
...         rng = np.random.default_rng(seed)
...         self.answers = [self.tokenizer.encode("".join(rng.choice(list("0123456789"), digits)))
...                         for _ in range(n)]
...     def prompts(self):  # "prompt_ids" (int32, unpadded) and what the reward needs
...         return [{"prompt_ids": np.append(a, self.tokenizer.sep_id), "answer_ids": a} for a in self.answers]
...     def rewards(self, rows, completions):  # 1 for exactly the digits, then eos
...         return np.array([np.array_equal(c, np.append(row["answer_ids"], self.tokenizer.eos_ids[0]))
...                          for row, c in zip(rows, completions)], np.float32)
>>> task = Copy(n=3)
>>> isinstance(task, Task), len(task.prompts())
(True, 3)
>>> row = task.prompts()[0]
>>> task.rewards([row, row], [np.append(row["answer_ids"], 2), row["answer_ids"]])  # with eos; truncated
array([1., 0.], dtype=float32)

Saved as ``my_tasks.py`` on the Python path, it is the run config's ``task.name = "my_tasks:Copy"`` with
``task.args = {n = 5000}``. For question/answer text on the character tokenizer, subclass `TextTask` instead:
two methods (a random question, its answer) give prompts, exact-match rewards and demonstrations.

For a dataset file, no code is needed: the registered ``dataset`` task (`DatasetTask`) reads jsonl, parquet, arrow
and ``save_to_disk`` data (`read_rows`), renders prompts with the checkpoint's tokenizer and chat template
(`HFTokenizer`, `render_chat`) and scores decoded completions with built-in or user rewards (`RewardSet`); see
docs/data.md.
"""

from learner.tasks._calculator import Calculator
from learner.tasks._chat_template import ChatTemplateError
from learner.tasks._chat_template import render_chat
from learner.tasks._dataset_files import read_rows
from learner.tasks._dataset_task import DatasetTask
from learner.tasks._dataset_task import decode_completion
from learner.tasks._digit_tasks import Addition
from learner.tasks._digit_tasks import ReverseDigits
from learner.tasks._digit_tasks import SortDigits
from learner.tasks._environment import Environment
from learner.tasks._environment import EnvironmentTask
from learner.tasks._environment import EpisodeLimits
from learner.tasks._environment import StepResult
from learner.tasks._environment import message_segment_ids
from learner.tasks._environment import segment_ids
from learner.tasks._environment import turn_end_id
from learner.tasks._evaluation import evaluation_metrics
from learner.tasks._evaluation import pass_at_k
from learner.tasks._hf_tokenizer import HFTokenizer
from learner.tasks._protocols import Demonstrations
from learner.tasks._protocols import Task
from learner.tasks._protocols import Tokenizer
from learner.tasks._registry import load_task
from learner.tasks._registry import register_task
from learner.tasks._registry import run_tokenizer
from learner.tasks._registry import task_names
from learner.tasks._rewards import BUILTIN_REWARDS
from learner.tasks._rewards import REWARD_BOUND
from learner.tasks._rewards import Reward
from learner.tasks._rewards import RewardError
from learner.tasks._rewards import RewardScores
from learner.tasks._rewards import RewardSet
from learner.tasks._rewards import load_function
from learner.tasks._rewards import make_reward
from learner.tasks._text_task import TextTask
from learner.tasks._tokenizer import BOS_ID
from learner.tasks._tokenizer import CharTokenizer
from learner.tasks._tokenizer import EOS_ID
from learner.tasks._tokenizer import PAD_ID
from learner.tasks._tokenizer import SEP_ID
from learner.tasks._tokenizer import TOKENIZER

__all__ = (
    "Addition",
    "BOS_ID",
    "BUILTIN_REWARDS",
    "Calculator",
    "REWARD_BOUND",
    "CharTokenizer",
    "ChatTemplateError",
    "DatasetTask",
    "Demonstrations",
    "EOS_ID",
    "Environment",
    "EnvironmentTask",
    "EpisodeLimits",
    "HFTokenizer",
    "PAD_ID",
    "ReverseDigits",
    "Reward",
    "RewardError",
    "RewardScores",
    "RewardSet",
    "SEP_ID",
    "SortDigits",
    "StepResult",
    "TOKENIZER",
    "Task",
    "TextTask",
    "Tokenizer",
    "decode_completion",
    "evaluation_metrics",
    "load_function",
    "run_tokenizer",
    "load_task",
    "make_reward",
    "message_segment_ids",
    "pass_at_k",
    "read_rows",
    "register_task",
    "render_chat",
    "segment_ids",
    "task_names",
    "turn_end_id",
)
