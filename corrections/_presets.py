"""Named presets: plain data (nested dicts) that ``preset`` turns into a validated ``CorrectionConfig``.

verl's presets keep verl's names and defaults; the other frameworks' settings have one-line equivalents
named after the framework. Bounds mean what they say (``low <= ratio <= high``); see ``verl_rejection_rules``
for reproducing verl's inverted k1 bounds on purpose.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from corrections._config import CorrectionConfig, config_from_dict

_VERL = {"denominator": "kept", "objective": {"name": "ppo", "dual_clip": 3.0}}
_VERL_BYPASS_PG = {"mode": "bypass", "denominator": "kept", "objective": {"name": "reinforce"}}
_TOKEN_IS = {"level": "token", "high": 2.0}
_SEQ_IS = {"level": "sequence", "high": 2.0}
_GEO_RS = {"name": "seq_mean_k1", "low": 0.999, "high": 1.001}
_K3_RS = {"name": "seq_mean_k3", "high": 0.01}
_ICEPOP = {"level": "token", "low": 0.5, "high": 5.0, "overflow": "mask"}


def _merge(base: Mapping[str, Any], *updates: Mapping[str, Any]) -> dict:
    out = copy.deepcopy(dict(base))
    for update in updates:
        for key, value in update.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = _merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


PRESETS: dict[str, dict] = {
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
    # SkyRL's off_policy_correction block (original-mask denominator, dual clip 3.0).
    "skyrl_token_tis": {"objective": {"dual_clip": 3.0}, "importance": {"level": "token", "high": 2.0}},
    "skyrl_sequence_tis": {"objective": {"dual_clip": 3.0}, "importance": {"level": "sequence", "high": 5.0}},
    "skyrl_token_mask": {"objective": {"dual_clip": 3.0}, "rejection": [{"name": "token_k1", "low": 0.5, "high": 2.0}]},
    "skyrl_outlier_mask": {
        "objective": {"dual_clip": 3.0},
        "rejection": [{"name": "outlier", "low": 1e-4, "high": 100.0}],
    },
    "skyrl_geometric_mask": {
        "objective": {"dual_clip": 3.0},
        "rejection": [{"name": "seq_mean_k1", "low": 0.99, "high": 1.01}],
    },
    "skyrl_product_mask": {
        "objective": {"dual_clip": 3.0},
        "rejection": [{"name": "seq_sum_k1", "low": 0.5, "high": 2.0}],
    },
    "skyrl_rollout_is": {"objective": {"name": "rollout_is"}},
    "skyrl_cispo": {"objective": {"name": "cispo", "clip_low": 1.0, "clip_high": 4.0}},
    # slime: --use-tis (vanilla_tis, clamp [0, 2]), icepop, --use-opsm, off_policy_is (PR #2084). Token-mean is
    # slime's --calculate-per-token-loss; its default per-sample mean is reduction="seq-mean-token-mean".
    "slime_tis": {"importance": {"level": "token", "low": 0.0, "high": 2.0}},
    "slime_icepop": {"importance": _ICEPOP},
    "slime_opsm": {"opsm_delta": 1e-4},
    # off_policy_is clamps to [1 - eps_clip, 1 + eps_clip_high]: slime's default 0.2 gives [0.8, 1.2]; its CISPO
    # recipe (--eps-clip 1.0) is importance={"low": 0.0, "high": 2.0}.
    "slime_off_policy_is": {
        "mode": "bypass",
        "objective": {"name": "reinforce"},
        "importance": {"level": "token", "low": 0.8, "high": 1.2},
    },
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


def preset(name: str, **overrides: Any) -> CorrectionConfig:
    """The config of a named preset, with top-level fields overridden; dict values merge into nested fields.

    >>> preset("decoupled_token_is", importance={"high": 3.0}).importance
    ImportanceWeights(level='token', high=3.0, low=0.0, overflow='truncate', batch_normalize=False)
    >>> preset("no_such_preset")
    Traceback (most recent call last):
    ...
    ValueError: preset 'no_such_preset' is unknown; see corrections.PRESETS for the names.
    """
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; see corrections.PRESETS for the names.")
    return config_from_dict(_merge(PRESETS[name], overrides))
