"""Many reductions over the tokens of ONE sequence as one variadic XLA reduction.

A per-sequence statistic (see ``_diagnostics``) is a generator: it yields `Reductions` (named [T] arrays to sum, to
maximise, to minimise), receives their results as `Reductions` of scalars, and returns its statistics. Centred
moments yield twice (the means first). `reduce_together` runs any number of such statistics in lockstep and reduces
each round's arrays of all of them in ONE ``lax.reduce``. XLA then compiles one fused kernel per round, where one
``jnp.sum`` / ``jnp.max`` per statistic compiles one or two kernels each: on the CPU backend every kernel costs
~10-20 ms of compile time, and the corrections' diagnostics of one update ask for ~100 reductions.

Sums keep the precision of XLA's own (XLA:CPU's tree reduction): tokens are summed in windows of 32, then the
window sums, and so on. The reduced arrays are stop-gradient: statistics carry no gradient, and a reduction with a
custom computation has no transpose rule.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Generator, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

WINDOW = 32
"""Tokens summed sequentially before their sum joins the next level (XLA:CPU's tree-reduction window)."""

_EMPTY: Mapping[Any, jax.Array] = types.MappingProxyType({})


class Reductions(NamedTuple):
    """One round of a statistic: name -> array reduced over its last axis (requests), or the results."""

    # Keyed by a statistic's names (str); `reduce_together` merges rounds under (statistic index, name) keys.
    sums: Mapping[Any, jax.Array] = _EMPTY
    maxima: Mapping[Any, jax.Array] = _EMPTY
    minima: Mapping[Any, jax.Array] = _EMPTY


_KINDS = (("sums", 0.0, jax.lax.add), ("maxima", -np.inf, jax.lax.max), ("minima", np.inf, jax.lax.min))

Statistic = Generator[Reductions, Reductions, dict[str, Any]]


def _windowed_reduce(operands: list[jax.Array], inits: list[np.float32],
                     combine: Callable[[Any, Any], tuple[jax.Array, ...]]) -> tuple[jax.Array, ...]:
    """``lax.reduce`` of every operand over its last axis, ``WINDOW`` elements at a time (padding with the inits)."""
    while operands[0].shape[-1] > WINDOW:
        pad = -operands[0].shape[-1] % WINDOW
        operands = [jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=init) if pad else x
                    for x, init in zip(operands, inits)]
        operands = [x.reshape(*x.shape[:-1], -1, WINDOW) for x in operands]
        operands = list(jax.lax.reduce(operands, inits, combine, (operands[0].ndim - 1,)))
    return tuple(jax.lax.reduce(operands, inits, combine, (operands[0].ndim - 1,)))


def reduce_tokens(requests: Reductions) -> Reductions:
    """Every array of ``requests`` (all of one shape) reduced over its last axis, in one variadic reduction.

    >>> out = reduce_tokens(Reductions(sums={"a": jnp.array([1.0, 2.0])}, maxima={"a": jnp.array([1.0, 2.0])}))
    >>> float(out.sums["a"]), float(out.maxima["a"]), dict(out.minima)
    (3.0, 2.0, {})
    """
    names: list[tuple[str, Any]] = []
    operands: list[jax.Array] = []
    inits: list[np.float32] = []
    ops: list[Callable[[jax.Array, jax.Array], jax.Array]] = []
    for kind, init, op in _KINDS:
        for name, array in getattr(requests, kind).items():
            names.append((kind, name))
            operands.append(jax.lax.stop_gradient(jnp.asarray(array, jnp.float32)))
            inits.append(np.float32(init))
            ops.append(op)
    if not operands:
        return Reductions()
    shapes = {x.shape for x in operands}
    if len(shapes) != 1:
        raise ValueError(f"reduce_tokens: every array must have one shape, got {sorted(shapes)}")

    def combine(left: tuple[jax.Array, ...], right: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return tuple(op(a, b) for op, a, b in zip(ops, left, right))

    results: dict[str, dict[Any, jax.Array]] = {kind: {} for kind, _, _ in _KINDS}
    for (kind, name), value in zip(names, _windowed_reduce(operands, inits, combine)):
        results[kind][name] = value
    return Reductions(**results)


def reduce_together(statistics: Any) -> Any:
    """Runs every statistic (a generator, see the module docstring) in a pytree in lockstep, one variadic reduction
    per round for all of them; returns the pytree with each generator replaced by what it returned (other leaves
    unchanged).

    >>> def total(x):
    ...     reduced = yield Reductions(sums={"x": x})
    ...     return reduced.sums["x"]
    >>> {k: float(v) for k, v in reduce_together({"a": total(jnp.ones(3)), "b": total(jnp.arange(3.0))}).items()}
    {'a': 3.0, 'b': 3.0}
    """
    leaves, treedef = jax.tree.flatten(statistics, is_leaf=inspect.isgenerator)
    # The first send is None (it starts the generator), each later one the reductions the statistic asked for.
    pending = cast(dict[int, Generator[Reductions, Reductions | None, Any]],
                   {i: leaf for i, leaf in enumerate(leaves) if inspect.isgenerator(leaf)})
    replies: dict[int, Reductions | None] = dict.fromkeys(pending)
    while pending:
        requests: dict[int, Reductions] = {}
        for i, statistic in list(pending.items()):
            try:
                requests[i] = statistic.send(replies[i])
            except StopIteration as finished:
                leaves[i] = finished.value
                del pending[i]
        if requests:
            merged = reduce_tokens(Reductions(*({(i, name): array for i, request in requests.items()
                                                 for name, array in getattr(request, kind).items()}
                                                for kind, _, _ in _KINDS)))
            replies = {i: Reductions(*({name: value for (j, name), value in getattr(merged, kind).items() if j == i}
                                       for kind, _, _ in _KINDS)) for i in requests}
    return jax.tree.unflatten(treedef, leaves)


def vmap_statistic(statistic: Callable[..., Statistic]) -> Callable[..., dict[str, jax.Array]]:
    """``statistic`` (a generator function of one sequence's arrays) run over the rows of [B, T] arrays."""
    return jax.vmap(lambda *arrays: reduce_together(statistic(*arrays)))
