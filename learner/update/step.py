"""One learner update per rollout batch, as ONE jitted call with the train state donated.

Inside the call:

1. The proximal (old-policy) logprobs are recomputed once for the whole batch with the current parameters, and the
   reference logprobs with the frozen reference parameters when ``kl_coef > 0`` (with LoRA: the base with the
   adapters off, ``reference_graphdef`` over the frozen base); both run one micro-batch of rows at
   a time, under the same shardings as the training forward. An on-policy update (one epoch of one mini-batch: a
   single optimizer update) skips the proximal pass: its training forward runs at those same parameters, so its
   logprobs without gradient are the proximal ones (`proximal_from_training_pass`; verl's ``on_policy``).
2. ``lax.scan`` over epochs (``ppo_epochs``), each reshuffling the rows with ``jax.random.permutation``, and within an
   epoch ``lax.scan`` over mini-batches: one optimizer update each.
3. Within a mini-batch, ``lax.scan`` over micro-batches accumulates the gradient of ``corrections.compute``'s loss
   numerator in buffers sharded like the parameters, and sums its denominator; the mini-batch gradient is the sum
   divided once by the summed denominator, so the loss is a global token mean (or whatever the reduction's global
   form is), never a mean of per-micro-batch means. Under jit the arrays are global, so with several data-parallel
   shards the denominator is global too. Batch normalisation of decoupled weights divides by the whole rollout
   batch's mean weight (`whole_batch_weight_scale`).

A scan of one step (one epoch, one mini-batch, one micro-batch) runs as a plain call: the same math in a shorter
program to trace and compile.

Rows are split into mini- and micro-batches by stride (part ``i`` holds rows ``i, i + n, i + 2n, ...``), so every
part keeps the batch's ``("data", "fsdp")`` sharding and no rows move between devices except in the shuffle.
Metrics are device arrays of shape ``[ppo_epochs * num_minibatches]`` (one entry per optimizer update); the
corrections' metrics are those of the whole mini-batch (`corrections.metrics_from_row_stats` over the row statistics
of all its micro-batches), so they do not depend on the micro-batch count, and ``actor/pg_loss`` is the global loss.

Every logprob pass (proximal, reference, and the training forward) is of the same distribution: the server's
sampling transform replayed from the batch's per-row ``sampling`` parameters when it has them (PROCESSED logprobs),
else ``log_softmax(logits / UpdateConfig.temperature)``. Setting both is an error.

With ``UpdateConfig.scored_window = W`` every logprob pass scores only ``W`` tokens per row, from the row's first
trained token (the first nonzero of ``loss_mask``; column 0 for a fully masked row): the output projection and
log-softmax run on ``[B, W]`` positions instead of ``[B, T]`` (see `learner.logprobs.chunked`). The loss is unchanged as
long
as every trained token lies within ``W`` of its row's first one (`learner.rl.batch_assembly.check_scored_window` checks
it
where batches are built); the logprobs returned (the proximal ones) are then 0 outside that window, so in
particular at prompt tokens.

LoRA (`learner.model.lora`): ``state.params`` holds the adapters only and the frozen base comes as the ``frozen``
argument (not donated); every pass runs ``nnx.merge(graphdef, params, frozen)``, the gradient is taken with respect
to ``params`` alone, so gradients, accumulators and optimizer state are the adapters' size. With several adapters
stacked (``model.lora.adapters``) every pass runs each row through its adapter (``TrainBatch.adapter``,
`learner.model.lora.select_adapters`) and each adapter's loss is its own reduction over its own rows
(`learner.update.adapter_loss`): per adapter a numerator and a denominator are summed over micro-batches, and entry k of
the gradient is divided by adapter k's denominator. ``actor/pg_loss`` is then the sum of the adapters' losses, and
``actor/pg_loss_adapter{k}`` each one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import corrections
from learner.logprobs.chunked import token_logprobs
from learner.model.lora import select_adapters, stacked_adapter_count
from learner.model.precision import with_matmul_precision
from learner.model.sharding import BATCH_AXES, batch_sharding
from learner.model.transformer import Transformer
from learner.update.adapter_loss import (
    adapter_loss_terms,
    adapter_norms,
    check_adapter_indices,
    check_corrections,
    scale_by_adapter,
)
from learner.update.batch import TrainBatch
from learner.update.optimizer import skipped_updates
from learner.update.train_state import TrainState

ModelGraph = nnx.GraphDef[Transformer]
"""The model's structure: `nnx.split`'s first part (the rest, its parameters, is a `Params`)."""
Params = nnx.State[Any, Any]
"""Model parameters (or gradients, or a LoRA model's frozen base) as an `nnx.State`."""
Rows = tuple[TrainBatch, jax.Array | None, jax.Array | None]
"""``(batch, proximal_logprobs, ref_logprobs)`` of some rows; the logprobs may be None."""
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """How one rollout batch is turned into optimizer updates; validated when built.

    Example:
        >>> UpdateConfig(num_minibatches=2, num_microbatches=4).row_multiple(data_parallel=2)
        16
    """

    corrections: corrections.CorrectionConfig = corrections.CorrectionConfig()  # objective, weights, masks, KL.
    num_minibatches: int = 1  # optimizer updates per epoch; the batch is split into this many mini-batches.
    num_microbatches: int = 1  # gradient-accumulation steps per mini-batch (memory, not math; but bypass-mode
    # batch normalisation of the weights is per micro-batch).
    ppo_epochs: int = 1  # passes over the batch, reshuffled each time.
    shuffle: bool = True  # permute rows before splitting them into mini-batches, every epoch.
    temperature: float = 1.0  # logprobs' temperature when the batch has no sampling params (else must be 1).
    logprob_chunk_size: int = 512  # tokens per chunk of the output projection (see learner.logprobs.chunked).
    logprob_remat: bool | None = None  # recompute each chunk's logits in the backward pass; None: only when the
    # sequence spans several chunks (one chunk gains no memory from it; see learner.logprobs.chunked).
    rows_per_chunk: int | None = None  # rows per chunk of the corrections' per-sequence pass (None: its default).
    scored_window: int | None = None  # score only this many tokens per row, from its first loss_mask token (static;
    # every trained token must lie in it); None: every token. See learner.logprobs.chunked.
    norm_length: int | None = None  # the length seq-mean-token-sum-norm divides by (times the rows); None: the
    # batch's T. Set it when batches come in several lengths (learner.update.bucketing), so the loss does not change.
    fuse_proximal: bool = True  # an on-policy update takes its proximal logprobs from its training pass
    # (proximal_from_training_pass); False: a proximal pass of their own even then (the same numbers, one forward more).

    def __post_init__(self) -> None:
        if not isinstance(self.corrections, corrections.CorrectionConfig):
            raise ValueError("UpdateConfig.corrections must be a corrections.CorrectionConfig.")
        for name in ("num_minibatches", "num_microbatches", "ppo_epochs", "logprob_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"UpdateConfig.{name}={value!r} must be an int >= 1.")
        if not isinstance(self.fuse_proximal, bool):
            raise ValueError(f"UpdateConfig.fuse_proximal={self.fuse_proximal!r} must be true or false.")
        if self.logprob_remat is not None and not isinstance(self.logprob_remat, bool):
            raise ValueError(f"UpdateConfig.logprob_remat={self.logprob_remat!r} must be true, false or None "
                             "(None: only with several chunks).")
        if self.scored_window is not None and (isinstance(self.scored_window, bool)
                                               or not isinstance(self.scored_window, int) or self.scored_window < 1):
            raise ValueError(f"UpdateConfig.scored_window={self.scored_window!r} must be an int >= 1 or None "
                             "(None: every token).")
        if self.norm_length is not None and (isinstance(self.norm_length, bool) or not isinstance(self.norm_length, int)
                                             or self.norm_length < 1):
            raise ValueError(f"UpdateConfig.norm_length={self.norm_length!r} must be an int >= 1 or None.")
        if self.rows_per_chunk is not None and (not isinstance(self.rows_per_chunk, int) or self.rows_per_chunk < 0):
            raise ValueError(f"UpdateConfig.rows_per_chunk={self.rows_per_chunk!r} must be an int >= 0 or None.")
        if not self.temperature > 0:
            raise ValueError(f"UpdateConfig.temperature={self.temperature!r} must be > 0.")

    def row_multiple(self, data_parallel: int) -> int:
        """Rows B must be a multiple of this: every micro-batch splits evenly over the data-parallel shards."""
        return self.num_minibatches * self.num_microbatches * data_parallel


def _split_rows(x: jax.Array, parts: int) -> jax.Array:
    """``[B, ...] -> [parts, B / parts, ...]``, part ``i`` holding rows ``i, i + parts, ...``."""
    return jnp.swapaxes(x.reshape(x.shape[0] // parts, parts, *x.shape[1:]), 0, 1)


def _merge_rows(x: jax.Array) -> jax.Array:
    """Inverse of `_split_rows`."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _scan(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any) -> tuple[Any, Any]:
    """`jax.lax.scan` of ``f`` over the leading axis of ``xs``; one step is a plain call (a shorter program to
    trace, lower and compile than a loop of one iteration)."""
    if jax.tree.leaves(xs)[0].shape[0] != 1:
        return jax.lax.scan(f, init, xs)
    carry, ys = f(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], ys)


_Tree = TypeVar("_Tree")


def _constrain_rows(tree: _Tree, mesh: Mesh | None, leading: int) -> _Tree:
    """Pins the row axis (after ``leading`` split axes) of every leaf to the batch axes of ``mesh``."""
    if mesh is None:
        return tree
    constrained: _Tree = jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, P(*(None,) * leading, BATCH_AXES)))
    return constrained


def _check_sampling(batch: TrainBatch, config: UpdateConfig) -> None:
    """One source of temperature: the batch's per-row sampling params, or ``config.temperature``, never both."""
    if batch.sampling is not None and config.temperature != 1.0:
        raise ValueError(f"UpdateConfig.temperature={config.temperature} with a batch that has sampling params: "
                         "each row's own temperature is replayed, so leave UpdateConfig.temperature at 1.0.")


def merge_model(graphdef: ModelGraph, params: Params, frozen: Params | None = None) -> Transformer:
    """The model of ``params`` and, with LoRA, the ``frozen`` base (`learner.model.lora`)."""
    model: Transformer = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)
    return model


def _policy_logprobs(graphdef: ModelGraph, params: Params, batch: TrainBatch, config: UpdateConfig,
                     return_entropy: bool = False, frozen: Params | None = None) -> Any:
    """`learner.logprobs.token_logprobs` of ``batch``'s rows under ``params`` (and the ``frozen`` base): their
    sampling params replayed, or at ``config.temperature`` when the batch has none; over ``config.scored_window``
    tokens from each row's first ``loss_mask`` token when set."""
    window_start = None if config.scored_window is None else first_scored_token(batch.loss_mask)
    model = merge_model(graphdef, params, frozen)
    with select_adapters(model, row_adapters(batch)):
        return token_logprobs(model, batch.tokens, batch.positions, batch.attention_mask,
                              temperature=config.temperature, chunk_size=config.logprob_chunk_size,
                              remat=config.logprob_remat, return_entropy=return_entropy, sampling=batch.sampling,
                              window_start=window_start, window_size=config.scored_window)


def row_adapters(batch: TrainBatch) -> jax.Array:
    """``[B]`` int32: ``batch.adapter``, or adapter 0 for every row when the batch names none."""
    return jnp.zeros(batch.tokens.shape[0], jnp.int32) if batch.adapter is None else batch.adapter


def first_scored_token(loss_mask: jax.Array) -> jax.Array:
    """``[B]`` int32: each row's first column where ``loss_mask`` is nonzero (0 for a fully masked row).

    Example:
        >>> first_scored_token(jnp.array([[0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])).tolist()
        [2, 0, 0]
    """
    return jnp.argmax(loss_mask != 0, axis=1).astype(jnp.int32)


def recompute_logprobs(graphdef: ModelGraph, params: Params, batch: TrainBatch, config: UpdateConfig,
                       mesh: Mesh | None = None, frozen: Params | None = None) -> jax.Array:
    """``[B, T]`` logprobs of the batch's tokens under ``params``, one micro-batch of rows at a time, no gradient
    (only in each row's scored window when ``config.scored_window`` is set: 0 elsewhere).

    Example:
        >>> from learner.model.transformer import Transformer, model_config
        >>> graphdef, params = nnx.split(Transformer(model_config("tiny"), rngs=nnx.Rngs(0)))
        >>> tokens = jnp.ones((2, 4), jnp.int32)
        >>> batch = TrainBatch(tokens, jnp.broadcast_to(jnp.arange(4), (2, 4)), tokens > 0, *(tokens,) * 4)
        >>> recompute_logprobs(graphdef, params, batch, UpdateConfig(num_microbatches=2)).shape
        (2, 4)
    """
    _check_sampling(batch, config)
    parts = config.num_minibatches * config.num_microbatches
    # None leaves: unread here (a TrainBatch holds arrays, and None where a pytree leaf is absent).
    rows = dataclasses.replace(batch, advantages=None, rollout_logprobs=None, policy_version=None)  # type: ignore[arg-type]
    chunks = _constrain_rows(jax.tree.map(lambda x: _split_rows(x, parts), rows), mesh, 1)
    logprobs = _merge_rows(jax.lax.map(lambda chunk: _policy_logprobs(graphdef, params, chunk, config,
                                                                      frozen=frozen), chunks))
    return jax.lax.stop_gradient(_constrain_rows(logprobs, mesh, 0))


def proximal_from_training_pass(config: UpdateConfig) -> bool:
    """Whether the update takes its proximal logprobs from its training forward instead of a pass of their own.

    So it does in decoupled mode when the update is one epoch of one mini-batch (verl's ``on_policy``): the single
    optimizer update's forward runs at the parameters the proximal pass would use, so ``stop_gradient`` of its
    logprobs are the proximal logprobs (the policy ratio is 1, its gradient the policy gradient), and a forward
    pass over the batch is saved. Batch normalisation of the weights over several micro-batches divides by the
    whole batch's mean weight, which needs every row's proximal logprobs before the first micro-batch: it keeps the
    separate pass. ``UpdateConfig.fuse_proximal = False`` keeps it always (for studies of what the fusion saves).

    Example:
        >>> decoupled = corrections.preset("decoupled_token_is")
        >>> proximal_from_training_pass(UpdateConfig(corrections=decoupled))
        True
        >>> proximal_from_training_pass(UpdateConfig(corrections=decoupled, num_minibatches=2))
        False
    """
    corrections_config = config.corrections
    if (not config.fuse_proximal or corrections_config.mode != "decoupled" or config.ppo_epochs != 1
            or config.num_minibatches != 1):
        return False
    importance = corrections_config.importance
    return importance is None or not importance.batch_normalize or config.num_microbatches == 1


def _loss_terms(params: Params, graphdef: ModelGraph, rows: Rows, policy_version: jax.Array, key: jax.Array,
                config: UpdateConfig, weight_scale: jax.Array | None = None, frozen: Params | None = None
                ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, dict[str, Any], jax.Array | None]]:
    """Loss numerator of one micro-batch; aux: the numerators and denominators of each adapter (``[N]``, N = 1
    without stacked adapters: the numerator and denominator), the corrections' row statistics and, when ``rows``
    has no proximal logprobs in decoupled mode (`proximal_from_training_pass`), the training pass's logprobs
    without gradient, which then serve as the proximal ones (else None)."""
    batch, proximal, ref = rows
    need_entropy = config.corrections.entropy_coef > 0
    out = _policy_logprobs(graphdef, params, batch, config, return_entropy=need_entropy, frozen=frozen)
    logprobs, entropy = out if need_entropy else (out, None)
    from_training_pass = proximal is None and config.corrections.mode == "decoupled"
    if from_training_pass:
        proximal = jax.lax.stop_gradient(logprobs)
    corrected = corrections.compute(
        logprobs, batch.advantages, batch.loss_mask, config.corrections, proximal_logprobs=proximal,
        rollout_logprobs=batch.rollout_logprobs, ref_logprobs=ref, entropy=entropy,
        policy_lag=policy_version - batch.policy_version, key=key, weight_scale=weight_scale,
        rows_per_chunk=config.rows_per_chunk, max_len=config.norm_length)
    count = stacked_adapter_count(params)
    if count == 1:
        numerators, denominators = corrected.loss_numerator[None], corrected.loss_denominator[None]
    else:
        numerators, denominators = adapter_loss_terms(corrected, row_adapters(batch), count, config.corrections,
                                                      config.norm_length)
    return jnp.sum(numerators), (numerators, denominators, corrected.row_stats,
                                 proximal if from_training_pass else None)


class MinibatchGradients(NamedTuple):
    """What `minibatch_gradients` returns for one mini-batch."""

    grads: Params  # gradient of `loss`, in the parameters' dtypes; NaN everywhere when the loss is not finite
    grad_norm: jax.Array  # its global norm, NaN with it; [N], each adapter's, with N stacked adapters
    loss: jax.Array  # the global loss: sum(numerators) / max(sum(denominators), 1); the adapters' losses summed
    denominator: jax.Array  # the summed denominator (of every adapter)
    metrics: Metrics  # the corrections' metrics of the whole mini-batch (every micro-batch's row statistics together)
    proximal: jax.Array | None  # [rows, T] the training pass's logprobs used as the proximal ones, or None
    adapter_losses: jax.Array  # [N] each adapter's loss (learner.update.adapter_loss); [1] without stacked adapters


def minibatch_gradients(params: Params, rows: Rows, policy_version: jax.Array, key: jax.Array, *,
                        graphdef: ModelGraph, config: UpdateConfig, mesh: Mesh | None = None,
                        param_shardings: Any = None, weight_scale: jax.Array | None = None,
                        frozen: Params | None = None) -> MinibatchGradients:
    """Gradient and loss of one mini-batch, accumulated over ``config.num_microbatches`` micro-batches.

    The gradient is the float32 sum over micro-batches times one scalar (``1 / denominator``, or NaN when the loss
    is not finite, so that the optimizer's guard skips it); its global norm is that of the sum times the scalar, so
    the scaled gradient is never written out for the norm alone (the multiply fuses into the optimizer's update).
    With N stacked adapters the scalar is one per adapter (`learner.update.adapter_loss`), entry k of the sum times
    ``1 / denominator[k]``.

    Args:
        params: model parameters (Params).
        rows: ``(batch, proximal_logprobs, ref_logprobs)`` of the mini-batch; the logprobs may be None (proximal
            None in decoupled mode: the training pass's own, see `proximal_from_training_pass`).
        policy_version: int32 scalar, the learner's version (staleness metrics).
        key: PRNG key for the objective (clip-cov).
        graphdef: the model's graph.
        config: the update config.
        mesh: if given, micro-batch rows are pinned to its batch axes.
        param_shardings: if given, the gradient accumulator is pinned to these shardings.
        weight_scale: batch normalisation's divisor for every micro-batch (see `whole_batch_weight_scale`); None:
            each micro-batch's own mean weight.
        frozen: the frozen base of a LoRA model (not differentiated), else None.
    """
    n = config.num_microbatches
    micro_rows = _constrain_rows(jax.tree.map(lambda x: _split_rows(x, n), rows), mesh, 1)

    def constrain_like_params(tree: Params) -> Params:
        return tree if param_shardings is None else jax.lax.with_sharding_constraint(tree, param_shardings)

    grad_fn = jax.value_and_grad(_loss_terms, has_aux=True)

    def accumulate(carry: tuple[Params, jax.Array, jax.Array], xs: tuple[Rows, jax.Array]
                   ) -> tuple[tuple[Params, jax.Array, jax.Array], tuple[dict[str, Any], jax.Array | None]]:
        grads_sum, numerator_sum, denominator_sum = carry
        micro, micro_key = xs
        (_, (numerators, denominators, row_stats, proximal)), grads = grad_fn(
            params, graphdef, micro, policy_version, micro_key, config, weight_scale, frozen)
        grads_sum = constrain_like_params(jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grads_sum, grads))
        return (grads_sum, numerator_sum + numerators, denominator_sum + denominators), (row_stats, proximal)

    # float32 accumulators whatever the parameter dtype: summing bfloat16 gradients in bfloat16 loses their low bits.
    zeros = constrain_like_params(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    count = stacked_adapter_count(params)
    init = (zeros, jnp.zeros((count,), jnp.float32), jnp.zeros((count,), jnp.float32))
    (grads_sum, numerators, denominators), (row_stats, proximal) = _scan(
        accumulate, init, (micro_rows, jax.random.split(key, n)))
    scales = 1.0 / jnp.maximum(denominators, 1.0)
    adapter_losses = numerators * scales
    loss = jnp.sum(adapter_losses)
    grad_scales = jnp.where(jnp.isfinite(loss), scales, jnp.nan)
    if count == 1:  # one scalar: no extra pass over the gradients
        grads = jax.tree.map(lambda g, p: (g * grad_scales[0]).astype(p.dtype), grads_sum, params)
        grad_norm = optax.tree.norm(grads_sum) * grad_scales[0]
    else:
        scaled = scale_by_adapter(grads_sum, grad_scales)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), scaled, params)
        grad_norm = adapter_norms(scaled)
    row_stats = jax.tree.map(lambda x: x.reshape(-1), row_stats)  # [micro-batches, rows] -> [rows]
    if proximal is not None:
        proximal = _constrain_rows(_merge_rows(proximal), mesh, 0)
    return MinibatchGradients(grads, grad_norm, loss, jnp.sum(denominators),
                              corrections.metrics_from_row_stats(row_stats, config.corrections), proximal,
                              adapter_losses)


