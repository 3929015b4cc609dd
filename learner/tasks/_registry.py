"""Tasks by name: the run config's ``task.name`` (a registered name or an import path) and ``task.args``."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from learner.tasks._calculator import Calculator
from learner.tasks._dataset_task import DatasetTask
from learner.tasks._digit_tasks import Addition, ReverseDigits, SortDigits
from learner.tasks._environment import EnvironmentTask
from learner.tasks._protocols import Task, Tokenizer, missing_members

_FACTORIES: dict[str, Callable[..., Task]] = {}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Makes ``load_task(name, args)`` return ``factory(**args)``; raises ValueError if the name is taken."""
    if ":" in name:
        raise ValueError(f"task name {name!r}: ':' marks an import path, not a registered name")
    if name in _FACTORIES:
        raise ValueError(f"task {name!r} is already registered")
    _FACTORIES[name] = factory


def task_names() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_FACTORIES)


def load_task(name: str, args: Mapping[str, Any] | None = None, *, model_path: str | None = None,
              model_context: int | None = None) -> Task:
    """The task that the run config's ``task.name`` and ``task.args`` name, checked against the `Task` protocol.

    Args:
      name: a registered name (`task_names`), or an import path ``"package.module:attribute"`` whose attribute
        is a Task class or factory (called with ``**args``) or a Task instance (then ``args`` must be empty).
        The module is imported from ``sys.path``, so a user's task needs no wrapper script.
      args: keyword arguments of the class or factory; None for none.
      model_path: the run's ``model.hf_path``, passed as ``model_path`` to a class or factory that takes one
        (the ``dataset`` task's default tokenizer directory) unless ``args`` set it.
      model_context: the model's context in tokens, passed likewise as ``max_context_tokens`` (the ``dataset``
        task leaves out and counts prompts that do not fit it with their completion).

    A task with an ``environment`` method is checked as an `learner.tasks.EnvironmentTask` (multi-turn).

    Raises:
      ValueError: naming the config key at fault (``task.name`` or ``task.args``) and the reason.

    >>> task = load_task("addition_1digit", {"num_prompts": 8, "seed": 1})
    >>> row = task.prompts()[0]
    >>> len(task.prompts()), task.tokenizer.decode(row["prompt_ids"][1:-1]), row["answer"]
    (8, '4+5', '9')
    >>> load_task("addition_1digit", {"n": 8})
    Traceback (most recent call last):
    ...
    ValueError: task.args: addition_1digit() got an unexpected keyword argument 'n'; valid: num_prompts, seed, digits
    """
    args = dict(args or {})
    target = _resolve(name)
    if callable(target) and (isinstance(target, type) or not isinstance(target, Task)):
        if model_path is not None and "model_path" not in args and _takes(target, "model_path"):
            args["model_path"] = model_path
        if model_context is not None and "max_context_tokens" not in args and _takes(target, "max_context_tokens"):
            args["max_context_tokens"] = model_context
        try:
            inspect.signature(target).bind(**args)
        except TypeError as err:
            raise ValueError(f"task.args: {name.rpartition(':')[2]}() {err}{_valid_args(target, args)}") from None
        task = target(**args)
    elif args:
        raise ValueError(f"task.args: {name!r} is a task instance, which takes no args; got {sorted(args)}")
    else:
        task = target
    protocol = EnvironmentTask if hasattr(task, "environment") else Task  # a multi-turn task, or a single-turn one
    missing = missing_members(task, protocol)
    if "tokenizer" not in missing:
        missing += [f"tokenizer.{member}" for member in missing_members(task.tokenizer, Tokenizer)]
    if missing:
        article = "an" if protocol is EnvironmentTask else "a"
        raise ValueError(f"task.name={name!r}: {type(task).__name__} is not {article} {protocol.__name__}: it lacks "
                         f"{', '.join(missing)}")
    return task


def run_tokenizer(config: Mapping[str, Any]):
    """The tokenizer a run used, from its config as plain data (as a checkpoint's metadata records it): its task's,
    built as the run built it (with ``model.hf_path``).

    Raises:
      ValueError: the task does not load here (naming it and why).
    """
    task, model = config.get("task") or {}, config.get("model") or {}
    try:
        return load_task(task.get("name"), task.get("args"), model_path=model.get("hf_path")).tokenizer
    except Exception as error:  # noqa: BLE001 -- whatever the task raises: the message names it
        raise ValueError(f"the run's task {task.get('name')!r} does not load here ({type(error).__name__}: "
                         f"{error}), so its tokenizer is unknown") from None


def _valid_args(factory: Callable, args: Mapping[str, Any]) -> str:
    """``"; valid: a, b, ..."``: the factory's arguments, those nearest an unknown one first ("" if none is unknown)."""
    parameters = [name for name, p in inspect.signature(factory).parameters.items()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "model_path"]
    unknown = [key for key in args if key not in parameters]
    if not unknown:
        return ""
    nearest = difflib.get_close_matches(unknown[0], parameters, n=len(parameters), cutoff=0.0)
    return f"; valid: {', '.join(nearest)}"


def _takes(factory: Callable, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _resolve(name: str) -> Any:
    """The registered factory or the imported attribute that ``name`` names."""
    if ":" not in name:
        if name not in _FACTORIES:
            raise ValueError(f"task.name={name!r}: unknown task; registered: {', '.join(task_names())} "
                             "(or give an import path 'package.module:attribute')")
        return _FACTORIES[name]
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as err:
        raise ValueError(f"task.name={name!r}: {err}") from err
    if not hasattr(module, attribute):
        raise ValueError(f"task.name={name!r}: module {module_name!r} has no attribute {attribute!r}")
    return getattr(module, attribute)


register_task("addition_1digit", functools.partial(Addition, digits=1))
register_task("addition_2digit", functools.partial(Addition, digits=2))
register_task("dataset", DatasetTask)
register_task("sort_digits", SortDigits)
register_task("reverse_digits", ReverseDigits)
register_task("tool_calculator", Calculator)
