"""The one entry point: rollout, proximal and current logprobs in; weights, mask, loss and metrics out.

Order (SkyRL's is the reference), per sequence and vmapped over the batch unless marked [batch]:

1. Inputs are checked (shapes with chex; values on eager calls, see ``check_batch`` and ``config.check_values``)
   and every padded position is zeroed, so NaN or inf in padding never reaches an output or a gradient.
2. ``old`` is the proximal logprobs (decoupled) or the rollout logprobs (bypass). The behaviour log-ratio is
   ``lr = old - roll`` (decoupled) or ``sg(lp) - roll`` (bypass).
3. Outlier (veto) rules on the original mask, then token rules.
4. Importance weights over the surviving tokens (a sequence weight sums only survivors).
5. Sequence rules (k-family, geometric, product) over the surviving tokens; OPSM from valid tokens.
   A row already fully masked counts as kept.
6. [batch] Weight normalisation by the batch mean, if configured.
7. The objective's per-token loss, times the weights; plus ``kl_coef * KL(lp || ref)`` and minus
   ``entropy_coef * entropy``.
8. [batch] Reduction over the final mask, divided by the original or the kept mask's count.
9. [batch] Metrics, always on the original mask, from the per-sequence statistics (``Corrected.row_stats``;
   `metrics_from_row_stats` combines those of several micro-batches into the metrics of their union).

Step 1's zeroing and steps 2-7 run as ONE per-sequence pass on the raw inputs (no cleaned [B, T] copy is
made) that also emits each sequence's partial statistics (sums, counts, extrema, centred moments); the batch
steps combine those [B] statistics. On a single CPU device the pass walks the batch in chunks of rows that
stay in cache (``rows_per_chunk``); elsewhere it is a plain ``vmap``, which keeps a sharded batch sharded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, overload

import chex
import jax
import jax.numpy as jnp
import numpy as np

from corrections import _diagnostics, _rejection, _weights
from corrections._advantages import kl_penalty
from corrections._config import CorrectionConfig, RejectionRule
from corrections._diagnostics import PREFIX
from corrections._fused_reductions import Reductions, Statistic, reduce_together
from corrections._masked import masked_max, masked_min, safe_exp, zero_padding
from corrections._reductions import divide_loss, loss_terms_from_rows

sg = jax.lax.stop_gradient

Rows = dict[str, Any]
"""Named inputs or partial statistics of the rows (None for an input not given; statistics nest by part)."""


class Corrected(NamedTuple):
    """What ``compute`` returns (a pytree: fine to return from jit).

    >>> import numpy as np
    >>> out = compute(np.log([[0.5, 0.5]]), np.array([1.0]), np.array([[1, 0]]), proximal_logprobs=np.log([[0.5, 0.5]]))
    >>> out.mask.tolist(), float(out.loss), float(out.loss_denominator), float(out.weight_scale)
    ([[1.0, 0.0]], -1.0, 1.0, 1.0)
    """

    weights: jax.Array  # [B, T] stop-gradient behaviour weights; 0 at padding and at every rejected token
    # (1 at the other tokens when none are configured).
    mask: jax.Array  # [B, T] float32 final loss mask: the response mask AND every rejection rule.
    per_token_loss: jax.Array  # [B, T] weighted per-token loss, 0 outside the final mask.
    loss: jax.Array  # scalar: loss_numerator / max(loss_denominator, 1).
    loss_numerator: jax.Array  # scalar; sum it over micro-batches for a global reduction.
    loss_denominator: jax.Array  # scalar, no gradient; sum it over micro-batches.
    metrics: dict[str, jax.Array]  # flat dict of float32 scalars: ``rollout_corr/...`` and ``actor/...``.
    row_stats: Rows  # [B] partial statistics the metrics come from, no gradient (see `metrics_from_row_stats`).
    weight_scale: jax.Array  # scalar the weights were divided by (batch normalisation); 1 without it.


LOGPROB_TOLERANCE = 1e-3
"""How far above 0 a checked logprob may be: float32 / bfloat16 rounding of a log-softmax, never a probability > 1."""


def _require(bad: jax.Array | np.ndarray, name: str, rule: str, values: jax.Array | np.ndarray) -> None:
    """Asserts that ``bad`` [B, T] is nowhere set. An eager call names the first bad (row, column) and its value;
    under ``chex.chexify`` the check runs inside jit with the same message, less the position."""
    message = f"{name} must {rule}"
    if isinstance(bad, jax.core.Tracer):
        try:
            chex.assert_trees_all_equal(jnp.any(bad), jnp.array(False), custom_message=message)
        except RuntimeError as error:  # chex: value assertions on traced arrays need chex.chexify
            if "chexify" not in str(error):
                raise
            raise RuntimeError("CorrectionConfig.check_values=True checks traced values only inside chex.chexify: "
                             "wrap the jitted function, chex.chexify(jax.jit(f), async_check=False), or set "
                             "check_values=None (the default: eager inputs checked; under jit a mask not 0/1 or a "
                             "NaN input makes the loss NaN)") from None
    elif np.any(bad):
        row, column = np.argwhere(np.asarray(bad))[0]
        raise AssertionError(f"{message}; first bad value {values[row, column]} at (row, column) = ({row}, {column})")


def check_batch(mask: jax.Array, rollout_logprobs: jax.Array | None = None, advantages: jax.Array | None = None,
                max_logprob: float | None = LOGPROB_TOLERANCE, **named_logprobs: jax.Array | None) -> None:
    """Value checks: ``mask`` is 0/1; where it is 1, every given logprob array is finite and at most
    ``max_logprob`` (None: no bound), and ``advantages`` ([B] or [B, T]) are finite.

    Eager calls raise an ``AssertionError`` naming the argument, the first bad (row, column) and its value;
    inside jit, wrap the caller with ``chex.chexify`` (see ``compute``).

    >>> import numpy as np
    >>> check_batch(np.array([[1, 0]]), rollout_logprobs=np.array([[-1.0, np.nan]]))
    >>> check_batch(np.array([[1, 2]]))
    Traceback (most recent call last):
    ...
    AssertionError: mask must hold only 0 and 1; first bad value 2 at (row, column) = (0, 1)
    >>> check_batch(np.array([[1, 1]]), logprobs=np.array([[-1.0, 0.5]]))
    Traceback (most recent call last):
    ...
    AssertionError: logprobs must be <= 0.001 where the mask is 1; first bad value 0.5 at (row, column) = (0, 1)
    """
    logprobs = dict(named_logprobs, rollout_logprobs=rollout_logprobs)
    # Concrete arrays are checked with NumPy, so that constants closed over by a jitted function are checked at
    # trace time (jnp would stage them); traced ones need jnp under chex.chexify.
    xp = jnp if any(isinstance(a, jax.core.Tracer) for a in (mask, advantages, *logprobs.values())) else np
    mask = xp.asarray(mask)
    _require((mask != 0) & (mask != 1), "mask", "hold only 0 and 1", mask)
    valid = mask.astype(bool)
    for name, array in logprobs.items():
        if array is not None:
            array = xp.asarray(array, xp.float32)
            _require(valid & ~xp.isfinite(array), name, "be finite where the mask is 1", array)
            if max_logprob is not None:
                _require(valid & (array > max_logprob), name, f"be <= {max_logprob} where the mask is 1", array)
    if advantages is not None:
        advantages = xp.asarray(advantages, xp.float32)
        advantages = xp.broadcast_to(advantages.reshape(advantages.shape + (1,) * (mask.ndim - advantages.ndim)),
                                     mask.shape)
        _require(valid & ~xp.isfinite(advantages), "advantages", "be finite where the mask is 1", advantages)


def _check_inputs(config: CorrectionConfig, logprobs: jax.Array, mask: jax.Array, advantages: jax.Array,
                  proximal: jax.Array | None, rollout: jax.Array | None, ref: jax.Array | None,
                  entropy: jax.Array | None) -> None:
    chex.assert_rank(logprobs, 2)
    if 0 in logprobs.shape:
        raise ValueError(f"logprobs: shape {logprobs.shape} is empty; compute needs B >= 1 rows of T >= 1 tokens.")
    chex.assert_equal_shape([logprobs, mask] + [a for a in (proximal, rollout, ref, entropy) if a is not None])
    if advantages.ndim not in (1, 2) or advantages.shape != logprobs.shape[: advantages.ndim]:
        raise ValueError(f"advantages: shape {advantages.shape} must be [B] or [B, T] of logprobs {logprobs.shape}.")
    if config.needs_rollout_logprobs and rollout is None:
        why = "bypass mode" if config.mode == "bypass" else "importance weights / rejection / rollout_is"
        raise ValueError(f"rollout_logprobs is required by {why}; pass the server's logprobs or drop that setting.")
    if config.mode == "decoupled" and config.objective.spec.reads_proximal and proximal is None:
        raise ValueError(
            f"proximal_logprobs is required by objective {config.objective.name!r} in decoupled mode; pass the "
            "recomputed logprobs, or use mode='bypass' (proximal := rollout)."
        )
    if config.kl_coef > 0 and ref is None:
        raise ValueError("ref_logprobs is required when kl_coef > 0; pass the reference policy's logprobs.")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy is required when entropy_coef > 0; pass the per-token entropy.")


def _phases(config: CorrectionConfig) -> tuple[tuple[RejectionRule, ...], tuple[RejectionRule, ...]]:
    """Rejection rules in application order: outlier vetoes, token rules, then sequence rules."""
    rules = config.rejection
    vetoes = tuple(rule for rule in rules if rule.name == "outlier")
    token_rules = tuple(rule for rule in rules if not rule.sequence_level)
    sequence_rules = tuple(rule for rule in rules if rule.sequence_level and rule.name != "outlier")
    return vetoes + token_rules, sequence_rules


def _rule_labels(config: CorrectionConfig) -> list[str]:
    """Metric labels of the rejection rules, in the order ``_sequence_decisions`` returns them."""
    early, late = _phases(config)
    names = [rule.name for rule in early + late]
    return [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]


SKYRL_RULE_NAMES = {"outlier": "outlier_seq", "seq_mean_k1": "geo_sequence_mask", "seq_sum_k1": "product_sequence_mask"}
"""SkyRL's metric prefix of the rules it has; their ``_over_high_ratio`` / ``_under_low_ratio`` are emitted."""


