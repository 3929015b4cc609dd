"""slime's algorithm arguments, parsed into a ``CorrectionConfig``: for users who come from slime.

Argument names, defaults and meanings are slime's at commit 624b824a (``slime/utils/arguments.py``,
``add_algo_arguments``; ``slime/backends/megatron_utils/loss.py``, ``policy_loss_function``), plus
``off_policy_is_function`` of slime PR #2084 (commit 8e0d556e). slime reduces by per-sample means
(``--calculate-per-token-loss`` for the token mean), divides by the ORIGINAL token counts, and applies TIS / IcePop
weights after the clipped loss.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from corrections._config import CorrectionConfig, ImportanceWeights, Objective
from corrections.frameworks._keys import check_keys, choice, merge_disjoint, unsupported, warn_ignored

ARGUMENTS = dict(
    advantage_estimator="grpo", loss_type="policy_loss", eps_clip=0.2, eps_clip_high=None, eps_clip_c=None,
    calculate_per_token_loss=False, use_tis=False, tis_clip=2.0, tis_clip_low=0.0, custom_tis_function_path=None,
    use_rollout_logprobs=False, use_opsm=False, opsm_delta=1e-4, use_kl_loss=False, kl_loss_coef=0.0,
    kl_loss_type="k1", use_unbiased_kl=False, entropy_coef=0.0, custom_loss_function_path=None,
    custom_pg_loss_reducer_function_path=None,
)
FLAGS = frozenset(("calculate_per_token_loss", "use_tis", "use_rollout_logprobs", "use_opsm", "use_kl_loss",
                   "use_unbiased_kl", "get_mismatch_metrics", "normalize_advantages", "disable_grpo_std_normalization",
                   "disable_rewards_normalization", "use_rollout_entropy", "reset_optimizer_states",
                   "use_stateless_adam", "use_routing_replay", "use_rollout_routing_replay",
                   "disable_compute_advantages_and_returns"))
# Arguments of slime's algorithm group that do not change the loss: optimizer, advantages and rewards, the critic,
# metrics-only switches (Tether always reports the mismatch metrics when rollout logprobs are given).
IGNORED = frozenset((
    "seed", "clip_grad", "lr", "save_hf", "num_critic_only_steps", "megatron_config_path", "value_clip", "kl_coef",
    "gamma", "lambd", "normalize_advantages", "disable_grpo_std_normalization", "grpo_std_normalization",
    "disable_rewards_normalization", "rewards_normalization", "use_rollout_entropy", "get_mismatch_metrics",
    "reset_optimizer_states", "use_stateless_adam", "use_routing_replay", "use_rollout_routing_replay",
    "ref_update_interval", "disable_compute_advantages_and_returns", "compute_advantages_and_returns",
    "custom_advantage_function_path",
))
ESTIMATORS = {"grpo": "ppo", "reinforce_plus_plus": "ppo", "reinforce_plus_plus_baseline": "ppo", "ppo": "ppo",
              "gspo": "gspo", "cispo": "cispo"}
KL_LOSS_TYPES = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "low_var_kl"}


class TisFields(TypedDict, total=False):
    """The ``ImportanceWeights`` fields a TIS function sets."""

    overflow: str
    numerator: str


# slime's TIS functions: vanilla TIS (default) and IcePop in loss.py, and PR #2084's off_policy_is_function in
# ppo_utils.py, whose weight holds the current policy sg(lp) instead of the recomputed one.
TIS_FUNCTIONS: dict[str, TisFields] = {
    "vanilla_tis_function": dict(overflow="truncate"),
    "icepop_function": dict(overflow="mask"),
    "off_policy_is_function": dict(overflow="truncate", numerator="current"),
}


def _name(key: str) -> str:
    """``--tis-clip``, ``tis-clip`` and ``tis_clip`` all name the argument ``tis_clip``."""
    return key.lstrip("-").replace("-", "_")


def _parse_argv(tokens: Sequence[str]) -> dict[str, Any]:
    """Command-line tokens (``--use-tis --tis-clip 2.0``) as a dict; values are parsed as numbers where they are."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ValueError(f"slime: {token!r} is not an argument; arguments start with '--'.")
        name = _name(token.split("=", 1)[0])
        values: list[str] = []
        i += 1
        while "=" not in token and name not in FLAGS and i < len(tokens) and not tokens[i].startswith("--"):
            values, i = values + [tokens[i]], i + 1  # an nargs='+' argument takes several
        value: str | bool | list[str]
        if "=" in token:
            value = token.split("=", 1)[1]
        elif name in ARGUMENTS and name not in FLAGS and not values:
            raise ValueError(f"slime: {token} needs a value.")
        elif name in FLAGS or not values:
            value = True  # a flag: slime's store_true arguments (those of other groups are read the same way)
        else:
            value = values[0] if len(values) == 1 else values
        out = merge_disjoint(out, {name: _value(value)}, "slime")
    return out


def _value(value: object) -> object:
    """A command-line value as slime's argparse reads it: numbers parsed, ``None`` as None, other text kept."""
    if not isinstance(value, str):
        return value
    try:
        return float(value) if any(c in value for c in ".eE") else int(value)
    except ValueError:
        return None if value == "None" else value


