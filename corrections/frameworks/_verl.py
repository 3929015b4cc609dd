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

from collections.abc import Callable, Mapping
from typing import Any

from corrections._config import (
    K1_RULES,
    REDUCTIONS,
    REJECTION_RULES,
    CorrectionConfig,
    ImportanceWeights,
    Objective,
    RejectionRule,
)
from corrections.frameworks._keys import (
    check_keys,
    choice,
    defaults_refused,
    ignored,
    merge_disjoint,
    nest,
    section,
    unknown,
    unsupported,
    warn_ignored,
)
from corrections.frameworks._verl_keys import (
    ACTOR,
    ACTOR_IGNORED,
    ACTOR_ROLLOUT_REF_IGNORED,
    ALGORITHM_IGNORED,
    POLICY_LOSS,
    ROLLOUT_CORRECTION,
)


def _positive(field: str, text: str | float) -> float:
    if isinstance(text, bool):
        raise ValueError(f"{field}={text!r}: give a number or a 'lo_up' string, not a bool.")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{field}={text!r} is not a number or a 'lo_up' string.") from None
    if value <= 0:
        raise ValueError(f"{field}={text!r}: thresholds must be positive.")
    return value


def _bounds(field: str, spec: str | float) -> tuple[float | None, float]:
    """``"lo_up"`` -> (lo, up); a bare number -> (None, up)."""
    if isinstance(spec, str) and "_" in spec:
        low_text, high_text = spec.strip().split("_", 1)
        low, high = _positive(field, low_text), _positive(field, high_text)
        if low > high:
            raise ValueError(f"{field}={spec!r}: lower bound {low} exceeds upper bound {high}.")
        return low, high
    return None, _positive(field, spec.strip() if isinstance(spec, str) else spec)


def verl_importance(rollout_is: str | None, rollout_is_threshold: str | float | None = 2.0,
                    batch_normalize: bool = False) -> ImportanceWeights | None:
    """``ImportanceWeights`` for verl's ``rollout_is`` / ``rollout_is_threshold`` (None when ``rollout_is`` is None).

    >>> weights = verl_importance("token", "0.5_5.0")
    >>> weights.level, weights.low, weights.high, weights.overflow
    ('token', 0.5, 5.0, 'mask')
    """
    if rollout_is is None or rollout_is_threshold is None:
        return None
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is={rollout_is!r} is not an option; use 'token', 'sequence' or None.")
    low, high = _bounds("rollout_is_threshold", rollout_is_threshold)
    if low is None:
        return ImportanceWeights(rollout_is, high=high, batch_normalize=batch_normalize)
    return ImportanceWeights(rollout_is, high=high, low=low, overflow="mask", batch_normalize=batch_normalize)


def verl_rejection_rules(rollout_rs: str | None, rollout_rs_threshold: str | float | None = None, *,
                         reproduce_inverted_k1: bool = False) -> tuple[RejectionRule, ...]:
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
    specs: list[str | float]
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


KL_LOSS_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "low_var_kl"}
KL_LOSS_TYPES_UNSUPPORTED = {
    "abs": "Tether has no |lp - ref| estimator.",
    "full": "the full-vocabulary KL needs the logits; compute takes logprobs of the sampled tokens.",
    **{f"{k}+": "the '+' (straight-through k2 gradient) variants are not implemented." for k in KL_LOSS_TYPES},
}
LOSS_MODES_UNSUPPORTED = {
    "gpg": "GPG is not implemented.", "geo_mean": "GMPO (geo_mean) is not implemented.",
    "dro": "DRO is not implemented.", "dppo_tv": "DPPO is not implemented.", "dppo_kl": "DPPO is not implemented.",
    "bypass_mode": "verl sets it itself; set algorithm.rollout_correction.bypass_mode=True instead.",
}