def minibatch_update(state: TrainState, rows: Rows, key: jax.Array, *, graphdef: ModelGraph,
                     optimizer: optax.GradientTransformation, config: UpdateConfig, mesh: Mesh | None = None,
                     param_shardings: Any = None, weight_scale: jax.Array | None = None,
                     frozen: Params | None = None) -> tuple[TrainState, Metrics, jax.Array | None]:
    """One optimizer update on one mini-batch (``rows`` as in `minibatch_gradients`); returns state, metrics and
    the proximal logprobs the training pass provided (`MinibatchGradients.proximal`, else None).

    A non-finite loss makes the gradient non-finite, so the optimizer's finiteness guard skips it. The gradients'
    global norm is computed once, logged, and handed to the optimizer as its ``global_norm`` extra argument (the
    clip and the guard of `learner.update.optimizer` reuse it; optimizers without extra arguments ignore it). With N
    stacked
    adapters it hands on each adapter's norm (``[N]``): `learner.update.optimizer` clips each adapter by its own.
    """
    out = minibatch_gradients(state.params, rows, state.policy_version, key, graphdef=graphdef, config=config,
                              mesh=mesh, param_shardings=param_shardings, weight_scale=weight_scale,
                              frozen=frozen)
    updates, opt_state = optax.with_extra_args_support(optimizer).update(out.grads, state.opt_state, state.params,
                                                                         global_norm=out.grad_norm)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(out.metrics)
    metrics.update({
        "actor/pg_loss": out.loss,
        "actor/loss_denominator": out.denominator,
        "actor/grad_norm": out.grad_norm if out.grad_norm.ndim == 0 else optax.tree.norm(out.grad_norm),
        "actor/skipped_updates": skipped_updates(opt_state),
    })
    if out.adapter_losses.shape[0] > 1:
        metrics.update({f"actor/pg_loss_adapter{k}": loss for k, loss in enumerate(out.adapter_losses)})
        metrics.update({f"actor/grad_norm_adapter{k}": norm for k, norm in enumerate(out.grad_norm)})
    return dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1), metrics, out.proximal


