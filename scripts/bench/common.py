"""What the benchmarks share: the checkout's root, the environment of a worker process that imports this checkout,
one timed call, and the JSON file of a result."""

from __future__ import annotations

import json
import os
import pathlib
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def checkout_env(*first: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with ``PYTHONPATH`` = ``first``, the checkout, then the caller's
    own entries (gpu_check.sh's carried wheels): a worker (``python -m scripts.bench.NAME``, ``python -m
    learner.train``) imports this checkout's packages wherever it starts.

    Example:
        >>> checkout_env("/tmp/rev", env={})["PYTHONPATH"].split(os.pathsep) == ["/tmp/rev", str(REPO_ROOT)]
        True
    """
    env = dict(os.environ if env is None else env)
    inherited = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*first, str(REPO_ROOT), *inherited]))
    return env


def timed(fn, *args) -> float:
    """Seconds of one call of ``fn(*args)``, its result ready (`jax.block_until_ready`)."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def write_json(path: pathlib.Path | str | None, result) -> None:
    """``result`` as indented JSON at ``path`` (a benchmark's ``--out``); nothing when ``path`` is None."""
    if path is not None:
        pathlib.Path(path).write_text(json.dumps(result, indent=1) + "\n")