def _standalone_rule_stats(rule: RejectionRule, log_ratio: jax.Array, valid: jax.Array) -> dict[str, Statistic]:
    """One rule on its own over the original mask (verl's per-rule metrics): rejection counts and, for the
    k-family, verl's statistic (k1 as ``-log rho``, whose bounds are ``-log high`` .. ``-log low``)."""
    if rule.name == "outlier":
        return {"rejection": _diagnostics.rejection_row_stats(
            _rejection.outlier_sequence_mask(log_ratio, valid, rule.low, rule.high), valid)}
    keep = _rejection.divergence_mask(log_ratio, valid, rule.name, rule.low, rule.high)
    aggregate, k = rule.name.rsplit("_", 1)
    token_stat = _rejection.k_statistic(log_ratio, k)
    if k == "k1":
        token_stat = -token_stat
        upper = jnp.inf if rule.low is None else -float(np.log(rule.low))
        lower = -jnp.inf if rule.high is None else -float(np.log(rule.high))
    else:
        assert rule.high is not None  # RejectionRule requires it for k2/k3
        upper, lower = rule.high, None
    seq_stat = None if aggregate == "token" else _rejection.sequence_statistic(token_stat, valid, aggregate)
    return {"rejection": _diagnostics.rejection_row_stats(keep, valid),
            "statistic": _diagnostics.rule_statistic_row_stats(token_stat, seq_stat, valid, upper, lower)}


