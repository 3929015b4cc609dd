"""verl's ``rollout_corr`` settings, parsed into a ``CorrectionConfig``: for users who come from verl.

verl's syntax: ``rollout_is`` is ``"token"`` or ``"sequence"`` with ``rollout_is_threshold`` a float (truncate at
it) or ``"lo_up"`` (IcePop: zero outside ``[lo, up]``). ``rollout_rs`` is a comma list of rule names
(duplicates dropped, order kept) and ``rollout_rs_threshold`` a float or a comma list of one entry per rule (or
one for all); a k1 entry is ``"lo_up"`` or a bare ``up`` meaning ``[1/up, up]``; k2/k3 entries are one upper
bound.

verl checks k1 bounds on ``-log rho`` and so keeps ``1/up <= rho <= 1/lo``, the reverse of its docs (closed PR
#6377). By default the bounds here mean what they say; ``reproduce_inverted_k1=True`` reproduces verl's numbers.
"""

from __future__ import annotations

from corrections._config import K1_RULES, REJECTION_RULES, CorrectionConfig, ImportanceWeights, Objective, RejectionRule


def _positive(field: str, text) -> float:
    if isinstance(text, bool):
        raise ValueError(f"{field}={text!r}: give a number or a 'lo_up' string, not a bool.")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{field}={text!r} is not a number or a 'lo_up' string.") from None
    if value <= 0:
        raise ValueError(f"{field}={text!r}: thresholds must be positive.")
    return value


def _bounds(field: str, spec) -> tuple[float | None, float]:
    """``"lo_up"`` -> (lo, up); a bare number -> (None, up)."""
    if isinstance(spec, str) and "_" in spec:
        low_text, high_text = spec.strip().split("_", 1)
        low, high = _positive(field, low_text), _positive(field, high_text)
        if low > high:
            raise ValueError(f"{field}={spec!r}: lower bound {low} exceeds upper bound {high}.")
        return low, high
    return None, _positive(field, spec.strip() if isinstance(spec, str) else spec)


def verl_importance(rollout_is: str | None, rollout_is_threshold=2.0, batch_normalize: bool = False):
    """``ImportanceWeights`` for verl's ``rollout_is`` / ``rollout_is_threshold`` (None when ``rollout_is`` is None).

    >>> verl_importance("token", "0.5_5.0")
    ImportanceWeights(level='token', high=5.0, low=0.5, overflow='mask', batch_normalize=False)
    """
    if rollout_is is None or rollout_is_threshold is None:
        return None
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is={rollout_is!r} is not an option; use 'token', 'sequence' or None.")
    low, high = _bounds("rollout_is_threshold", rollout_is_threshold)
    if low is None:
        return ImportanceWeights(rollout_is, high=high, batch_normalize=batch_normalize)
    return ImportanceWeights(rollout_is, high=high, low=low, overflow="mask", batch_normalize=batch_normalize)


def verl_rejection_rules(rollout_rs: str | None, rollout_rs_threshold=None, *, reproduce_inverted_k1: bool = False):
    """``RejectionRule``s for verl's ``rollout_rs`` / ``rollout_rs_threshold``.

    >>> [(r.name, r.low, r.high) for r in verl_rejection_rules("seq_mean_k1,seq_max_k3", "0.999_1.001,0.01")]
    [('seq_mean_k1', 0.999, 1.001), ('seq_max_k3', None, 0.01)]
    >>> [(r.name, r.low, r.high) for r in verl_rejection_rules("token_k1", "0.8_1.6", reproduce_inverted_k1=True)]
    [('token_k1', 0.625, 1.25)]
    """
    if not rollout_rs:
        return ()
    names = list(dict.fromkeys(name.strip() for name in rollout_rs.split(",") if name.strip()))
    for name in names:
        if name == "outlier" or name not in REJECTION_RULES:
            options = ", ".join(r for r in REJECTION_RULES if r != "outlier")
            raise ValueError(f"rollout_rs: {name!r} is not an option; use a comma list of {options}.")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold is required when rollout_rs is set (e.g. '0.999_1.001' or 0.01).")
    specs = [s.strip() for s in rollout_rs_threshold.split(",")] if isinstance(rollout_rs_threshold, str) else [
        rollout_rs_threshold
    ]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} entries for {len(names)} rules ({', '.join(names)}); "
            "give one entry, or one per rule."
        )
    rules = []
    for name, spec in zip(names, specs):
        field = f"rollout_rs_threshold[{name}]"
        low, high = _bounds(field, spec)
        if name in K1_RULES:
            low = float(str(1.0 / high)) if low is None else low
            if reproduce_inverted_k1:
                low, high = 1.0 / high, 1.0 / low
            rules.append(RejectionRule(name, low, high))
        elif low is not None:
            raise ValueError(f"{field}={spec!r}: k2/k3 rules take one upper bound, not 'lo_up'.")
        else:
            rules.append(RejectionRule(name, None, high))
    return tuple(rules)


def from_verl(
    rollout_is: str | None = None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold=None,
    bypass_mode: bool = False,
    loss_type: str = "ppo_clip",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    reproduce_inverted_k1: bool = False,
) -> CorrectionConfig:
    """A ``CorrectionConfig`` equal to verl's ``algorithm.rollout_correction`` block with these settings.

    verl divides by the kept token count after rejection (``denominator="kept"``) and applies dual clip.

    >>> config = from_verl(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001")
    >>> config.importance.high, config.rejection[0].name, config.denominator
    (2.0, 'seq_mean_k1', 'kept')
    """
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"loss_type={loss_type!r} is not an option; use 'ppo_clip' or 'reinforce'.")
    if loss_type == "reinforce" and not bypass_mode:
        raise ValueError("loss_type='reinforce' needs bypass_mode=True in verl; set both.")
    if loss_type == "ppo_clip":
        objective = Objective("ppo", clip_low=clip_ratio_low, clip_high=clip_ratio_high, dual_clip=clip_ratio_c)
    else:
        objective = Objective("reinforce")
    return CorrectionConfig(
        mode="bypass" if bypass_mode else "decoupled",
        objective=objective,
        importance=verl_importance(rollout_is, rollout_is_threshold, rollout_is_batch_normalize),
        rejection=verl_rejection_rules(rollout_rs, rollout_rs_threshold, reproduce_inverted_k1=reproduce_inverted_k1),
        denominator="kept",
    )