def _verl_blocks(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Splits a verl config (full, sections, or flat keys) into its rollout_correction and actor blocks, and the
    keys outside the loss it gives (dotted)."""
    where = "verl"
    rollout_correction: dict[str, Any] = {}
    actor: dict[str, Any] = {}
    outside: dict[str, Any] = {}
    sections = {"algorithm", "actor_rollout_ref", "rollout_correction", "actor"}
    for key, value in data.items():
        if key == "algorithm":
            algorithm = section(value, "verl.algorithm")
            check_keys(algorithm, ALGORITHM_IGNORED | {"rollout_correction"}, "verl.algorithm", {"rollout_correction"})
            outside |= ignored(algorithm, ALGORITHM_IGNORED, "algorithm.")
            part = section(algorithm.get("rollout_correction"), "verl.algorithm.rollout_correction")
            rollout_correction = merge_disjoint(rollout_correction, part, "verl.algorithm.rollout_correction")
        elif key == "actor_rollout_ref":
            block = section(value, "verl.actor_rollout_ref")
            check_keys(block, ACTOR_ROLLOUT_REF_IGNORED | {"actor"}, "verl.actor_rollout_ref", {"actor"})
            outside |= ignored(block, ACTOR_ROLLOUT_REF_IGNORED, "actor_rollout_ref.")
            actor = merge_disjoint(actor, section(block.get("actor"), "verl.actor_rollout_ref.actor"),
                                   "verl.actor_rollout_ref.actor")
        elif key == "rollout_correction":
            rollout_correction = merge_disjoint(rollout_correction, section(value, "verl.rollout_correction"),
                                                "verl.rollout_correction")
        elif key == "actor":
            actor = merge_disjoint(actor, section(value, "verl.actor"), "verl.actor")
        elif key in ROLLOUT_CORRECTION:
            rollout_correction = merge_disjoint(rollout_correction, {key: value}, "verl.rollout_correction")
        elif key in ACTOR or key in ACTOR_IGNORED:
            actor = merge_disjoint(actor, {key: value}, "verl.actor")
        elif key == "defaults":
            raise defaults_refused(where)
        elif key != "_target_":
            unknown(where, key, sections | set(ROLLOUT_CORRECTION) | set(ACTOR) | ACTOR_IGNORED,
                    sections | set(ROLLOUT_CORRECTION) | set(ACTOR))
    if "defaults" in actor:  # an actor file's own defaults (optim, engine), not composed
        raise defaults_refused("verl.actor_rollout_ref.actor")
    check_keys(rollout_correction, ROLLOUT_CORRECTION, "verl.algorithm.rollout_correction")
    check_keys(actor, set(ACTOR) | ACTOR_IGNORED, "verl.actor_rollout_ref.actor", ACTOR)
    return rollout_correction, actor, outside | ignored(actor, ACTOR_IGNORED, "actor_rollout_ref.actor.")


def _verl_objective(actor: Mapping[str, Any], policy_loss: Mapping[str, Any], bypass: bool,
                    loss_type: str) -> tuple[Objective, str | None]:
    """The objective and, for GSPO and SAPO, the reduction verl forces (seq-mean-token-mean)."""
    where = "verl.actor_rollout_ref.actor"
    clip = actor["clip_ratio"]
    low = clip if actor["clip_ratio_low"] is None else actor["clip_ratio_low"]
    high = clip if actor["clip_ratio_high"] is None else actor["clip_ratio_high"]
    mode = policy_loss["loss_mode"]
    if bypass and mode != "vanilla":
        raise unsupported(f"{where}.policy_loss", "loss_mode", mode,
                          "verl's bypass mode replaces it by its own loss (loss_type ppo_clip or reinforce), "
                          "dropping your choice; set loss_mode='vanilla'.")
    if bypass and loss_type == "reinforce":
        return Objective("reinforce"), None
    objectives: dict[str, Callable[[], tuple[Objective, str | None]]] = {
        "vanilla": lambda: (Objective("ppo", clip_low=low, clip_high=high, dual_clip=actor["clip_ratio_c"]), None),
        "gspo": lambda: (Objective("gspo", clip_low=low, clip_high=high), "seq-mean-token-mean"),
        "sapo": lambda: (Objective("sapo", tau_pos=actor["tau_pos"], tau_neg=actor["tau_neg"]),
                         "seq-mean-token-mean"),
        "cispo": lambda: (Objective("cispo", clip_low=low, clip_high=high), None),
        "clip_cov": lambda: (Objective("clip_cov", clip_low=low, clip_high=high,
                                       clip_cov_ratio=policy_loss["clip_cov_ratio"],
                                       clip_cov_low=policy_loss["clip_cov_lb"],
                                       clip_cov_high=policy_loss["clip_cov_ub"]), None),
        "kl_cov": lambda: (Objective("kl_cov", kl_cov_ratio=policy_loss["kl_cov_ratio"],
                                     kl_cov_coef=policy_loss["ppo_kl_coef"]), None),
    }
    return choice(f"{where}.policy_loss", "loss_mode", mode, objectives, LOSS_MODES_UNSUPPORTED)()


def from_verl(config: Mapping[str, Any] | None = None, /, *, reproduce_inverted_k1: bool = False,
              **keys: Any) -> CorrectionConfig:
    """The ``CorrectionConfig`` of a verl config: the same losses and ``rollout_corr/`` metrics as verl 1dda039b.

    Takes verl's own keys, as a nested config (``{"algorithm": {"rollout_correction": {...}},
    "actor_rollout_ref": {"actor": {...}}}``, e.g. a verl YAML or launch script as
    ``learner.rl.framework_files.read_file`` reads it), as Hydra's dotted keys
    (``"actor_rollout_ref.actor.loss_agg_mode"``), or flat (the ``rollout_correction`` and actor keys do not share
    names), in ``config`` or as keyword arguments. Missing keys take verl's YAML defaults. Read:
    ``algorithm.rollout_correction`` (all keys) and the actor's ``clip_ratio*``, ``policy_loss``, ``tau_*``,
    ``loss_agg_mode``, ``loss_scale_factor``, ``entropy_coeff`` and the KL loss (``use_kl_loss``,
    ``kl_loss_coef``, ``kl_loss_type``); keys that do not touch the loss (batch sizes, optimizer, engine, advantage
    estimator) are accepted and not applied, and listed in one ``TrainingKeysWarning``. Unknown keys are listed
    (``UnknownKeyWarning``), or raise, naming the nearest match, inside a loss block or close to a loss key;
    Hydra's ``_target_`` (the class a block builds) is ignored; a Hydra ``defaults`` list (files to compose) is
    refused: ``learner.rl.framework_files.read_file`` composes a file and settles what is left.
    docs/from-other-frameworks.md has the key-by-key table.

    verl divides by the kept token count after rejection (``denominator="kept"``) and applies dual clip. verl
    checks k1 bounds inverted (see ``verl_rejection_rules``): ``reproduce_inverted_k1=True`` reproduces that.

    >>> config = from_verl(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001")
    >>> config.importance.high, config.rejection[0].name, config.denominator
    (2.0, 'seq_mean_k1', 'kept')
    >>> from_verl({"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"}).reduction
    'seq-mean-token-mean'
    >>> from_verl({"actor_rollout_ref": {"actor": {"clip_ratio_hgh": 0.28}}})
    Traceback (most recent call last):
    ...
    ValueError: verl.actor_rollout_ref.actor: unknown key 'clip_ratio_hgh'; did you mean 'clip_ratio_high'?
    """
    data = merge_disjoint(nest(config or {}, "verl"), nest(keys, "verl"), "verl")
    given_rc, given_actor, outside = _verl_blocks(data)
    warn_ignored("verl", outside)
    rc = {**ROLLOUT_CORRECTION, **given_rc}
    actor = {**ACTOR, **{k: v for k, v in given_actor.items() if k in ACTOR}}
    policy_loss = section(actor["policy_loss"], "verl.actor_rollout_ref.actor.policy_loss")
    check_keys(policy_loss, POLICY_LOSS, "verl.actor_rollout_ref.actor.policy_loss")
    policy_loss = {**POLICY_LOSS, **policy_loss}
    where = "verl.algorithm.rollout_correction"
    loss_type = choice(where, "loss_type", rc["loss_type"], {"ppo_clip": "ppo_clip", "reinforce": "reinforce"})
    bypass = bool(rc["bypass_mode"])
    if loss_type == "reinforce" and not bypass:
        raise ValueError("loss_type='reinforce' needs bypass_mode=True in verl; set both.")
    objective, forced_reduction = _verl_objective(actor, policy_loss, bypass, loss_type)
    importance = verl_importance(rc["rollout_is"], rc["rollout_is_threshold"], rc["rollout_is_batch_normalize"])
    if bypass and loss_type == "ppo_clip":
        importance = None  # verl's bypass PPO computes the weights for its metrics only and never applies them
    where = "verl.actor_rollout_ref.actor"
    if actor["loss_scale_factor"] is not None:
        raise unsupported(where, "loss_scale_factor", actor["loss_scale_factor"],
                          "seq-mean-token-sum-norm here divides by the padded length T (verl's default, null).")
    reduction = forced_reduction or choice(where, "loss_agg_mode", actor["loss_agg_mode"],
                                           {mode: mode for mode in REDUCTIONS})
    kl_estimator = choice(where, "kl_loss_type", actor["kl_loss_type"], KL_LOSS_TYPES, KL_LOSS_TYPES_UNSUPPORTED)
    return CorrectionConfig(
        mode="bypass" if bypass else "decoupled",
        objective=objective,
        importance=importance,
        rejection=verl_rejection_rules(rc["rollout_rs"], rc["rollout_rs_threshold"],
                                       reproduce_inverted_k1=reproduce_inverted_k1),
        reduction=reduction,
        denominator="kept",
        kl_coef=float(actor["kl_loss_coef"]) if actor["use_kl_loss"] else 0.0,
        kl_estimator=kl_estimator,
        entropy_coef=float(actor["entropy_coeff"]),
    )
