"""The XLA programs a process builds, counted, and the persistent compilation cache they come from.

JAX reports every program it builds through `jax.monitoring`: ``/jax/core/compile/backend_compile_duration`` once
per program compiled or loaded from the persistent cache (with its seconds), ``/jax/compilation_cache/cache_hits``
once per program loaded from it; ``/jax/core/compile/jaxpr_trace_duration`` and
``/jax/core/compile/jaxpr_to_mlir_module_duration`` per program traced and lowered, which every process pays even
when the cache holds the program (its key is the lowered module). `compile_stats` reads a process-wide counter of
them, installed once (`count_compiles`): a run puts the learner's figures in its metrics every step
(``compile/*``) and the reference server its count in GetServerInfo, so a program compiled mid-run shows as a count
that still grows.

`enable_compilation_cache` points JAX at one cache directory for the learner and the servers it launches, so a
rerun, a resumed run or another run of the same shapes loads its programs instead of compiling them. It caches every
program, however quickly it compiled (JAX's default skips those under 1 s: on a GPU each of them would be compiled
and autotuned again at every start), and keeps XLA's GPU autotuning results next to the programs (the
``xla_gpu_per_fusion_autotune_cache_dir`` subdirectory: a program compiled again, e.g. after a change of shapes,
reuses the autotuning of its unchanged fusions). ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` and
``JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES`` (e.g. ``all``: also XLA's GPU kernel cache) override these.
"""

from __future__ import annotations

import os
import pathlib
import threading

import jax

_BUILT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_PHASES = {"/jax/core/compile/jaxpr_trace_duration": "compile/trace_seconds",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "compile/lower_seconds"}
AUTOTUNE_CACHE = "xla_gpu_per_fusion_autotune_cache_dir"  # JAX's name for XLA's option and for the subdirectory
_lock = threading.Lock()
_stats = {"compile/programs": 0, "compile/seconds": 0.0, "compile/cache_hits": 0, "compile/trace_seconds": 0.0,
          "compile/lower_seconds": 0.0}
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
        elif event in _PHASES:
            with _lock:
                _stats[_PHASES[event]] += seconds

    def on_event(event: str, **_) -> None:
        if event == _CACHE_HIT:
            with _lock:
                _stats["compile/cache_hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


def compile_stats() -> dict[str, float]:
    """Since `count_compiles`: ``compile/programs`` built (compiled, or loaded from the persistent cache),
    ``compile/seconds`` spent on them, ``compile/cache_hits`` of them loaded from the cache, and the seconds spent
    before that tracing (``compile/trace_seconds``) and lowering (``compile/lower_seconds``) the programs."""
    with _lock:
        return dict(_stats)


def enable_compilation_cache() -> pathlib.Path | None:
    """JAX's persistent compilation cache in ``JAX_COMPILATION_CACHE_DIR``, else ``~/.cache/tether/jax`` (under
    ``XDG_CACHE_HOME`` when set); also set in this process's environment, so that the servers it launches share it.
    Every program is cached, with XLA's GPU autotuning results beside (the module docstring; the environment
    variables named there override). Returns the directory; None when ``JAX_ENABLE_COMPILATION_CACHE=false`` turns
    the cache off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
        jax.config.update("jax_persistent_cache_enable_xla_caches", AUTOTUNE_CACHE)
    if jax.config.jax_compilation_cache_dir is None:  # set from JAX_COMPILATION_CACHE_DIR when that is set
        cache_home = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
        jax.config.update("jax_compilation_cache_dir", str(cache_home / "tether" / "jax"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
    return pathlib.Path(jax.config.jax_compilation_cache_dir)
