"""Verifiable tasks for RL: prompts, exact-match rewards and demonstrations, on one character tokenizer.

Implement ``TextTask`` (two methods) or the ``Task`` protocol, then ``register_task`` it.
"""

from learner.tasks._base import Task
from learner.tasks._base import TextTask
from learner.tasks._digit_tasks import Addition
from learner.tasks._digit_tasks import ReverseDigits
from learner.tasks._digit_tasks import SortDigits
from learner.tasks._prompts import batch_rewards
from learner.tasks._prompts import prompt_example
from learner.tasks._registry import get_task
from learner.tasks._registry import register_task
from learner.tasks._registry import task_names
from learner.tasks._tokenizer import BOS_ID
from learner.tasks._tokenizer import EOS_ID
from learner.tasks._tokenizer import PAD_ID
from learner.tasks._tokenizer import SEP_ID
from learner.tasks._tokenizer import TOKENIZER
from learner.tasks._tokenizer import CharTokenizer
