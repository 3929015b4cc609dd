"""Matmul precision of the learner's and the reference server's jitted passes (``model.matmul_precision``).

XLA may run float32 matmuls with fewer bits than float32: TF32 on NVIDIA GPUs, bfloat16 passes on TPUs. The model's
golden logits then miss their 1e-4 bound and the train/rollout KL of an on-policy run rises from ~1e-8 to ~1e-5. So
float32 compute asks for ``"highest"`` (true float32) unless the config says otherwise, while bfloat16 compute keeps
the backend's fast path (``"default"``).

One mechanism: `with_matmul_precision` traces a function under `jax.default_matmul_precision`, so every dot of the
program (forward, the output head's chunks, and the gradients' transposed dots) carries the precision; wrap a
function once, before `jax.jit`.

>>> resolve_matmul_precision("auto", "float32"), resolve_matmul_precision("auto", "bfloat16")
('highest', 'default')
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

MATMUL_PRECISIONS = ("auto", "highest", "high", "default")  # model.matmul_precision; JAX's names besides "auto".


def resolve_matmul_precision(setting: str, compute_dtype: str) -> str:
    """``setting`` for a pass computing in ``compute_dtype``: "auto" is "highest" for float32, else "default"."""
    if setting not in MATMUL_PRECISIONS:
        raise ValueError(f"model.matmul_precision={setting!r}: must be one of {', '.join(MATMUL_PRECISIONS)}")
    if setting != "auto":
        return setting
    return "highest" if compute_dtype == "float32" else "default"


def with_matmul_precision(fn: Callable, precision: str) -> Callable:
    """``fn`` traced under ``jax.default_matmul_precision(precision)``; ``"default"`` leaves it as it is.

    Wrap before `jax.jit`: the precision is fixed into the dots when the function is traced.
    """
    if precision == "default":
        return fn

    @functools.wraps(fn)
    def traced_with_precision(*args, **kwargs):
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    return traced_with_precision
