"""Named presets: plain data (nested dicts) that ``preset`` turns into a validated ``CorrectionConfig``.

verl's presets keep verl's names and defaults; the other frameworks' settings have one-line equivalents
named after the framework. Bounds mean what they say (``low <= ratio <= high``); see ``verl_rejection_rules``
for reproducing verl's inverted k1 bounds on purpose.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from corrections._config import RULE_ALIASES, CorrectionConfig, config_from_dict, config_to_dict
from corrections.frameworks._keys import merge, unknown_key
from corrections.frameworks._verl import from_verl

CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(CorrectionConfig))

_VERL = {"denominator": "kept", "objective": {"name": "ppo", "dual_clip": 3.0}}
_VERL_BYPASS_PG = {"mode": "bypass", "denominator": "kept", "objective": {"name": "reinforce"}}
_TOKEN_IS = {"level": "token", "high": 2.0}
_SEQ_IS = {"level": "sequence", "high": 2.0}
_GEO_RS = {"name": "seq_mean_k1", "low": 0.999, "high": 1.001}
_K3_RS = {"name": "seq_mean_k3", "high": 0.01}
_ICEPOP = {"level": "token", "low": 0.5, "high": 5.0, "overflow": "mask"}


def _merge(base: Mapping[str, Any], *updates: Mapping[str, Any]) -> dict[str, Any]:
    """``corrections.frameworks.merge`` of the updates in turn, on copies."""
    out = copy.deepcopy(dict(base))
    for update in updates:
        out = merge(out, copy.deepcopy(dict(update)))
    return out


PRESETS: dict[str, dict[str, Any]] = {
    # verl (rollout_corr presets), decoupled: PPO vs recomputed proximal logprobs, behaviour weights vs rollout.
    "disabled": _merge(_VERL, {}),
    "decoupled_token_is": _merge(_VERL, {"importance": _TOKEN_IS}),
    "decoupled_seq_is": _merge(_VERL, {"importance": _SEQ_IS}),
    "decoupled_seq_is_rs": _merge(
        _VERL, {"importance": _SEQ_IS, "rejection": [{"name": "seq_sum_k1", "low": 0.5, "high": 2.0}]}
    ),
    "decoupled_geo_rs": _merge(_VERL, {"rejection": [_GEO_RS]}),
    "decoupled_geo_rs_token_tis": _merge(_VERL, {"importance": _TOKEN_IS, "rejection": [_GEO_RS]}),
    "decoupled_geo_rs_seq_tis": _merge(_VERL, {"importance": _SEQ_IS, "rejection": [_GEO_RS]}),
    "decoupled_k3_rs": _merge(_VERL, {"rejection": [_K3_RS]}),
    "decoupled_k3_rs_token_tis": _merge(_VERL, {"importance": _TOKEN_IS, "rejection": [_K3_RS]}),
    "decoupled_k3_rs_seq_tis": _merge(_VERL, {"importance": _SEQ_IS, "rejection": [_K3_RS]}),
    "decoupled_token_icepop": _merge(_VERL, {"importance": _ICEPOP}),
    # verl bypass: proximal := rollout, so the PPO ratio itself corrects the mismatch.
    "bypass_ppo_clip": _merge(_VERL, {"mode": "bypass"}),
    "bypass_ppo_clip_geo_rs": _merge(_VERL, {"mode": "bypass", "rejection": [_GEO_RS]}),
    "bypass_ppo_clip_k3_rs": _merge(_VERL, {"mode": "bypass", "rejection": [_K3_RS]}),
    "bypass_pg_is": _merge(_VERL_BYPASS_PG, {"importance": _SEQ_IS}),
    "bypass_pg_geo_rs": _merge(_VERL_BYPASS_PG, {"rejection": [_GEO_RS]}),
    "bypass_pg_geo_rs_token_tis": _merge(_VERL_BYPASS_PG, {"importance": _TOKEN_IS, "rejection": [_GEO_RS]}),
    "bypass_pg_geo_rs_seq_tis": _merge(_VERL_BYPASS_PG, {"importance": _SEQ_IS, "rejection": [_GEO_RS]}),
    "bypass_pg_token_icepop": _merge(_VERL_BYPASS_PG, {"importance": _ICEPOP}),
    # SkyRL's off_policy_correction block with SkyRL's default loss (policy_loss_type "regular": PPO clip without dual
    # clip; token mean over the original mask). SkyRL's KL loss, on by default there, is left out: set kl_coef.
    "skyrl_token_tis": {"importance": {"level": "token", "high": 2.0}},
    "skyrl_sequence_tis": {"importance": {"level": "sequence", "high": 5.0}},
    "skyrl_token_mask": {"rejection": [{"name": "token_k1", "low": 0.5, "high": 2.0}]},
    "skyrl_outlier_mask": {"rejection": [{"name": "outlier", "low": 1e-4, "high": 100.0}]},
    "skyrl_geometric_mask": {"rejection": [{"name": "seq_mean_k1", "low": 0.99, "high": 1.01}]},
    "skyrl_product_mask": {"rejection": [{"name": "seq_sum_k1", "low": 0.5, "high": 2.0}]},
    "skyrl_rollout_is": {"objective": {"name": "rollout_is"}},
    "skyrl_cispo": {"objective": {"name": "cispo", "clip_low": 1.0, "clip_high": 4.0}},
    # slime: --use-tis (vanilla_tis, clamp [0, 2]), icepop, --use-opsm, off_policy_is (PR #2084). Token-mean is
    # slime's --calculate-per-token-loss; its default per-sample mean is reduction="seq-mean-token-mean".
    "slime_tis": {"importance": {"level": "token", "low": 0.0, "high": 2.0}},
    "slime_icepop": {"importance": _ICEPOP},
    "slime_opsm": {"opsm_delta": 1e-4},
    # slime PR #2084 (8e0d556e) off_policy_is: clamp(exp(sg(lp) - roll), tis_clip_low=0, tis_clip=2) times the
    # normal PPO loss (ratio against the recomputed logprobs).
    "slime_off_policy_is": {"importance": {"level": "token", "low": 0.0, "high": 2.0, "numerator": "current"}},
    # AReaL decoupled PPO: behaviour weight exp(old - roll) masked (not clamped) above behav_imp_weight_cap = 5.
    "areal_decoupled_ppo": {"importance": {"level": "token", "high": 5.0, "overflow": "mask"}},
    # TRL GRPOTrainer vllm_importance_sampling_correction, by TRL's mode names: ratio exp(old - roll) with one cap C
    # (vllm_importance_sampling_cap, default 3.0) per token or per sequence; "truncate": min(ratio, C); "mask": 0
    # above C, the token still counted in the denominator. TRL's clip_min maps to importance.low.
    "token_truncate": {"importance": {"level": "token", "high": 3.0, "overflow": "truncate"}},
    "token_mask": {"importance": {"level": "token", "high": 3.0, "overflow": "mask"}},
    "sequence_truncate": {"importance": {"level": "sequence", "high": 3.0, "overflow": "truncate"}},
    "sequence_mask": {"importance": {"level": "sequence", "high": 3.0, "overflow": "mask"}},
    # "When Speed Kills Stability": Geo-RS with token TIS.
    "geo_rs_token_tis": {"importance": {"level": "token", "high": 2.0}, "rejection": [_GEO_RS]},
}



def _geo_rs(rs_threshold: float | str = "0.999_1.001") -> dict[str, Any]:
    return dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)


def _k3_rs(rs_threshold: float | str = 0.01) -> dict[str, Any]:
    return dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)


_BYPASS_PPO, _BYPASS_PG = dict(bypass_mode=True), dict(bypass_mode=True, loss_type="reinforce")

# verl's RolloutCorrectionConfig presets (verl 1dda039b, algorithm.py): each takes verl's own arguments and
# returns verl's rollout_correction block, which ``from_verl`` reads. ``preset(name, **arguments)`` accepts them.
VERL_PRESETS: dict[str, Callable[..., dict[str, Any]]] = {
    "disabled": lambda: {},
    "decoupled_token_is": lambda threshold=2.0: dict(rollout_is="token", rollout_is_threshold=threshold),
    "decoupled_seq_is": lambda threshold=2.0: dict(rollout_is="sequence", rollout_is_threshold=threshold),
    "decoupled_token_icepop": lambda threshold=5.0, threshold_lower=0.5: dict(
        rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}"),
    "decoupled_seq_is_rs": lambda is_threshold=2.0, rs_threshold="0.5_2.0": dict(
        rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_sum_k1",
        rollout_rs_threshold=rs_threshold),
    "decoupled_geo_rs": _geo_rs,
    "decoupled_geo_rs_seq_tis": lambda is_threshold=2.0, rs_threshold="0.999_1.001": dict(
        _geo_rs(rs_threshold), rollout_is="sequence", rollout_is_threshold=is_threshold),
    "decoupled_geo_rs_token_tis": lambda is_threshold=2.0, rs_threshold="0.999_1.001": dict(
        _geo_rs(rs_threshold), rollout_is="token", rollout_is_threshold=is_threshold),
    "decoupled_k3_rs": _k3_rs,
    "decoupled_k3_rs_seq_tis": lambda is_threshold=2.0, rs_threshold=0.01: dict(
        _k3_rs(rs_threshold), rollout_is="sequence", rollout_is_threshold=is_threshold),
    "decoupled_k3_rs_token_tis": lambda is_threshold=2.0, rs_threshold=0.01: dict(
        _k3_rs(rs_threshold), rollout_is="token", rollout_is_threshold=is_threshold),
    "bypass_ppo_clip": lambda: dict(_BYPASS_PPO),
    "bypass_ppo_clip_geo_rs": lambda rs_threshold="0.999_1.001": dict(_geo_rs(rs_threshold), **_BYPASS_PPO),
    "bypass_ppo_clip_k3_rs": lambda rs_threshold=0.01: dict(_k3_rs(rs_threshold), **_BYPASS_PPO),
    "bypass_pg_is": lambda threshold=2.0: dict(rollout_is="sequence", rollout_is_threshold=threshold, **_BYPASS_PG),
    "bypass_pg_token_icepop": lambda threshold=5.0, threshold_lower=0.5: dict(
        rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}", **_BYPASS_PG),
    "bypass_pg_geo_rs": lambda rs_threshold="0.999_1.001": dict(_geo_rs(rs_threshold), **_BYPASS_PG),
    "bypass_pg_geo_rs_seq_tis": lambda is_threshold=2.0, rs_threshold="0.999_1.001": dict(
        _geo_rs(rs_threshold), rollout_is="sequence", rollout_is_threshold=is_threshold, **_BYPASS_PG),
    "bypass_pg_geo_rs_token_tis": lambda is_threshold=2.0, rs_threshold="0.999_1.001": dict(
        _geo_rs(rs_threshold), rollout_is="token", rollout_is_threshold=is_threshold, **_BYPASS_PG),
}
REJECTION_MODES = ("merge", "replace")


def _merge_rules(preset_rules: list[dict[str, Any]], override_rules: object, mode: str,
                 name: str) -> list[dict[str, Any]]:
    """The preset's rejection rules with the overrides applied: ``"merge"`` updates the fields of a rule of the
    same name and appends a rule of a new name; ``"replace"`` drops the preset's rules first."""
    if mode not in REJECTION_MODES:
        raise ValueError(f"rejection_mode={mode!r} is not an option; use one of {', '.join(REJECTION_MODES)}.")
    if isinstance(override_rules, Mapping) or not isinstance(override_rules, (list, tuple)):
        raise ValueError(f"rejection={override_rules!r} must be a list of rules.")
    if mode == "replace":
        return [dict(rule) for rule in override_rules]
    if not override_rules and preset_rules:
        names = ", ".join(rule["name"] for rule in preset_rules)
        raise ValueError(f"rejection=[] would keep preset {name!r}'s rules ({names}) under rejection_mode='merge'; "
                         "pass rejection_mode='replace' to drop them.")
    rules = [dict(rule) for rule in preset_rules]
    for rule in override_rules:
        rule = dict(rule)
        given_name: Any = rule.get("name")  # None when missing: config_from_dict says so
        rule_name = RULE_ALIASES.get(given_name, given_name)
        same = [old for old in rules if RULE_ALIASES.get(old["name"], old["name"]) == rule_name]
        if same:
            same[0].update(rule, name=rule_name)
        else:
            rules.append(rule)
    return rules


