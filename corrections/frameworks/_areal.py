"""AReaL's actor settings, parsed into a ``CorrectionConfig``: for users who come from AReaL.

Key names, defaults and meanings are AReaL's at commit 4aef98d8 (``areal/api/cli_args.py``, ``PPOActorConfig``
and ``RejectionSamplingConfig``; ``areal/utils/functional/functional.py``, ``ppo_actor_loss_fn``). AReaL's
decoupled loss is PPO against the recomputed (proximal) policy times the behaviour weight ``exp(prox - old)``
from its ``rejection_sampling`` block, divided by the ORIGINAL token count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from corrections._config import CorrectionConfig, ImportanceWeights, Objective, RejectionRule
from corrections.frameworks._keys import (
    check_keys,
    choice,
    ignored,
    merge_disjoint,
    nest,
    section,
    unknown,
    unsupported,
    warn_ignored,
)

ACTOR = dict(
    eps_clip=0.2, eps_clip_higher=None, c_clip=None, m2_threshold=None, use_sapo_loss=False, sapo_tau_pos=1.0,
    sapo_tau_neg=1.05, recompute_logprob=False, use_decoupled_loss=False, rejection_sampling=None,
    importance_sampling_level="token", prox_logp_method="recompute",
)
REJECTION_SAMPLING = dict(level="token", action="mask", metric="ratio", agg="mean", upper=5.0, lower=None)
# PPOActorConfig / TrainEngineConfig keys that do not change the loss: rewards and advantages (kl_ctl and
# kl_estimator shape the reward, not the loss), batching, the engine, logging.
IGNORED = frozenset((
    "ppo_n_minibatches", "reward_norm", "reward_scaling", "reward_bias", "reward_clip", "overlong_reward_penalty",
    "overlong_tokens", "overlong_penalty_factor", "mask_no_eos_with_zero", "discount", "gae_lambda", "adv_norm",
    "kl_ctl", "kl_estimator", "log_agent_stats", "log_agent_stats_keys", "max_new_tokens",
    "path", "attn_impl", "use_kernels", "init_from_scratch", "is_critic", "temperature", "mb_spec",
    "pad_to_maximum", "disable_dropout", "gradient_checkpointing", "dtype", "grad_reduce_dtype", "optimizer",
    "weight_update_mode", "fsdp", "archon", "megatron", "offload", "use_lora", "lora_rank", "lora_alpha",
    "target_modules", "peft_type", "enable_tree_training", "scheduling_spec", "backend", "_version",
    "admin_api_key", "log_level", "request_timeout", "setup_timeout", "scheduling_strategy", "experiment_name",
    "trial_name",
))
PROX_METHODS = {"recompute": "recompute", "metrics": "recompute"}
SEQUENCE_AGGREGATES = {"sum": "seq_sum", "mean": "seq_mean", "max": "seq_max"}


def _log_bound(value: float | None) -> float | None:
    return None if value is None else math.exp(value)


def _rejection_sampling(rs: Mapping[str, Any], where: str) -> tuple[ImportanceWeights, tuple[RejectionRule, ...]]:
    """AReaL's behaviour weight and filter: the weight is ``exp(prox - old)`` (its geometric mean per sequence for
    the ratio metric at sequence level); ``mask`` drops what falls outside the bounds, ``clamp`` clips the weight."""
    level = choice(where, "level", rs["level"], {"token": "token", "sequence": "sequence"})
    action = choice(where, "action", rs["action"], {"mask": "mask", "clamp": "clamp"})
    metric = choice(where, "metric", rs["metric"], {"ratio": "ratio", "kl_k1": "kl_k1", "kl_k2": "kl_k2"},
                    {"kl_k3": "AReaL's k3 is exp(-l) - 1 + l of l = prox - old, the reverse of verl's k3 here."})
    aggregate = choice(where, "agg", rs["agg"], SEQUENCE_AGGREGATES) if level == "sequence" else "token"
    lower, upper = rs["lower"], rs["upper"]
    geometric = metric == "ratio" and level == "sequence"
    if action == "clamp":
        if metric != "ratio":
            raise unsupported(where, "action", action, "AReaL allows clamp only with metric='ratio'.")
        if level == "sequence" and aggregate != "seq_mean":
            raise unsupported(where, "agg", rs["agg"], "clamping the geometric weight of sequences whose sum or max "
                              "is out of bounds is not implemented; use agg='mean'.")
        low = 0.0 if lower is None else lower
        return ImportanceWeights("geometric" if geometric else "token", high=upper, low=low), ()
    weights = ImportanceWeights("geometric" if geometric else "token", high=None)
    if metric == "kl_k2":
        if lower is not None:
            raise unsupported(where, "lower", lower, "k2 rules here keep stat <= upper only.")
        return weights, (RejectionRule(f"{aggregate}_k2", None, upper),)
    if metric == "kl_k1":  # k1 = prox - old: bounds on the log-ratio are ratio bounds exp(lower), exp(upper)
        lower, upper = _log_bound(lower), _log_bound(upper)
    if aggregate == "seq_max":  # the largest ratio <= upper: no token above it, the outlier veto
        if lower is not None:
            raise unsupported(where, "lower", rs["lower"], "with agg='max' AReaL keeps a sequence whose LARGEST "
                              "ratio is >= lower (one token suffices); no rule bounds that from below.")
        return weights, (RejectionRule("outlier", None, upper),)
    return weights, (RejectionRule(f"{aggregate}_k1", lower, upper),)


def from_areal(config: Mapping[str, Any] | None = None, /, **keys: Any) -> CorrectionConfig:
    """The ``CorrectionConfig`` of an AReaL actor config: AReaL 4aef98d8's loss.

    Takes AReaL's own keys nested (``{"actor": {...}}``, as in an AReaL YAML), dotted (``"actor.eps_clip"``, as on
    its command line) or flat (the actor's keys), in ``config`` or as keyword arguments; missing keys take AReaL's
    defaults. Read: ``eps_clip``, ``eps_clip_higher``, ``c_clip``, ``use_decoupled_loss``, ``recompute_logprob``,
    ``rejection_sampling`` (level, action, metric, agg, upper, lower), ``importance_sampling_level`` (GSPO),
    ``use_sapo_loss`` with its temperatures, ``prox_logp_method`` and ``m2_threshold``. Keys that do not touch the
    loss are accepted and not applied, and listed in one ``TrainingKeysWarning``; unknown keys are listed
    (``UnknownKeyWarning``), or raise, naming the nearest match, inside a loss block or close to a loss key.
    docs/from-other-frameworks.md has the table.

    Without ``use_decoupled_loss`` AReaL's PPO is anchored on the recomputed logprobs (``recompute_logprob``) or on
    the inference engine's (bypass mode here).

    >>> config = from_areal({"actor": {"use_decoupled_loss": True, "rejection_sampling": {"upper": 5.0}}})
    >>> config.mode, config.rejection[0].name, config.rejection[0].high, config.importance.high
    ('decoupled', 'token_k1', 5.0, None)
    >>> from_areal({"actor.eps_clip_high": 0.28})
    Traceback (most recent call last):
    ...
    ValueError: areal.actor: unknown key 'eps_clip_high'; did you mean 'eps_clip_higher'?
    """
    data = merge_disjoint(nest(config or {}, "areal"), nest(keys, "areal"), "areal")
    given: dict[str, Any] = {}
    outside: dict[str, Any] = {}
    for key, value in data.items():
        if key == "actor":
            given = merge_disjoint(given, section(value, "areal.actor"), "areal.actor")
        elif "actor" in data and key in IGNORED:
            outside[key] = value  # a whole AReaL config's top-level keys (experiment_name, ...): not the actor's
        elif key in ACTOR or key in IGNORED:
            given = merge_disjoint(given, {key: value}, "areal.actor")
        elif key != "_target_":
            unknown("areal", key, set(ACTOR) | IGNORED | {"actor"}, set(ACTOR) | {"actor"})
    where = "areal.actor"
    check_keys(given, set(ACTOR) | IGNORED, where, ACTOR)
    warn_ignored("areal", outside | ignored(given, IGNORED, "actor."))
    actor = {**ACTOR, **{k: v for k, v in given.items() if k in ACTOR}}
    if actor["m2_threshold"] is not None:
        raise unsupported(where, "m2_threshold", actor["m2_threshold"], "M2PO masking is not implemented.")
    choice(where, "prox_logp_method", actor["prox_logp_method"], PROX_METHODS,
           {"loglinear": "the interpolated proximal policy is not implemented; pass recomputed logprobs."})
    decoupled = bool(actor["use_decoupled_loss"])
    importance: ImportanceWeights | None = None
    rejection: tuple[RejectionRule, ...] = ()
    if actor["rejection_sampling"] is not None:
        if not decoupled:
            raise unsupported(where, "rejection_sampling", actor["rejection_sampling"],
                              "AReaL ignores it without use_decoupled_loss=True; set that, or drop the block.")
        rs = section(actor["rejection_sampling"], f"{where}.rejection_sampling")
        check_keys(rs, REJECTION_SAMPLING, f"{where}.rejection_sampling")
        importance, rejection = _rejection_sampling({**REJECTION_SAMPLING, **rs}, f"{where}.rejection_sampling")
    low = actor["eps_clip"]
    high = low if actor["eps_clip_higher"] is None else actor["eps_clip_higher"]
    level = choice(where, "importance_sampling_level", actor["importance_sampling_level"],
                   {"token": "ppo", "sequence": "gspo"})
    if actor["use_sapo_loss"]:
        if decoupled:
            raise unsupported(where, "use_sapo_loss", True, "AReaL rejects SAPO with use_decoupled_loss=True.")
        if level != "ppo":
            raise unsupported(where, "importance_sampling_level", "sequence", "sequence-level SAPO is not "
                              "implemented.")
        objective = Objective("sapo", tau_pos=actor["sapo_tau_pos"], tau_neg=actor["sapo_tau_neg"])
    elif level == "gspo":
        if actor["c_clip"] is not None:
            raise unsupported(where, "c_clip", actor["c_clip"], "dual clip is implemented for PPO, not GSPO.")
        objective = Objective("gspo", clip_low=low, clip_high=high, gspo_form="sequence")
    else:
        objective = Objective("ppo", clip_low=low, clip_high=high, dual_clip=actor["c_clip"])
    return CorrectionConfig(
        mode="decoupled" if decoupled or actor["recompute_logprob"] else "bypass",
        objective=objective,
        importance=importance,
        rejection=rejection,
        reduction="token-mean",
        denominator="original",
    )
