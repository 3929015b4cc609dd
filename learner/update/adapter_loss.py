"""Each adapter's own loss in a batch that mixes several LoRA adapters (`learner.model.lora`, ``model.lora.adapters``).

A mixed batch trains N adapters at once, and each adapter's loss is its own reduction over its own rows: with
``token-mean``, adapter k's loss is the token mean over the rows whose ``TrainBatch.adapter`` is k, so adapter k
trains as it would on a batch of its rows alone, whatever the other adapters' rows and token counts. The numerator
and denominator of every adapter are segment sums of the per-row terms (`corrections.loss_terms_from_rows` of the
adapter's rows), summed over micro-batches before one division per adapter, as the single-adapter update does with
its one pair. Each reduction keeps its meaning per adapter: ``seq-mean-*`` count adapter k's rows, Dr. GRPO's
``seq-mean-token-sum-norm`` divides by adapter k's rows times the length.

The update differentiates the sum of the numerators: rows of adapter j reach only entry j of every stacked adapter
matrix (`learner.model.lora.LoRA`), so entry k of its gradient is adapter k's numerator's, and dividing entry k by
adapter
k's denominator gives each adapter the gradient of its own loss (`scale_by_adapter`). `learner.update.optimizer` then
clips
each adapter by its own gradient norm (`adapter_norms`), so that with AdamW, whose other arithmetic is per element,
adapter k's update is the one a batch of its rows alone would give. The non-finite guard stays shared: a NaN in
one adapter's loss skips the update of all.

Corrections that couple rows across the batch are refused with several adapters: batch normalisation of the
importance weights (one mean weight over every adapter's rows) and whole-batch objectives (which select tokens
across the batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import corrections


def check_corrections(config: corrections.CorrectionConfig, count: int) -> None:
    """Refuses corrections whose value for one row depends on other adapters' rows, when ``count > 1``."""
    if count == 1:
        return
    if config.importance is not None and config.importance.batch_normalize:
        raise ValueError(f"corrections importance.batch_normalize with {count} LoRA adapters (model.lora.adapters) "
                         "would normalise every adapter's weights by one mean over all adapters' rows: set "
                         "batch_normalize = false, or train one adapter")
    if config.objective.spec.whole_batch:
        raise ValueError(f"corrections objective {config.objective.name!r} selects tokens across the whole batch, "
                         f"mixing the rows of {count} LoRA adapters (model.lora.adapters): choose a per-sequence "
                         "objective, or train one adapter")


def adapter_loss_terms(corrected: corrections.Corrected, adapter: jax.Array, count: int,
                       config: corrections.CorrectionConfig, max_len: int | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """``[count]`` loss numerators (with gradient) and denominators of each adapter's rows of one batch.

    Args:
        corrected: ``corrections.compute``'s output for the batch (its per-token loss and row statistics).
        adapter: ``[B]`` int, the adapter of each row.
        count: the number of adapters N.
        config: the corrections' config (its reduction and denominator).
        max_len: the length ``seq-mean-token-sum-norm`` divides by (`corrections.compute`'s); None: the batch's.

    Returns:
        ``(numerators, denominators)``, ``[N]`` each; adapter k's loss is ``numerators[k] / max(denominators[k],
        1)``. A batch whose loss ``compute`` poisoned (a mask not 0/1 under jit) gives NaN numerators.
    """
    row_sums = jnp.sum(corrected.per_token_loss.astype(jnp.float32), axis=-1)  # [B]: 0 outside the final mask
    row_counts = corrected.row_stats["valid" if config.denominator == "original" else "kept"]
    count_rows = config.denominator == "kept"
    length = max_len or corrected.per_token_loss.shape[-1]

    def terms(member):  # member: [B] 1.0 on the adapter's rows, which are its batch
        return corrections.loss_terms_from_rows(row_sums * member, row_counts * member, config.reduction, length,
                                                count_rows, num_rows=jnp.sum(member))

    numerators, denominators = jax.vmap(terms, in_axes=1)(jax.nn.one_hot(adapter, count, dtype=jnp.float32))
    numerators = jnp.where(jnp.isnan(corrected.loss_numerator), jnp.nan, numerators)
    return numerators, jax.lax.stop_gradient(denominators)


def adapter_norms(grads) -> jax.Array:
    """``[N]``: the norm of each adapter's gradient (entry k of the leading axis of every stacked gradient)."""
    squares = [jnp.sum(jnp.square(g.astype(jnp.float32)).reshape(g.shape[0], -1), axis=1)
               for g in jax.tree.leaves(grads)]
    return jnp.sqrt(sum(squares))


def scale_by_adapter(grads, scale: jax.Array):
    """Entry k (the leading axis) of every stacked adapter gradient times ``scale[k]``, in float32."""
    return jax.tree.map(lambda g: g.astype(jnp.float32) * scale.reshape((-1,) + (1,) * (g.ndim - 1)), grads)


def check_adapter_indices(adapter, count: int) -> None:
    """Refuses a ``TrainBatch.adapter`` with an index outside ``[0, count)`` (it would train no adapter); arrays that
    span other processes are not read."""
    if adapter is None or (isinstance(adapter, jax.Array) and not adapter.is_fully_addressable):
        return
    values = np.asarray(adapter)
    if values.size and (values.min() < 0 or values.max() >= count):
        bad = values[(values < 0) | (values >= count)][0]
        raise ValueError(f"TrainBatch.adapter holds {int(bad)}, outside [0, {count}): each row's adapter is an index "
                         "into model.lora.adapters (0 without several adapters)")