def whole_batch_weight_scale(batch: TrainBatch, proximal: jax.Array | None, config: UpdateConfig) -> jax.Array | None:
    """Batch normalisation's divisor over the whole rollout batch (verl's: the weights' mean over every row of the
    training step), or None where each micro-batch must use its own.

    Decoupled weights depend only on the proximal and rollout logprobs, so one corrections pass over the batch
    gives the divisor every micro-batch of every epoch then shares, and the update does not depend on the
    micro-batch count. Bypass weights depend on the current policy: None (each micro-batch's own mean).
    """
    corrections_config = config.corrections
    importance = corrections_config.importance
    if (importance is None or not importance.batch_normalize or corrections_config.mode != "decoupled"
            or proximal is None):
        return None
    weights_only = corrections_config.replace(kl_coef=0.0, entropy_coef=0.0)  # needs no ref logprobs or entropy
    return corrections.compute(proximal, batch.advantages, batch.loss_mask, weights_only, proximal_logprobs=proximal,
                               rollout_logprobs=batch.rollout_logprobs,
                               rows_per_chunk=config.rows_per_chunk).weight_scale


def update_step(state: TrainState, batch: TrainBatch, ref_params: Params | None = None,
                frozen: Params | None = None, *, graphdef: ModelGraph, optimizer: optax.GradientTransformation,
                config: UpdateConfig, mesh: Mesh | None = None, param_shardings: Any = None,
                reference_graphdef: ModelGraph | None = None) -> tuple[TrainState, Metrics, jax.Array | None]:
    """The whole update for one rollout batch (un-jitted; see `make_update_fn`).

    Rows ``B`` must be a multiple of ``config.num_minibatches * config.num_microbatches`` (pad with fully masked
    rows: `learner.update.bucketing`). ``ref_params`` is required when ``config.corrections.kl_coef > 0``, unless
    ``reference_graphdef`` is given: then the reference is that graph over ``frozen`` (LoRA: the base with the
    adapters off, `learner.model.lora.base_config`). ``frozen``: the frozen base of a LoRA model, else None.

    Returns:
        The new state (``step`` advanced by one per optimizer update, ``policy_version`` by one, ``rng`` split),
        metrics of shape ``[ppo_epochs * num_minibatches]``, and the proximal logprobs ``[B, T]`` it used (the
        pre-update policy's, for the caller's log: recomputed, or the training pass's own when
        `proximal_from_training_pass`; 0 outside each row's scored window when ``config.scored_window`` is set;
        None in bypass mode, which has none).
    """
    parts = config.num_minibatches * config.num_microbatches
    if batch.tokens.shape[0] % parts:
        raise ValueError(f"batch rows {batch.tokens.shape[0]} are not a multiple of num_minibatches * "
                         f"num_microbatches = {parts}; pad the batch (learner.update.bucketing.pad_batch).")
    if config.corrections.kl_coef > 0 and ref_params is None and reference_graphdef is None:
        raise ValueError("ref_params are required when corrections.kl_coef > 0.")
    _check_sampling(batch, config)
    check_corrections(config.corrections, stacked_adapter_count(state.params))
    batch = _constrain_rows(batch, mesh, 0)
    from_training_pass = proximal_from_training_pass(config)
    proximal = (recompute_logprobs(graphdef, state.params, batch, config, mesh, frozen)
                if config.corrections.mode == "decoupled" and not from_training_pass else None)
    ref = None
    if config.corrections.kl_coef > 0:
        # ref_params were checked above; the reference graph runs over the frozen base (LoRA).
        ref = (recompute_logprobs(graphdef, cast(Params, ref_params), batch, config, mesh) if reference_graphdef is None
               else recompute_logprobs(reference_graphdef, cast(Params, frozen), batch, config, mesh))
    rng, epochs_key = jax.random.split(jax.random.wrap_key_data(state.rng))
    update = functools.partial(minibatch_update, graphdef=graphdef, optimizer=optimizer, config=config, mesh=mesh,
                               param_shardings=param_shardings, frozen=frozen,
                               weight_scale=None if from_training_pass
                               else whole_batch_weight_scale(batch, proximal, config))

    def one_update(state: TrainState, xs: tuple[Rows, jax.Array]
                   ) -> tuple[TrainState, tuple[Metrics, jax.Array | None]]:
        state, metrics, used = update(state, *xs)
        return state, (metrics, used)

    def epoch(state: TrainState, epoch_key: jax.Array) -> tuple[TrainState, tuple[Metrics, jax.Array | None]]:
        shuffle_key, minibatch_key = jax.random.split(epoch_key)
        rows = (batch, proximal, ref)
        order = jax.random.permutation(shuffle_key, batch.tokens.shape[0]) if config.shuffle else None
        if order is not None:
            rows = jax.tree.map(lambda x: x[order], rows)
        minibatches = _constrain_rows(jax.tree.map(lambda x: _split_rows(x, config.num_minibatches), rows), mesh, 1)
        keys = jax.random.split(minibatch_key, config.num_minibatches)
        state, (metrics, used) = _scan(one_update, state, (minibatches, keys))
        if used is not None:  # the training pass's proximal logprobs, in the batch's row order
            used = _merge_rows(used)
            used = used if order is None else used[jnp.argsort(order)]
        return state, (metrics, used)

    state, (metrics, used) = _scan(epoch, state, jax.random.split(epochs_key, config.ppo_epochs))
    metrics = jax.tree.map(lambda m: m.reshape(-1), metrics)
    if used is not None:  # one epoch
        proximal = _constrain_rows(used[0], mesh, 0)
    new_state = dataclasses.replace(state, policy_version=state.policy_version + 1, rng=jax.random.key_data(rng))
    return new_state, metrics, proximal