def _over_under(rule: RejectionRule, log_ratio: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """SkyRL's over/under flags of a rule for ONE sequence: outlier over the valid tokens, the geometric and
    product masks from the surviving tokens' statistic (a row with none left has ratio 1)."""
    if rule.name == "outlier":
        rho = safe_exp(log_ratio)
        over = jnp.any(mask & (rho > (jnp.inf if rule.high is None else rule.high)))
        under = jnp.any(mask & (rho < (-jnp.inf if rule.low is None else rule.low)))
    else:
        ratio = safe_exp(_rejection.sequence_statistic(_rejection.k_statistic(log_ratio, "k1"), mask,
                                                       rule.name.rsplit("_", 1)[0]))
        over = ratio > (jnp.inf if rule.high is None else rule.high)
        under = ratio < (-jnp.inf if rule.low is None else rule.low)
    return {"over": over.astype(jnp.float32), "under": under.astype(jnp.float32)}


def _sequence_decisions(log_ratio: jax.Array, weight_log_ratio: jax.Array, mask: jax.Array, config: CorrectionConfig
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, tuple[dict[str, jax.Array], ...]]:
    """Steps 3-5 (but OPSM) for one sequence: (keep [T] bool, raw ratios [T], bounded ratios [T] on every valid
    token, applied weights [T], SkyRL over/under flags per rule)."""
    valid = mask.astype(bool)
    keep = valid
    over_under: list[dict[str, jax.Array]] = []
    early, late = _phases(config)

    def apply(rule: RejectionRule, keep: jax.Array) -> jax.Array:
        if rule.name in SKYRL_RULE_NAMES:
            over_under.append(_over_under(rule, log_ratio, valid if rule.name == "outlier" else keep))
        if rule.name == "outlier":
            rule_keep = _rejection.outlier_sequence_mask(log_ratio, valid, rule.low, rule.high)
        else:
            rule_keep = _rejection.divergence_mask(log_ratio, keep, rule.name, rule.low, rule.high)
        return keep & (rule_keep | ~jnp.any(keep))  # a row already fully masked counts as kept

    for rule in early:
        keep = apply(rule, keep)
    spec = config.importance
    if spec is None:
        raw = _weights.unbounded_ratios(log_ratio, keep)
        bounded, applied = jnp.ones_like(raw), jnp.where(keep, 1.0, 0.0)
    else:
        raw = _weights.unbounded_ratios(weight_log_ratio, keep, spec.level, spec.clamp_each_token)
        bounded = _weights.bound_weights(raw, spec.low, spec.high, spec.overflow)
        applied = jnp.where(keep, bounded, 0.0)
    for rule in late:
        keep = apply(rule, keep)
    return keep, raw, jnp.where(valid, bounded, 0.0), jnp.where(valid, applied, 0.0), tuple(over_under)


CHUNK_ELEMENTS = {"cpu": 65536}  # tokens per chunk of the per-sequence pass, by backend (0: vmap everything)


def _clean(arrays: Rows, mask: jax.Array) -> Rows:
    """Step 1's cleaning of raw inputs (one sequence or the batch): float32, 0 at every padded position (None
    stays None; per-sequence advantages are broadcast over the tokens); ``old`` defaults to ``sg(lp)``."""
    clean = {name: None if a is None else zero_padding(a, mask) for name, a in arrays.items()}
    if clean["old"] is None:
        clean["old"] = sg(clean["lp"])
    return clean


def _sequence_pass(row: Rows, config: CorrectionConfig) -> tuple[dict[str, jax.Array], Rows]:
    """Step 1's zeroing and steps 2-7 for ONE sequence: per-token outputs and the sequence's partial statistics."""
    valid = row["mask"].astype(bool)
    clean = _clean({name: row[name] for name in ("lp", "old", "roll", "adv", "ref", "entropy", "lag")}, row["mask"])
    lp, old, roll, adv = clean["lp"], clean["old"], clean["roll"], clean["adv"]
    stats: Rows = {}  # statistics (generators, see _fused_reductions), reduced together at the end
    if clean["lag"] is not None:
        stats["staleness"] = _diagnostics.staleness_row_stats(clean["lag"], valid)
    trainer = sg(lp) if config.mode == "bypass" else old
    importance = config.importance
    if roll is not None:
        log_ratio = trainer - roll
        current = importance is not None and importance.numerator == "current"
        keep, raw, bounded, weights, over_under = _sequence_decisions(
            log_ratio, sg(lp) - roll if current else log_ratio, valid, config)
        cap = importance.high if importance is not None and importance.high else 2.0
        stats["mismatch"] = _diagnostics.mismatch_row_stats(trainer, roll, valid)
        stats["weights"] = _diagnostics.weight_row_stats(
            bounded, raw, valid, cap, importance.low if importance is not None else None,
            (importance.low, importance.high) if importance is not None and importance.overflow == "mask" else None,
            applied=weights, weighted=importance is not None)
        early, late = _phases(config)
        stats["rules"] = tuple(_standalone_rule_stats(rule, log_ratio, valid) for rule in early + late)
    else:
        keep, weights = valid, jnp.where(valid, 1.0, 0.0)
        stats["mismatch"] = _diagnostics.mismatch_row_stats(trainer, None, valid)
    if config.opsm_delta is not None:
        opsm_keep = _rejection.opsm_mask(lp, old, adv, valid, config.opsm_delta)
        stats["opsm"] = _diagnostics.rejection_row_stats(opsm_keep, valid)
        keep = keep & opsm_keep
    if roll is not None:
        stats["behave"] = _diagnostics.behave_row_stats(log_ratio, keep & (weights > 0))
    if roll is not None or config.opsm_delta is not None:
        stats["rejection"] = _diagnostics.rejection_row_stats(keep, valid)
    if "loss" in row:
        loss, aux = row["loss"], row["aux"]
    else:
        loss, aux = config.objective.spec.loss(config.objective, lp=lp, old=old, roll=roll, adv=adv, mask=valid,
                                               kept=keep, key=None)
    extra: list[jax.Array] = []  # the KL and entropy terms, when configured
    kl: jax.Array | None = None
    if config.kl_coef > 0:
        ratio = safe_exp(lp - old) if config.kl_importance_weighted else None
        kl = kl_penalty(lp, clean["ref"], config.kl_estimator, importance_ratio=ratio)
        extra.append(config.kl_coef * kl)
    if clean["entropy"] is not None:
        extra.append(-config.entropy_coef * clean["entropy"])
    weights = sg(jnp.where(keep, weights, 0.0))  # a token rejected after the weights step weighs 0 too (AReaL)
    policy_loss = jnp.where(keep, loss * weights, 0.0)
    per_token = {"weights": weights, "mask": keep.astype(jnp.float32), "policy_loss": policy_loss}
    stats["loss"] = _loss_row_stats(valid, keep, aux, config.objective.spec.original_mask_metrics, kl,
                                    clean["entropy"])
    stats = reduce_together(stats)
    stats.update(stats.pop("loss"), policy_loss_sum=jnp.sum(policy_loss))  # the loss sum keeps its gradient
    if roll is not None:
        stats["over_under"] = tuple(dict(flags, count=stats["valid"]) for flags in over_under)
    if extra:
        per_token["extra_loss"] = jnp.where(keep, sum(extra[1:], extra[0]), 0.0)
        stats["extra_loss_sum"] = jnp.sum(per_token["extra_loss"])
    return per_token, stats


def _loss_row_stats(valid: jax.Array, keep: jax.Array, aux: dict[str, jax.Array], original: Mapping[str, tuple[str,
                    ...]],
                    kl: jax.Array | None, entropy: jax.Array | None) -> Statistic:
    """The pass's own statistics of ONE sequence: valid and kept tokens, the objective's per-token metrics summed
    over the kept tokens (or, for those in ``original``, their sum, max and min over the original mask), SkyRL's
    ``clip_ratio`` (``pg_clipfrac`` over the original mask), the KL and entropy sums."""
    aux = {name: jnp.broadcast_to(values, valid.shape) for name, values in aux.items()}
    sums: dict[Any, jax.Array] = {"valid": valid.astype(jnp.float32), "kept": keep.astype(jnp.float32)}
    sums.update({("aux", name): jnp.where(keep, values, 0.0) for name, values in aux.items() if name not in original})
    kept_original = [name for name in original if name in aux]
    sums.update({("original", name): jnp.where(valid, aux[name], 0.0) for name in kept_original})
    if "pg_clipfrac" in aux:
        sums["clip_ratio"] = jnp.where(valid, aux["pg_clipfrac"], 0.0)
    if kl is not None:
        sums["kl_loss"] = jnp.where(keep, kl, 0.0)
    if entropy is not None:
        sums["entropy"] = jnp.where(valid, entropy, 0.0)
    reduced = yield Reductions(sums=sums,
                               maxima={name: jnp.where(valid, aux[name], -jnp.inf) for name in kept_original},
                               minima={name: jnp.where(valid, aux[name], jnp.inf) for name in kept_original})
    count = reduced.sums["valid"]
    stats: Rows = {name: reduced.sums[name] for name in ("valid", "kept", "kl_loss", "entropy") if name in reduced.sums}
    stats["aux"] = {name: reduced.sums["aux", name] for name in aux if name not in original}
    stats["aux_original"] = {name: {"sum": reduced.sums["original", name],
                                    "max": jnp.where(count > 0, reduced.maxima[name], 0.0),
                                    "min": jnp.where(count > 0, reduced.minima[name], 0.0)} for name in kept_original}
    if "pg_clipfrac" in aux:  # SkyRL's clip_ratio: the same indicator over the original mask
        stats["aux_original"]["clip_ratio"] = {"sum": reduced.sums["clip_ratio"]}
    return stats


def _map_rows(fn: Callable[[Rows], Any], rows: Rows, rows_per_chunk: int | None) -> Any:
    if rows_per_chunk is None:
        # Chunks only under jit (eager calls would recompile the loop every time) and with one device: a loop
        # over the rows of a batch sharded over devices would gather the whole batch onto every device.
        chunked = isinstance(rows["lp"], jax.core.Tracer) and jax.device_count() == 1
        chunk_elements = CHUNK_ELEMENTS.get(jax.default_backend(), 0) if chunked else 0
        rows_per_chunk = max(1, chunk_elements // rows["lp"].shape[-1]) if chunk_elements else 0
    if rows_per_chunk <= 0:
        return jax.vmap(fn)(rows)
    return jax.lax.map(fn, rows, batch_size=rows_per_chunk)


def metrics_from_row_stats(row_stats: Rows, config: CorrectionConfig) -> dict[str, jax.Array]:
    """Step 9: the metrics (all but ``actor/pg_loss``) from ``Corrected.row_stats``.

    Row statistics of several batches concatenated along the rows give the metrics of the batches together, exactly
    as one ``compute`` call on all of them would (up to float rounding): how a learner that splits a batch into
    micro-batches reports the whole batch's metrics, maxima and moments included.

    >>> import numpy as np
    >>> from corrections import ImportanceWeights
    >>> cfg = CorrectionConfig(importance=ImportanceWeights("token", high=2.0))
    >>> lp, roll, m = np.log([[0.5, 0.5], [0.5, 0.5]]), np.log([[0.4, 0.5], [0.2, 0.5]]), np.ones((2, 2))
    >>> halves = [compute(lp[i:i + 1], np.ones(1), m[i:i + 1], cfg, proximal_logprobs=lp[i:i + 1],
    ...                   rollout_logprobs=roll[i:i + 1]).row_stats for i in (0, 1)]
    >>> both = jax.tree.map(lambda *rows: jnp.concatenate(rows), *halves)
    >>> float(metrics_from_row_stats(both, cfg)["rollout_corr/rollout_is_max"])
    2.0
    """
    metrics: dict[str, jax.Array] = {}
    kept, valid = jnp.sum(row_stats["kept"]), jnp.sum(row_stats["valid"])
    metrics.update(_diagnostics.mismatch_from_rows(row_stats["mismatch"]))
    if "weights" in row_stats:
        importance = config.importance
        metrics.update(_diagnostics.weight_from_rows(row_stats["weights"], "token" if importance is None
                                                     else importance.level))
        metrics.update(_diagnostics.behave_from_rows(row_stats["behave"]))
        early, late = _phases(config)
        rules = early + late
        for rule, label, rule_stats in zip(rules, _rule_labels(config), row_stats["rules"]):
            metrics.update(_diagnostics.rejection_from_rows(f"rollout_rs_{label}", rule_stats["rejection"]))
            if "statistic" in rule_stats:
                metrics.update(_diagnostics.rule_statistic_from_rows(
                    f"rollout_rs_{label}", rule_stats["statistic"], not rule.sequence_level,
                    rule.name.endswith("k1")))
        skyrl_rules = [(rule, label) for rule, label in zip(rules,
                                                            _rule_labels(config)) if rule.name in SKYRL_RULE_NAMES]
        for (rule, label), flags in zip(skyrl_rules, row_stats["over_under"]):
            metrics.update(_diagnostics.over_under_from_rows(SKYRL_RULE_NAMES[rule.name] + label[len(rule.name):],
                                                             flags))
    if "opsm" in row_stats:
        metrics.update(_diagnostics.rejection_from_rows("rollout_rs_opsm", row_stats["opsm"]))
        metrics[PREFIX + "opsm_clipfrac"] = _diagnostics.row_fraction_mean(row_stats["opsm"])
    if "rejection" in row_stats:
        metrics.update(_diagnostics.rejection_from_rows("rollout_rs", row_stats["rejection"]))
    for name, sums in row_stats["aux"].items():
        metrics[f"actor/{name}"] = jnp.sum(sums) / jnp.maximum(kept, 1.0)
    rows = row_stats["valid"] > 0
    wanted = dict(config.objective.spec.original_mask_metrics, clip_ratio=("mean",))
    for name, parts in row_stats["aux_original"].items():
        for stat in wanted[name]:
            key = f"actor/{name}" if name == "clip_ratio" else f"actor/{name}_{stat}"
            if stat == "mean":
                metrics[key] = jnp.sum(parts["sum"]) / jnp.maximum(valid, 1.0)
            else:
                metrics[key] = (masked_max if stat == "max" else masked_min)(parts[stat], rows)
    if "kl_loss" in row_stats:
        metrics["actor/kl_loss"] = jnp.sum(row_stats["kl_loss"]) / jnp.maximum(kept, 1.0)
    if "entropy" in row_stats:
        metrics["actor/entropy"] = jnp.sum(row_stats["entropy"]) / jnp.maximum(valid, 1.0)
    metrics[PREFIX + "valid_tokens"] = valid
    metrics[PREFIX + "kept_tokens"] = kept
    metrics[PREFIX + "all_rejected"] = ((valid > 0) & (kept == 0)).astype(jnp.float32)
    if "staleness" in row_stats:
        metrics.update(_diagnostics.staleness_from_rows(row_stats["staleness"]))
    return {name: sg(jnp.asarray(value, jnp.float32)) for name, value in metrics.items()}


@overload
def _one_row(a: jax.Array) -> jax.Array: ...
@overload
def _one_row(a: None) -> None: ...
def _one_row(a: jax.Array | None) -> jax.Array | None:
    """A [T] array as a batch of one row, [1, T]; None stays None."""
    return None if a is None else jnp.asarray(a)[None]


@overload
def _one_row_per_sequence(a: jax.Array) -> jax.Array: ...
@overload
def _one_row_per_sequence(a: None) -> None: ...
def _one_row_per_sequence(a: jax.Array | None) -> jax.Array | None:
    """A per-sequence input of one sequence (a scalar or [T]) as one row's: [1] or [1, T]; None stays None."""
    return None if a is None else jnp.reshape(jnp.asarray(a), (1, -1)[:max(jnp.ndim(a), 1)])


def compute(
    logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: CorrectionConfig = CorrectionConfig(),  # noqa: B008
    *,
    proximal_logprobs: jax.Array | None = None,
    rollout_logprobs: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
    policy_lag: jax.Array | None = None,
    key: jax.Array | None = None,
    weight_scale: jax.Array | None = None,
    rows_per_chunk: int | None = None,
    max_len: int | None = None,
) -> Corrected:
    """Applies the configured corrections and objective to a [B, T] batch, or to one [T] sequence (then
    ``advantages`` and ``policy_lag`` are a scalar or [T], and ``weights``, ``mask``, ``per_token_loss`` are [T];
    everything else is as for a batch of that one row).

    Args:
      logprobs: [B, T] current-policy logprobs of the sampled tokens (the only input with gradient).
      advantages: [B] (broadcast over tokens) or [B, T].
      mask: [B, T] response mask, 1 on generated tokens that count.
      config: a ``CorrectionConfig`` (static under jit).
      proximal_logprobs: [B, T] recomputed old-policy logprobs; required in decoupled mode by clipped objectives.
      rollout_logprobs: [B, T] logprobs the server sampled with; required by bypass, weights and rejection.
      ref_logprobs: [B, T] reference-policy logprobs, for ``kl_coef > 0``.
      entropy: [B, T] per-token entropy, for ``entropy_coef > 0`` and the entropy metric.
      policy_lag: [B] or [B, T] learner version minus token version, for the staleness metric.
      key: PRNG key, used by clip-cov's random token choice (a fixed key if None).
      weight_scale: with ``importance.batch_normalize``, the divisor to use instead of this batch's own mean
        weight: a learner that splits a batch into micro-batches passes the whole batch's ``Corrected.weight_scale``
        so that every micro-batch is normalised alike.
      rows_per_chunk: rows per chunk of the per-sequence pass; 0 vmaps the whole batch at once. Default under
        jit on a single CPU device: 64K tokens a chunk (it stays in cache); elsewhere 0, and keep it 0 for a
        batch sharded over devices (a loop over rows would gather it). Results do not depend on it.
      max_len: the length ``seq-mean-token-sum-norm`` divides by (times the rows); None: T. A learner that pads each
        batch to a length of its own (length buckets) passes one fixed length, so that the loss does not
        depend on the padding.

    Returns:
      ``Corrected``: weights, final mask, per-token loss, the reduced loss with its numerator and denominator,
      and the metrics. Inputs may be NumPy or JAX, float32 or bfloat16; everything is computed in float32.

    Raises:
      ValueError: on bad shapes, an empty batch (B = 0 or T = 0) included, and missing inputs the config needs.
      AssertionError: on bad values (see ``check_batch``), which ``config.check_values`` controls: None (default)
        checks every concrete input, so eager calls, for all but the bound on logprobs; under jit, where values are
        not known, a mask not 0/1 makes the loss NaN, as a NaN input does (an optimizer that skips non-finite
        updates skips it); True checks everything, traced inputs too, as chex assertions that need
        the jitted caller wrapped in ``chex.chexify(..., async_check=False)``: the call then raises before it
        returns (the default ``async_check=True`` reports on a later call or at exit); without chexify, tracing
        raises a RuntimeError saying so; False never checks.

    >>> import numpy as np
    >>> from corrections import CorrectionConfig, ImportanceWeights
    >>> lp = np.log([[0.5, 0.5, 1.0]]); m = np.array([[1, 1, 0]])
    >>> out = compute(lp, np.array([1.0]), m, CorrectionConfig(importance=ImportanceWeights("token", high=2.0)),
    ...               proximal_logprobs=lp, rollout_logprobs=np.log([[0.2, 0.5, 1.0]]))
    >>> out.weights.tolist(), round(float(out.loss), 4)
    ([[2.0, 1.0, 0.0]], -1.5)
    >>> import chex
    >>> checked = CorrectionConfig(check_values=True)
    >>> step = chex.chexify(jax.jit(lambda adv: compute(lp, adv, m, checked, proximal_logprobs=lp).loss),
    ...                     async_check=False)
    >>> step(np.array([np.nan]))
    Traceback (most recent call last):
    ...
    AssertionError: ...advantages must be finite where the mask is 1...
    """
    if jnp.ndim(logprobs) == 1:  # one sequence: a batch of one row, per-token outputs returned as [T]
        out = compute(_one_row(logprobs), _one_row_per_sequence(advantages), _one_row(mask), config,
                      proximal_logprobs=_one_row(proximal_logprobs), rollout_logprobs=_one_row(rollout_logprobs),
                      ref_logprobs=_one_row(ref_logprobs), entropy=_one_row(entropy),
                      policy_lag=_one_row_per_sequence(policy_lag),
                      key=key, weight_scale=weight_scale, rows_per_chunk=rows_per_chunk, max_len=max_len)
        return out._replace(weights=out.weights[0], mask=out.mask[0], per_token_loss=out.per_token_loss[0])
    lp = jnp.asarray(logprobs)
    mask = jnp.asarray(mask)
    arrays = [None if a is None else jnp.asarray(a) for a in (proximal_logprobs, rollout_logprobs, ref_logprobs,
                                                              entropy)]
    adv = jnp.asarray(advantages, jnp.float32)
    _check_inputs(config, lp, mask, adv, *arrays)
    if weight_scale is not None and not (config.importance is not None and config.importance.batch_normalize):
        raise ValueError("weight_scale is only used by importance.batch_normalize; drop it or enable that.")
    proximal, roll, ref, entropy = arrays
    if config.check_values is not False:
        given = dict(logprobs=lp, advantages=adv, proximal_logprobs=proximal, rollout_logprobs=roll, ref_logprobs=ref)
        if config.check_values is None:  # eager only: check the concrete arrays (all of them outside jit and grad)
            given = {name: a for name, a in given.items() if not isinstance(a, jax.core.Tracer)}
        if config.check_values or not isinstance(mask, jax.core.Tracer):
            # The bound on logprobs only when asked for: synthetic test data and toy losses use positive values.
            check_batch(mask, max_logprob=LOGPROB_TOLERANCE if config.check_values else None, **given)
    old = roll if config.mode == "bypass" else proximal
    lag = None if policy_lag is None else jnp.asarray(policy_lag)
    rows: Rows = {"lp": lp, "old": old, "roll": roll, "adv": adv, "mask": mask, "ref": ref, "entropy": entropy,
                  "lag": lag}
    if config.objective.spec.whole_batch:
        key = jax.random.key(0) if key is None else key
        clean = _clean({"lp": lp, "old": old, "roll": roll, "adv": adv}, mask)
        rows["loss"], rows["aux"] = config.objective.spec.loss(config.objective, **clean, mask=mask.astype(bool),
                                                               key=key)
    per_token, stats = _map_rows(functools.partial(_sequence_pass, config=config), rows, rows_per_chunk)
    row_sums, extra_sums = stats.pop("policy_loss_sum"), stats.pop("extra_loss_sum", None)
    weights, per_token_loss = per_token["weights"], per_token["policy_loss"]
    scale = jnp.float32(1.0)
    if config.importance is not None and config.importance.batch_normalize:
        weight_stats = stats["weights"]
        if weight_scale is None:
            weight_scale = _weights.normalizer(_weights.batch_mean_weight(
                weight_stats["applied_mean"], weight_stats["count"], config.importance.level))
        scale = sg(jnp.asarray(weight_scale, jnp.float32))
        weights, per_token_loss, row_sums = weights / scale, per_token_loss / scale, row_sums / scale
        stats["weights"] = _diagnostics.with_weight_scale(weight_stats, scale)
    if extra_sums is not None:
        per_token_loss, row_sums = per_token_loss + per_token["extra_loss"], row_sums + extra_sums
    row_counts = stats["valid"] if config.denominator == "original" else stats["kept"]
    numerator, denominator = loss_terms_from_rows(row_sums, row_counts, config.reduction, max_len or lp.shape[-1],
                                                  count_rows=config.denominator == "kept")
    reduced = divide_loss(numerator, denominator)
    if config.check_values is None and isinstance(mask, jax.core.Tracer):  # unchecked: a bad mask poisons the loss
        binary = jnp.all((mask == 0) | (mask == 1))
        numerator, reduced = (jnp.where(binary, x, jnp.nan) for x in (numerator, reduced))
    stats = jax.tree.map(sg, stats)
    metrics = metrics_from_row_stats(stats, config)
    metrics["actor/pg_loss"] = sg(reduced)
    return Corrected(sg(weights), per_token["mask"], per_token_loss, reduced, numerator, sg(denominator), metrics,
                     stats, scale)
