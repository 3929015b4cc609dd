"""Tasks by name, so configs and the command line can pick one."""

from __future__ import annotations

from learner.tasks._base import Task
from learner.tasks._digit_tasks import Addition, ReverseDigits, SortDigits

_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> None:
    """Makes ``task`` available to ``get_task`` under ``task.name``; raises ValueError if the name is taken."""
    if task.name in _TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    _TASKS[task.name] = task


def get_task(name: str) -> Task:
    """The registered task called ``name``.

    >>> get_task("sort_digits").solve("312")
    '123'
    """
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {task_names()}")
    return _TASKS[name]


def task_names() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_TASKS)


for _task in (Addition(digits=1), Addition(digits=2), SortDigits(), ReverseDigits()):
    register_task(_task)