class UpdateFn(Protocol):
    """What `make_update_fn` returns: the jitted update, and its ``trace`` and ``lower`` (to inspect or compile it
    ahead, phase by phase)."""

    def __call__(self, state: TrainState, batch: TrainBatch, ref_params: Params | None = None,
                 frozen: Params | None = None) -> tuple[TrainState, Metrics, jax.Array | None]: ...

    def trace(self, state: TrainState, batch: TrainBatch, ref_params: Params | None = None,
              frozen: Params | None = None) -> jax.stages.Traced: ...

    def lower(self, state: TrainState, batch: TrainBatch, ref_params: Params | None = None,
              frozen: Params | None = None) -> jax.stages.Lowered: ...


DONATIONS = {"none": (), "state": (0,), "state+batch": (0, 1)}  # make_update_fn's donate: argument positions


def make_update_fn(graphdef: ModelGraph, optimizer: optax.GradientTransformation, config: UpdateConfig,
                   mesh: Mesh, shardings: TrainState, compiler_options: dict[str, Any] | None = None, *,
                   frozen_shardings: Any = None, reference_graphdef: ModelGraph | None = None,
                   matmul_precision: str = "default", donate: str = "state") -> UpdateFn:
    """`update_step` jitted on ``mesh``: ``fn(state, batch, ref_params, frozen=None) -> (state, metrics,
    proximal_logprobs)``.

    LoRA: ``frozen_shardings`` are those of the frozen base passed as ``frozen`` (`learner.update.train_state.
    create_sharded_frozen`), and with ``kl_coef > 0`` ``reference_graphdef`` (the base's graph) makes the
    reference the base with the adapters off: ``ref_params`` is then None.

    The state is donated and keeps ``shardings`` (from `learner.update.train_state.train_state_shardings`); batch leaves
    are sharded over ``("data", "fsdp")``; ``ref_params`` (None unless ``kl_coef > 0``) like the parameters; metrics
    and the proximal logprobs come back replicated. Each new batch shape compiles a new program: bucket them
    (`learner.update.bucketing`). ``compiler_options`` are XLA options for this program (e.g.
    ``{"xla_backend_optimization_level": 0}`` trades CPU run time for a faster compile in tests).
    ``matmul_precision``: the precision of every dot of the program (`learner.model.precision`). ``donate``: the
    arguments whose buffers the program may reuse (`DONATIONS`): ``"state"`` (the default: the update runs in
    place), ``"none"`` (old and new state coexist), ``"state+batch"`` (the batch too; the caller must not read it
    after the call).
    """
    if donate not in DONATIONS:
        raise ValueError(f"make_update_fn(donate={donate!r}): must be one of {tuple(DONATIONS)}.")
    step = with_matmul_precision(functools.partial(update_step, graphdef=graphdef, optimizer=optimizer,
                                                   config=config, mesh=mesh, param_shardings=shardings.params,
                                                   reference_graphdef=reference_graphdef),
                                 matmul_precision)
    needs_ref_params = config.corrections.kl_coef > 0 and reference_graphdef is None
    ref_shardings = shardings.params if needs_ref_params else None
    jitted = jax.jit(step, in_shardings=(shardings, batch_sharding(mesh), ref_shardings, frozen_shardings),
                     out_shardings=(shardings, NamedSharding(mesh, P()), NamedSharding(mesh, P())),
                     donate_argnums=DONATIONS[donate], compiler_options=compiler_options)

    def update(state: TrainState, batch: TrainBatch, ref_params: Params | None = None, frozen: Params | None = None
               ) -> tuple[TrainState, Metrics, jax.Array | None]:
        # before jit, whose in_shardings check would fail first, naming no argument
        if needs_ref_params and ref_params is None:
            raise ValueError("ref_params are required when corrections.kl_coef > 0.")
        if (frozen is None) != (frozen_shardings is None):
            raise ValueError("frozen (the LoRA base) must be passed exactly when make_update_fn got frozen_shardings.")
        if batch.adapter is not None:  # only batches that name adapters need the count (a walk of the tree)
            check_adapter_indices(batch.adapter, stacked_adapter_count(state.params))
        result: tuple[TrainState, Metrics, jax.Array | None] = jitted(state, batch, ref_params, frozen)
        return result

    update.trace = lambda state, batch, ref_params=None, frozen=None: jitted.trace(  # type: ignore[attr-defined]
        state, batch, ref_params, frozen)
    update.lower = lambda state, batch, ref_params=None, frozen=None: jitted.lower(  # type: ignore[attr-defined]
        state, batch, ref_params, frozen)
    return update  # type: ignore[return-value]  # with its `trace` and `lower`, an UpdateFn
