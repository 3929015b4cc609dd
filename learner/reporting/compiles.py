"""The XLA programs a process builds, counted, and the persistent compilation cache they come from.

JAX reports every program it builds through `jax.monitoring`: ``/jax/core/compile/backend_compile_duration`` once
per program compiled or loaded from the persistent cache (with its seconds), ``/jax/compilation_cache/cache_hits``
once per program loaded from it. `compile_stats` reads a process-wide counter of them, installed once
(`count_compiles`): a run puts the learner's figures in its metrics every step (``compile/*``) and the reference
server its count in GetServerInfo, so a program compiled mid-run shows as a count that still grows.

`enable_compilation_cache` points JAX at one cache directory for the learner and the servers it launches, so a
rerun, a resumed run or another run of the same shapes loads its programs instead of compiling them.
"""

from __future__ import annotations

import os
import pathlib
import threading

import jax

_BUILT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_stats = {"compile/programs": 0, "compile/seconds": 0.0, "compile/cache_hits": 0}
_installed = False


def count_compiles() -> None:
    """Starts counting this process's program builds (idempotent: the listeners are process-wide)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == _BUILT:
            with _lock:
                _stats["compile/programs"] += 1
                _stats["compile/seconds"] += seconds

    def on_event(event: str, **_) -> None:
        if event == _CACHE_HIT:
            with _lock:
                _stats["compile/cache_hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


def compile_stats() -> dict[str, float]:
    """Since `count_compiles`: ``compile/programs`` built (compiled, or loaded from the persistent cache),
    ``compile/seconds`` spent on them, ``compile/cache_hits`` of them loaded from the cache."""
    with _lock:
        return dict(_stats)


def enable_compilation_cache() -> pathlib.Path | None:
    """JAX's persistent compilation cache in ``JAX_COMPILATION_CACHE_DIR``, else ``~/.cache/tether/jax`` (under
    ``XDG_CACHE_HOME`` when set); also set in this process's environment, so that the servers it launches share it.
    Returns the directory; None when ``JAX_ENABLE_COMPILATION_CACHE=false`` turns the cache off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    if jax.config.jax_compilation_cache_dir is None:  # set from JAX_COMPILATION_CACHE_DIR when that is set
        cache_home = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
        jax.config.update("jax_compilation_cache_dir", str(cache_home / "tether" / "jax"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
    return pathlib.Path(jax.config.jax_compilation_cache_dir)