def slime_arguments(config: Mapping[str, Any] | str | Sequence[str] | None) -> dict[str, Any]:
    """slime's arguments (a mapping, a command-line string or a list of tokens) as ``{flag name: value}``."""
    if config is None:
        return {}
    if isinstance(config, str):
        return _parse_argv(shlex.split(config))
    if isinstance(config, Mapping):
        out: dict[str, Any] = {}
        for key, value in config.items():
            out = merge_disjoint(out, {_name(key): _value(value)}, "slime")
        return out
    if isinstance(config, Sequence):
        return _parse_argv(list(config))
    raise ValueError(f"slime arguments must be a mapping, a command-line string or a list of tokens, got "
                     f"{type(config).__name__}.")


def _tis_function(path: str | None) -> TisFields:
    """The ``ImportanceWeights`` fields of ``--custom-tis-function-path`` (None: slime's vanilla TIS)."""
    function = "vanilla_tis_function" if path is None else path.replace(":", ".").rsplit(".", 1)[-1]
    if function not in TIS_FUNCTIONS:
        raise unsupported("slime", "custom_tis_function_path", path, "only slime's vanilla_tis_function and "
                          "icepop_function translate; a custom function cannot be read from its path.")
    return TIS_FUNCTIONS[function]


def from_slime(config: Mapping[str, Any] | str | Sequence[str] | None = None, /, **keys: Any) -> CorrectionConfig:
    """The ``CorrectionConfig`` of slime's algorithm arguments: slime 624b824a's losses.

    Takes the arguments as a command line (``"--use-tis --tis-clip 2.0"`` or its tokens, as in a slime launch
    script), or as a mapping / keyword arguments keyed ``--tis-clip``, ``tis-clip`` or ``tis_clip``; flags
    (``--use-tis``) take True. Missing arguments take slime's defaults. Read: ``--advantage-estimator`` (gspo and
    cispo choose the objective), ``--eps-clip``, ``--eps-clip-high``, ``--eps-clip-c``,
    ``--calculate-per-token-loss``, ``--use-tis`` with ``--tis-clip``, ``--tis-clip-low`` and
    ``--custom-tis-function-path`` (slime's vanilla TIS, IcePop, or PR #2084's off_policy_is_function),
    ``--use-rollout-logprobs``, ``--use-opsm``,
    ``--opsm-delta``, the KL loss and ``--entropy-coef``. Arguments of slime's algorithm group that do not touch
    the loss are accepted and not applied, and listed in one ``TrainingKeysWarning``; unknown ones are listed
    (``UnknownKeyWarning``), or raise, naming the nearest match, when close to a loss argument.
    docs/from-other-frameworks.md has the table.

    OPSM here is the sequence-level decision of slime PR #1917 (slime 624b824a decides per token).

    >>> config = from_slime("--use-tis --tis-clip 2.0 --eps-clip 0.2 --eps-clip-high 0.28")
    >>> config.importance.high, config.objective.clip_high, config.reduction
    (2.0, 0.28, 'seq-mean-token-mean')
    >>> from_slime({"--tis-clp": 3.0})
    Traceback (most recent call last):
    ...
    ValueError: slime: unknown key 'tis_clp'; did you mean 'tis_clip'?
    """
    where = "slime"
    given = merge_disjoint(slime_arguments(config), slime_arguments(keys), where)
    check_keys(given, set(ARGUMENTS) | IGNORED, where, ARGUMENTS)
    warn_ignored("slime", {f"--{key.replace('_', '-')}": value for key, value in given.items() if key in IGNORED})
    args = {**ARGUMENTS, **{k: v for k, v in given.items() if k in ARGUMENTS}}
    for key in ("custom_loss_function_path", "custom_pg_loss_reducer_function_path"):
        if args[key] is not None:
            raise unsupported(where, key, args[key], "a custom function cannot be read from its path.")
    choice(where, "loss_type", args["loss_type"], {"policy_loss": None},
           {"sft_loss": "use corrections.cross_entropy_loss for SFT.",
            "custom_loss": "a custom function cannot be read from its path."})
    low = args["eps_clip"]
    high = low if args["eps_clip_high"] is None else args["eps_clip_high"]
    name = choice(where, "advantage_estimator", args["advantage_estimator"], ESTIMATORS)
    if name != "ppo" and args["eps_clip_c"] is not None:
        raise unsupported(where, "eps_clip_c", args["eps_clip_c"], f"dual clip is implemented for PPO, not {name}.")
    dual = {"dual_clip": args["eps_clip_c"]} if name == "ppo" else {}
    objective = Objective(name, clip_low=low, clip_high=high, **dual)
    importance = None
    if args["use_tis"]:
        importance = ImportanceWeights("token", high=args["tis_clip"], low=args["tis_clip_low"],
                                       **_tis_function(args["custom_tis_function_path"]))
    return CorrectionConfig(
        mode="bypass" if args["use_rollout_logprobs"] else "decoupled",
        objective=objective,
        importance=importance,
        opsm_delta=args["opsm_delta"] if args["use_opsm"] else None,
        reduction="token-mean" if args["calculate_per_token_loss"] else "seq-mean-token-mean",
        denominator="original",
        kl_coef=float(args["kl_loss_coef"]) if args["use_kl_loss"] else 0.0,
        kl_estimator=choice(where, "kl_loss_type", args["kl_loss_type"], KL_LOSS_TYPES),
        entropy_coef=float(args["entropy_coef"]),
        kl_importance_weighted=bool(args["use_unbiased_kl"]),
    )
