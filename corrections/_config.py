"""The frozen, validated configuration of the correction pipeline.

Every field is checked when the config is built, and an error names the field and the fix. A config is
plain data: ``config_from_dict`` builds one from nested dicts (presets, YAML, command lines) and rejects
unknown keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from corrections._objectives import OBJECTIVES, ObjectiveSpec

MODES = ("decoupled", "bypass")
WEIGHT_LEVELS = ("token", "sequence", "geometric")
WEIGHT_OVERFLOWS = ("truncate", "mask")
WEIGHT_NUMERATORS = ("proximal", "current")
GSPO_FORMS = ("token", "sequence")
K1_RULES = ("token_k1", "seq_sum_k1", "seq_mean_k1")
K23_RULES = tuple(f"{agg}_{k}" for k in ("k2", "k3") for agg in ("token", "seq_sum", "seq_mean", "seq_max"))
REJECTION_RULES = ("outlier",) + K1_RULES + K23_RULES
RULE_ALIASES = {"token": "token_k1", "geometric": "seq_mean_k1", "product": "seq_sum_k1"}
REDUCTIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
DENOMINATORS = ("original", "kept")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def _choice(owner: str, field: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{owner}.{field}={value!r} is not an option; use one of {', '.join(options)}.")


def _number(owner: str, field: str, value: object, *, minimum: float = 0.0, strict: bool = False,
            optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{owner}.{field}={value!r} must be a number.")
    if value < minimum or (strict and value == minimum):
        bound = ">" if strict else ">="
        raise ValueError(f"{owner}.{field}={value!r} must be {bound} {minimum}.")


def _flag(owner: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{field}={value!r} must be True or False.")


def _ordered(owner: str, low: float | None, high: float | None, low_name: str = "low",
             high_name: str = "high") -> None:
    if low is not None and high is not None and low > high:
        raise ValueError(f"{owner}: {low_name}={low} > {high_name}={high}; the lower bound must not exceed the upper.")


@dataclasses.dataclass(frozen=True)
class ImportanceWeights:
    """Truncated importance weights between the proximal (or current) policy and the rollout policy.

    >>> ImportanceWeights("sequence", high=5.0).level
    'sequence'
    >>> ImportanceWeights("token", high=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: importance.high=-1.0 must be > 0.0.
    """

    level: str = "token"  # "token": one weight per token; "sequence": exp(sum log-ratio); "geometric": exp(mean).
    high: float | None = 2.0  # upper bound C on the weight; None leaves it uncapped.
    low: float = 0.0  # lower bound on the weight (slime's tis_clip_low; IcePop's lower edge).
    overflow: str = "truncate"  # "truncate": clip to [low, high]; "mask": weight 0 outside [low, high] (IcePop, AReaL).
    batch_normalize: bool = False  # divide by the batch mean weight after truncation (verl, slime).
    # Whose logprobs the weight's numerator holds: "proximal" (the mode's trainer side: recomputed logprobs in
    # decoupled mode, sg(current) in bypass mode) or "current" (always sg(current): slime PR #2084 off_policy_is,
    # one weight for mismatch and staleness, on top of a PPO ratio against the proximal logprobs).
    numerator: str = "proximal"
    # Geometric level only: clamp every token's log-ratio to [-20, 20] before the mean (fw cookbook) instead of
    # clamping the mean (the default). The two differ only where some |log-ratio| > 20.
    clamp_each_token: bool = False

    def __post_init__(self) -> None:
        _choice("importance", "level", self.level, WEIGHT_LEVELS)
        _choice("importance", "overflow", self.overflow, WEIGHT_OVERFLOWS)
        _choice("importance", "numerator", self.numerator, WEIGHT_NUMERATORS)
        _flag("importance", "batch_normalize", self.batch_normalize)
        _flag("importance", "clamp_each_token", self.clamp_each_token)
        if self.clamp_each_token and self.level != "geometric":
            raise ValueError(f"importance.clamp_each_token=True needs level='geometric' (got {self.level!r}): only "
                             "the geometric mean averages log-ratios; drop it or change the level.")
        _number("importance", "high", self.high, strict=True, optional=True)
        _number("importance", "low", self.low)
        _ordered("importance", self.low, self.high)


@dataclasses.dataclass(frozen=True)
class RejectionRule:
    """A rule that drops tokens or whole sequences whose train/rollout ratio is off.

    k1 rules (``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``) keep ``low <= exp(stat) <= high`` where stat is
    the clamped log-ratio ``old - roll`` (per token, summed, or averaged over the sequence): bounds are ratios
    and mean what they say. k2/k3 rules keep ``stat <= high``. ``outlier`` drops a sequence if any valid token
    has ratio ``> high`` or ``< low``. Aliases: ``token`` (token_k1), ``geometric`` (seq_mean_k1),
    ``product`` (seq_sum_k1).

    >>> RejectionRule("geometric", 0.999, 1.001).name, RejectionRule("geometric", 0.999, 1.001).sequence_level
    ('seq_mean_k1', True)
    >>> RejectionRule("geometric", 1.1, 0.9)
    Traceback (most recent call last):
    ...
    ValueError: rejection[seq_mean_k1]: low=1.1 > high=0.9; the lower bound must not exceed the upper.
    """

    name: str  # one of REJECTION_RULES or an alias.
    low: float | None = None  # lower ratio bound (k1 and outlier only).
    high: float | None = None  # upper ratio bound (k1, outlier) or upper statistic bound (k2, k3).

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", RULE_ALIASES.get(self.name, self.name))
        owner = f"rejection[{self.name}]"
        _choice("rejection", "name", self.name, REJECTION_RULES)
        _number(owner, "low", self.low, optional=True)
        _number(owner, "high", self.high, strict=True, optional=True)
        _ordered(owner, self.low, self.high)
        if self.name in K23_RULES:
            if self.low is not None:
                raise ValueError(f"{owner}.low={self.low}: k2/k3 statistics are >= 0; give only high.")
            if self.high is None:
                raise ValueError(f"{owner}.high is required: the rule keeps stat <= high.")
        elif self.low is None and self.high is None:
            raise ValueError(f"{owner}: give low, high or both; a rule with neither keeps everything.")

    @property
    def sequence_level(self) -> bool:
        """Whether the rule decides for a whole sequence."""
        return not self.name.startswith("token")


@dataclasses.dataclass(frozen=True)
class Objective:
    """The per-token policy objective and its constants.

    >>> Objective("ppo", clip_high=0.28, dual_clip=3.0).clip_high
    0.28
    >>> Objective("ppo", dual_clip=0.5)
    Traceback (most recent call last):
    ...
    ValueError: objective.dual_clip=0.5 must be > 1 (verl and SkyRL use 3.0).
    """

    name: str = "ppo"  # a key of corrections.OBJECTIVES.
    clip_low: float = 0.2  # ratio clip 1 - clip_low (PPO, GSPO, CISPO, rollout_is, clip-cov).
    clip_high: float = 0.2  # ratio clip 1 + clip_high (DAPO clip-higher: 0.28).
    dual_clip: float | None = None  # dual-clip constant c > 1 for negative advantages (verl/SkyRL: 3.0).
    log_ratio_cap: float = 10.0  # GSPO: upper cap on the sequence log-ratio.
    tau_pos: float = 1.0  # SAPO temperature for positive advantages.
    tau_neg: float = 1.05  # SAPO temperature for negative advantages.
    clip_cov_ratio: float = 2e-4  # clip-cov: fraction of tokens whose gradient is cut.
    clip_cov_low: float = 1.0  # clip-cov: covariance window lower edge.
    clip_cov_high: float = 5.0  # clip-cov: covariance window upper edge.
    kl_cov_ratio: float = 2e-4  # kl-cov: fraction of tokens that get the |log-ratio| penalty (verl; SkyRL: 0.2).
    kl_cov_coef: float = 1.0  # kl-cov: penalty coefficient.
    # GSPO: "token" (GSPO-token as verl/SkyRL: value sg(s), gradient per token, s over the response mask) or
    # "sequence" (AReaL: s = exp(mean of lp - old over the kept tokens) with the gradient through the mean, spread
    # evenly over the row, and the advantage averaged over the kept tokens).
    gspo_form: str = "token"

    def __post_init__(self) -> None:
        _choice("objective", "name", self.name, tuple(OBJECTIVES))
        _choice("objective", "gspo_form", self.gspo_form, GSPO_FORMS)
        for field in ("clip_low", "clip_high", "log_ratio_cap", "clip_cov_low", "kl_cov_coef"):
            _number("objective", field, getattr(self, field))
        for field in ("tau_pos", "tau_neg", "clip_cov_high"):
            _number("objective", field, getattr(self, field), strict=True)
        for field in ("clip_cov_ratio", "kl_cov_ratio"):
            _number("objective", field, getattr(self, field))
            if getattr(self, field) > 1:
                raise ValueError(f"objective.{field}={getattr(self, field)} is a fraction; give a value in [0, 1].")
        _ordered("objective", self.clip_cov_low, self.clip_cov_high, "clip_cov_low", "clip_cov_high")
        if self.dual_clip is not None:
            _number("objective", "dual_clip", self.dual_clip)
            if self.dual_clip <= 1.0:
                raise ValueError(f"objective.dual_clip={self.dual_clip} must be > 1 (verl and SkyRL use 3.0).")

    @property
    def spec(self) -> ObjectiveSpec:
        """The registry entry of this objective: its loss and the inputs it reads."""
        return OBJECTIVES[self.name]


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """Everything the correction pipeline does to one batch, in the order ``compute`` applies it.

    >>> CorrectionConfig(importance=ImportanceWeights("token", high=2.0)).needs_rollout_logprobs
    True
    >>> CorrectionConfig(mode="bypas")
    Traceback (most recent call last):
    ...
    ValueError: config.mode='bypas' is not an option; use one of decoupled, bypass.
    """

    mode: str = "decoupled"  # "decoupled": ratio vs recomputed proximal logprobs; "bypass": proximal := rollout.
    objective: Objective = Objective()  # the per-token policy loss.
    importance: ImportanceWeights | None = None  # behaviour weights; None for none.
    rejection: tuple[RejectionRule, ...] = ()  # masks, AND-combined: token rules first, then sequence rules.
    opsm_delta: float | None = None  # slime OPSM: drop a sequence with mean A < 0 and mean(old - lp) > delta.
    reduction: str = "token-mean"  # per-token loss -> scalar; one of REDUCTIONS.
    # "original": rejected tokens still count (SkyRL, slime, AReaL); "kept": verl (for seq-mean-token-sum-norm:
    # the rows that kept a token times T, where "original" divides by B * T as the Dr. GRPO paper).
    denominator: str = "original"
    kl_coef: float = 0.0  # weight of the KL penalty to a reference policy (needs ref_logprobs).
    kl_estimator: str = "low_var_kl"  # one of KL_ESTIMATORS.
    entropy_coef: float = 0.0  # entropy bonus weight (needs entropy).
    # slime use_unbiased_kl (DeepSeek-V3.2): the KL term times exp(lp - old) (clamped log, WITH gradient), an
    # estimate of KL(pi || ref) under pi from tokens sampled by old; low_var_kl is clamped after the product.
    kl_importance_weighted: bool = False
    # Value checks (mask is 0/1; logprobs finite, advantages finite where it is 1): None runs them on concrete inputs
    # (eager calls) and skips them under jit; True always, and also bounds logprobs by 1e-3 (under jit wrap the
    # caller with chex.chexify(..., async_check=False) so that the call raises); False never.
    check_values: bool | None = None

    def __post_init__(self) -> None:
        _choice("config", "mode", self.mode, MODES)
        _choice("config", "reduction", self.reduction, REDUCTIONS)
        _choice("config", "denominator", self.denominator, DENOMINATORS)
        _choice("config", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _number("config", "kl_coef", self.kl_coef)
        _number("config", "entropy_coef", self.entropy_coef)
        _number("config", "opsm_delta", self.opsm_delta, optional=True)
        _flag("config", "kl_importance_weighted", self.kl_importance_weighted)
        if not isinstance(self.objective, Objective):
            raise ValueError("config.objective must be an Objective; build nested dicts with config_from_dict.")
        if self.importance is not None and not isinstance(self.importance, ImportanceWeights):
            raise ValueError("config.importance must be an ImportanceWeights or None.")
        object.__setattr__(self, "rejection", tuple(self.rejection))
        if not all(isinstance(rule, RejectionRule) for rule in self.rejection):
            raise ValueError("config.rejection must hold RejectionRule items; build nested dicts with "
                             "config_from_dict.")

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Whether ``compute`` needs the rollout (behaviour) logprobs for this config."""
        uses_rollout = self.objective.spec.reads_rollout  # OPSM reads proximal and current logprobs only
        return self.mode == "bypass" or self.importance is not None or bool(self.rejection) or uses_rollout

    def replace(self, **changes: Any) -> CorrectionConfig:
        """A copy with top-level fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)


_Config = TypeVar("_Config", ImportanceWeights, RejectionRule, Objective, CorrectionConfig)


def _build(cls: type[_Config], owner: str, data: object) -> _Config:
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{owner} must be a mapping of fields, got {type(data).__name__}.")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{owner}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}.")
    return cls(**data)


def config_from_dict(data: Mapping[str, Any]) -> CorrectionConfig:
    """Builds a validated ``CorrectionConfig`` from nested plain data.

    >>> config_from_dict({"importance": {"level": "token", "high": 2.0}}).importance.high
    2.0
    >>> config_from_dict({"clip": 0.2})
    Traceback (most recent call last):
    ...
    ValueError: config: unknown field(s) clip; known: check_values, denominator, entropy_coef, importance, kl_coef,
    kl_estimator, kl_importance_weighted, mode, objective, opsm_delta, reduction, rejection.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"config must be a mapping of fields, got {type(data).__name__}.")
    data = dict(data)
    if "objective" in data:
        data["objective"] = _build(Objective, "objective", data["objective"])
    if data.get("importance") is not None:
        data["importance"] = _build(ImportanceWeights, "importance", data["importance"])
    if "rejection" in data:
        data["rejection"] = tuple(_build(RejectionRule, "rejection", rule) for rule in data["rejection"])
    return _build(CorrectionConfig, "config", data)


def config_to_dict(config: CorrectionConfig) -> dict[str, Any]:
    """The nested plain-data form of a config (inverse of ``config_from_dict``).

    >>> data = config_to_dict(CorrectionConfig(objective=Objective("cispo")))
    >>> data["objective"]["name"], config_from_dict(data) == CorrectionConfig(objective=Objective("cispo"))
    ('cispo', True)
    """
    data = dataclasses.asdict(config)
    data["rejection"] = [dict(rule) for rule in data["rejection"]]
    return data