def preset(name: str, rejection_mode: str = "merge", **overrides: Any) -> CorrectionConfig:
    """The config of a named preset with overrides: top-level fields replace, dict values merge into nested fields.

    A verl preset also takes verl's own preset arguments (``threshold``, ``threshold_lower``, ``is_threshold``,
    ``rs_threshold``; see ``VERL_PRESETS``). ``rejection=[...]`` merges into the preset's rules by name (a rule
    of the same name gets the given fields, e.g. new bounds; a new name is added); ``rejection_mode="replace"``
    drops the preset's rules first.

    >>> preset("decoupled_token_is", importance={"high": 3.0}).importance.high
    3.0
    >>> preset("decoupled_geo_rs_token_tis", is_threshold=3.0, rs_threshold="0.99_1.01").rejection
    (RejectionRule(name='seq_mean_k1', low=0.99, high=1.01),)
    >>> [r.name for r in preset("decoupled_geo_rs", rejection=[{"name": "seq_max_k2", "high": 0.1}]).rejection]
    ['seq_mean_k1', 'seq_max_k2']
    >>> preset("decoupled_geo_rs", rejection=[{"name": "token_k1", "low": 0.5, "high": 2}],
    ...     rejection_mode="replace").rejection
    (RejectionRule(name='token_k1', low=0.5, high=2),)
    >>> preset("no_such_preset")
    Traceback (most recent call last):
    ...
    ValueError: preset 'no_such_preset' is unknown; see corrections.PRESETS for the names.
    >>> preset("decoupled_seq_is_rs", is_treshold=3.0)
    Traceback (most recent call last):
    ...
    ValueError: preset 'decoupled_seq_is_rs': unknown key 'is_treshold'; did you mean 'is_threshold'?
    """
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; see corrections.PRESETS for the names.")
    data = PRESETS[name]
    verl_arguments = set(inspect.signature(VERL_PRESETS[name]).parameters) if name in VERL_PRESETS else set()
    given = {key: overrides.pop(key) for key in list(overrides) if key in verl_arguments}
    for key in overrides:
        if key not in CONFIG_FIELDS:
            raise unknown_key(f"preset {name!r}", key, CONFIG_FIELDS | verl_arguments)
    if given:
        data = config_to_dict(from_verl(VERL_PRESETS[name](**given)))
    if "rejection" in overrides:
        overrides["rejection"] = _merge_rules(list(data.get("rejection", ())), overrides["rejection"],
                                              rejection_mode, name)
    return config_from_dict(_merge(data, overrides))
