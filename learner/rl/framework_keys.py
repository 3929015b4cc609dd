"""What a verl, SkyRL, slime or AReaL config's keys become in a Tether run: the loss field a key sets, the
run-config key a training setting maps to (epochs, mini-batches, optimizer and schedule, gradient clipping,
sampling), or why a setting that changes training is not followed. One row per key (``rows``);
``learner.rl.framework_config`` builds a run's mapping from them.

The loss itself is the front doors' (``corrections.from_verl`` & co), which list the keys outside the loss they do
not apply (``corrections.TrainingKeysWarning``); these tables give those keys their meaning in a run.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["BETAS", "GRPO", "KL_IN_REWARD", "MAPS", "NOT_USED", "FrameworkMap", "NotApplied", "Row", "rows",
           "with_defaults"]

NOT_USED = "not used"


class NotApplied(Exception):
    """A mapped setting whose value Tether cannot follow: the message says why."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One key of the framework's file and what Tether made of it."""

    key: str  # their key (dotted; slime's --argument)
    value: Any
    tether: str  # "corrections.<field>", a run-config key, "not applied: why" or "not used"
    default: bool = False  # the file does not set the key: the framework's default


# --- What each framework's keys become ----------------------------------------------------------------------------
# loss: their key (or a block of keys) -> the CorrectionConfig field it sets. run: their key -> (run-config key,
# convert(value, get)), where get(key) reads another key of the file. differs: their key -> (does this value change
# training away from what Tether does?, why Tether does not follow it).

Get = Callable[[str], Any]


def _number(kind):
    return lambda value, get: kind(float(value))


def _top_k(value, get: Get) -> int:
    return max(int(value), 0)  # verl, SkyRL, slime: -1 is off; Tether: 0


def _minibatches(batch_key: str, scale_keys: tuple[str, ...] = ()):
    """Optimizer updates per epoch: their batch (prompts, or samples with ``scale_keys``) over their mini-batch."""

    def convert(value, get: Get) -> int:
        batch = get(batch_key)
        for key in scale_keys:
            batch = None if batch is None or get(key) is None else batch * get(key)
        if batch is None:
            raise NotApplied(f"needs {batch_key}; update.num_minibatches keeps the run config's value (set it)")
        if not value or batch % value:
            product = " x ".join((batch_key, *scale_keys))
            raise NotApplied(f"{product} = {batch} is not a multiple of it, so it gives no whole number of "
                             "mini-batches; update.num_minibatches keeps the run config's value (set it)")
        return int(batch // value)

    return convert


def _cosine_end(lr_key: str, ratio_key: str | None = None, end_key: str | None = None):
    """``optimizer.end_learning_rate`` of a schedule name: constant -> None (constant), cosine -> the end rate."""

    def convert(value, get: Get):
        name = str(value).lower()
        if name.startswith("constant"):
            return None
        if name.startswith("cosine"):
            return float(get(end_key) or 0.0) if end_key else float(get(lr_key)) * float(get(ratio_key) or 0.0)
        raise NotApplied(f"Tether's schedule is warmup then constant or cosine, not {value!r}")

    return convert


def _warmup(ratio_key: str | None):
    def convert(value, get: Get) -> int:
        steps = int(float(value))
        if steps >= 0:
            return steps
        if ratio_key is None or not float(get(ratio_key) or 0.0):
            return 0
        raise NotApplied(f"a warmup given as {ratio_key}; set optimizer.warmup_steps (optimizer updates)")

    return convert


def _not_zero(value) -> bool:
    return bool(value) and float(value) != 0.0


GRPO = "Tether computes GRPO advantages (learner/rl/batch_assembly.py; corrections.grpo_advantages)"
KL_IN_REWARD = "Tether has no KL penalty in the reward; use the KL loss instead"
BETAS = "Tether's AdamW uses betas (0.9, 0.999)"


@dataclasses.dataclass(frozen=True)
class FrameworkMap:
    loss: Mapping[str, str]
    # their key -> Tether's key (its value converted by _CONVERT), or (Tether's key, a converter of its own)
    run: Mapping[str, str | tuple[str, Callable]]
    differs: Mapping[str, tuple[Callable[[Any], bool], str]]
    # their key -> the framework's default, for every key of run and differs (and those their converters read): a
    # file that leaves a key out trains as the framework would. Empty: Tether's values stay for keys left out.
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _actor(key: str) -> str:
    return f"actor_rollout_ref.actor.{key}"


VERL_LOSS = {
    "algorithm.rollout_correction.rollout_is": "importance.level",
    "algorithm.rollout_correction.rollout_is_threshold": "importance.low/high",
    "algorithm.rollout_correction.rollout_is_batch_normalize": "importance.batch_normalize",
    "algorithm.rollout_correction.rollout_rs": "rejection",
    "algorithm.rollout_correction.rollout_rs_threshold": "rejection (bounds)",
    "algorithm.rollout_correction.bypass_mode": "mode",
    "algorithm.rollout_correction.loss_type": "objective.name",
    _actor("clip_ratio"): "objective.clip_low/high", _actor("clip_ratio_low"): "objective.clip_low",
    _actor("clip_ratio_high"): "objective.clip_high", _actor("clip_ratio_c"): "objective.dual_clip",
    _actor("tau_pos"): "objective.tau_pos", _actor("tau_neg"): "objective.tau_neg", _actor("policy_loss"): "objective",
    _actor("loss_agg_mode"): "reduction", _actor("loss_scale_factor"): "reduction",
    _actor("entropy_coeff"): "entropy_coef", _actor("use_kl_loss"): "kl_coef", _actor("kl_loss_coef"): "kl_coef",
    _actor("kl_loss_type"): "kl_estimator",
}
# How a framework's value becomes a Tether key's where it is a plain number (or top_k), whichever framework it is from.
_CONVERT: dict[str, Callable] = {
    **dict.fromkeys(("update.ppo_epochs", "update.num_minibatches", "rollout.num_samples", "rollout.prompts_per_step",
                     "rollout.max_new_tokens", "loop.steps"), _number(int)),
    **dict.fromkeys(("optimizer.learning_rate", "optimizer.weight_decay", "optimizer.max_grad_norm",
                     "rollout.temperature", "rollout.top_p", "rollout.min_p"), _number(float)),
    "rollout.top_k": _top_k,
}

VERL = FrameworkMap(
    loss=VERL_LOSS,
    run={
        _actor("ppo_epochs"): "update.ppo_epochs",
        _actor("ppo_mini_batch_size"): ("update.num_minibatches", _minibatches("data.train_batch_size")),
        _actor("optim.lr"): "optimizer.learning_rate",
        _actor("optim.weight_decay"): "optimizer.weight_decay",
        _actor("optim.lr_warmup_steps"): ("optimizer.warmup_steps", _warmup(_actor("optim.lr_warmup_steps_ratio"))),
        _actor("optim.lr_scheduler_type"): ("optimizer.end_learning_rate",
                                            _cosine_end(_actor("optim.lr"), _actor("optim.min_lr_ratio"))),
        _actor("grad_clip"): "optimizer.max_grad_norm",
        "actor_rollout_ref.rollout.n": "rollout.num_samples",
        "actor_rollout_ref.rollout.temperature": "rollout.temperature",
        "actor_rollout_ref.rollout.top_p": "rollout.top_p",
        "actor_rollout_ref.rollout.top_k": "rollout.top_k",
        "data.train_batch_size": "rollout.prompts_per_step",
        "data.max_response_length": "rollout.max_new_tokens",
        "trainer.total_training_steps": "loop.steps",
    },
    differs={
        "algorithm.adv_estimator": (lambda v: v != "grpo", GRPO),
        "algorithm.norm_adv_by_std_in_grpo": (lambda v: v is not True, GRPO + ", divided by the group std"),
        "algorithm.use_kl_in_reward": (bool, KL_IN_REWARD + " (use_kl_loss)"),
        _actor("optim.betas"): (lambda v: list(v) != [0.9, 0.999], BETAS),
        _actor("optim.lr_warmup_steps_ratio"): (_not_zero, "set optimizer.warmup_steps (optimizer updates)"),
    },
    # verl's resolved defaults at b178a3cd (tests/fixtures/frameworks/verl/_generated_ppo_trainer.yaml).
    defaults={
        _actor("ppo_epochs"): 1, _actor("ppo_mini_batch_size"): 256, _actor("optim.lr"): 1e-6,
        _actor("optim.weight_decay"): 0.01, _actor("optim.lr_warmup_steps"): -1,
        _actor("optim.lr_warmup_steps_ratio"): 0.0, _actor("optim.lr_scheduler_type"): "constant",
        _actor("optim.min_lr_ratio"): 0.0, _actor("optim.betas"): [0.9, 0.999], _actor("grad_clip"): 1.0,
        "actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.rollout.temperature": 1.0,
        "actor_rollout_ref.rollout.top_p": 1, "actor_rollout_ref.rollout.top_k": -1, "data.train_batch_size": 1024,
        "data.max_response_length": 512, "trainer.total_training_steps": None, "algorithm.adv_estimator": "gae",
        "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.use_kl_in_reward": False,
    },
)


def _skyrl_algorithm(key: str) -> str:
    return f"trainer.algorithm.{key}"


SKYRL = FrameworkMap(
    loss={**{_skyrl_algorithm(k): f for k, f in dict(
        policy_loss_type="objective.name", loss_reduction="reduction", eps_clip_low="objective.clip_low",
        eps_clip_high="objective.clip_high", clip_ratio_c="objective.dual_clip", use_kl_loss="kl_coef",
        kl_loss_coef="kl_coef", kl_estimator_type="kl_estimator", use_entropy_loss="entropy_coef",
        entropy_loss_coef="entropy_coef", tis_imp_ratio_cap="importance.high", use_tis="importance",
        max_seq_len="reduction", off_policy_correction="importance, rejection", sapo="objective",
        clip_cov="objective", kl_cov="objective", cispo="objective", dppo="objective").items()}},
    run={
        "trainer.update_epochs_per_batch": "update.ppo_epochs",
        "trainer.policy_mini_batch_size": ("update.num_minibatches", _minibatches("trainer.train_batch_size")),
        "trainer.train_batch_size": "rollout.prompts_per_step",
        "trainer.policy.optimizer_config.lr": "optimizer.learning_rate",
        "trainer.policy.optimizer_config.weight_decay": "optimizer.weight_decay",
        "trainer.policy.optimizer_config.max_grad_norm": "optimizer.max_grad_norm",
        "trainer.policy.optimizer_config.num_warmup_steps": ("optimizer.warmup_steps", _warmup(None)),
        "trainer.policy.optimizer_config.scheduler": ("optimizer.end_learning_rate",
                                                      _cosine_end("trainer.policy.optimizer_config.lr")),
        "generator.n_samples_per_prompt": "rollout.num_samples",
        "generator.sampling_params.temperature": "rollout.temperature",
        "generator.sampling_params.top_p": "rollout.top_p",
        "generator.sampling_params.top_k": "rollout.top_k",
        "generator.sampling_params.min_p": "rollout.min_p",
        "generator.sampling_params.max_generate_length": "rollout.max_new_tokens",
    },
    differs={
        _skyrl_algorithm("advantage_estimator"): (lambda v: v != "grpo", GRPO),
        _skyrl_algorithm("grpo_norm_by_std"): (lambda v: v is not True, GRPO + ", divided by the group std"),
        _skyrl_algorithm("use_kl_in_reward"): (bool, KL_IN_REWARD + " (use_kl_loss)"),
        "trainer.policy.optimizer_config.adam_betas": (lambda v: list(v) != [0.9, 0.999], BETAS),
    },
    # SkyRL's defaults at 8d14ff7c, its last YAML (tests/fixtures/frameworks/skyrl/ppo_base_config.yaml).
    defaults={
        "trainer.update_epochs_per_batch": 1, "trainer.policy_mini_batch_size": 256, "trainer.train_batch_size": 1024,
        "trainer.policy.optimizer_config.lr": 1e-6, "trainer.policy.optimizer_config.weight_decay": 1e-2,
        "trainer.policy.optimizer_config.max_grad_norm": 1.0, "trainer.policy.optimizer_config.num_warmup_steps": 0,
        "trainer.policy.optimizer_config.scheduler": "constant_with_warmup",
        "trainer.policy.optimizer_config.adam_betas": [0.9, 0.999], "generator.n_samples_per_prompt": 5,
        "generator.sampling_params.temperature": 1.0, "generator.sampling_params.top_p": 1.0,
        "generator.sampling_params.top_k": -1, "generator.sampling_params.min_p": 0.0,
        "generator.sampling_params.max_generate_length": 1024, _skyrl_algorithm("advantage_estimator"): "grpo",
        _skyrl_algorithm("grpo_norm_by_std"): True, _skyrl_algorithm("use_kl_in_reward"): False,
    },
)

SLIME = FrameworkMap(
    loss={key: field for key, field in dict(
        advantage_estimator="objective.name", loss_type="objective", eps_clip="objective.clip_low/high",
        eps_clip_high="objective.clip_high", eps_clip_c="objective.dual_clip",
        calculate_per_token_loss="reduction", use_tis="importance", tis_clip="importance.high",
        tis_clip_low="importance.low", custom_tis_function_path="importance.overflow/numerator",
        use_rollout_logprobs="mode", use_opsm="opsm_delta", opsm_delta="opsm_delta", use_kl_loss="kl_coef",
        kl_loss_coef="kl_coef", kl_loss_type="kl_estimator", use_unbiased_kl="kl_importance_weighted",
        entropy_coef="entropy_coef", custom_loss_function_path="objective",
        custom_pg_loss_reducer_function_path="reduction").items()},
    run={
        "lr": "optimizer.learning_rate",
        "weight_decay": "optimizer.weight_decay",
        "clip_grad": "optimizer.max_grad_norm",
        "lr_warmup_iters": ("optimizer.warmup_steps", _warmup(None)),
        "lr_decay_style": ("optimizer.end_learning_rate", _cosine_end("lr", end_key="min_lr")),
        "n_samples_per_prompt": "rollout.num_samples",
        "rollout_batch_size": "rollout.prompts_per_step",
        "global_batch_size": ("update.num_minibatches", _minibatches("rollout_batch_size", ("n_samples_per_prompt",))),
        "rollout_temperature": "rollout.temperature",
        "rollout_top_p": "rollout.top_p",
        "rollout_top_k": "rollout.top_k",
        "rollout_max_response_len": "rollout.max_new_tokens",
        "num_rollout": "loop.steps",
    },
    differs={
        "advantage_estimator": (lambda v: v not in ("grpo", "gspo", "cispo"), GRPO),
        "disable_grpo_std_normalization": (bool, GRPO + ", divided by the group std"),
        "kl_coef": (_not_zero, KL_IN_REWARD + " (--use-kl-loss)"),
        "adam_beta1": (lambda v: float(v) != 0.9, BETAS),
        "adam_beta2": (lambda v: float(v) != 0.999, BETAS),
        "optimizer": (lambda v: v != "adam", "Tether's optimizer is AdamW"),
    },
)


def _areal_actor(key: str) -> str:
    return f"actor.{key}"


AREAL = FrameworkMap(
    loss={_areal_actor(k): f for k, f in dict(
        eps_clip="objective.clip_low/high", eps_clip_higher="objective.clip_high", c_clip="objective.dual_clip",
        use_decoupled_loss="mode", recompute_logprob="mode", rejection_sampling="importance, rejection",
        importance_sampling_level="objective", use_sapo_loss="objective", sapo_tau_pos="objective.tau_pos",
        sapo_tau_neg="objective.tau_neg", prox_logp_method="mode", m2_threshold="rejection").items()},
    run={
        "actor.ppo_n_minibatches": "update.num_minibatches",
        "actor.optimizer.lr": "optimizer.learning_rate",
        "actor.optimizer.weight_decay": "optimizer.weight_decay",
        "actor.optimizer.gradient_clipping": "optimizer.max_grad_norm",
        "actor.optimizer.lr_scheduler_type": ("optimizer.end_learning_rate",
                                              _cosine_end("actor.optimizer.lr", "actor.optimizer.min_lr_ratio")),
        "gconfig.n_samples": "rollout.num_samples",
        "gconfig.temperature": "rollout.temperature",
        "gconfig.top_p": "rollout.top_p",
        "gconfig.top_k": "rollout.top_k",
        "gconfig.max_new_tokens": "rollout.max_new_tokens",
        "train_dataset.batch_size": "rollout.prompts_per_step",
    },
    differs={
        "actor.kl_ctl": (_not_zero, KL_IN_REWARD),
        "actor.optimizer.warmup_steps_proportion": (_not_zero, "set optimizer.warmup_steps (optimizer updates)"),
        "actor.optimizer.beta1": (lambda v: float(v) != 0.9, BETAS),
        "actor.optimizer.beta2": (lambda v: float(v) != 0.999, BETAS),
        "actor.optimizer.type": (lambda v: v not in ("adam", "adamw"), "Tether's optimizer is AdamW"),
    },
)

MAPS = {"verl": VERL, "skyrl": SKYRL, "slime": SLIME, "areal": AREAL}


def _lookup(data: Mapping) -> Get:
    def get(key: str):
        node: Any = data
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    return get


def with_defaults(framework: str, data: Mapping) -> tuple[dict, set[str]]:
    """``data`` (nested, whole) with the framework's default for each mapped key it leaves out, and those keys."""
    out, added = copy.deepcopy(dict(data)), set()
    for key, value in MAPS[framework].defaults.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break  # the file gives a value where the framework has a section: its front door says so
        else:
            if leaf not in node:
                node[leaf] = copy.copy(value)
                added.add(key)
    return out, added


def rows(framework: str, data: Mapping, unknown: set[str], defaults: bool = False) -> tuple[list[Row], dict[str, Any]]:
    """One row per key (a block outside the loss and the run mapping is one row), and the run-config values.
    ``defaults``: the mapped keys ``data`` leaves out take the framework's defaults (rows marked ``default``)."""
    spec = MAPS[framework]
    mapped = set(spec.loss) | set(spec.run) | set(spec.differs)
    data, added = with_defaults(framework, data) if defaults else (data, set())
    get = _lookup(data)
    rows, run = [], {}

    def shown(key: str) -> str:
        return f"--{key.replace('_', '-')}" if framework == "slime" else key

    def add(path: str, value, tether: str) -> None:
        rows.append(Row(shown(path), value, tether, default=path in added))

    def visit(node: Mapping, prefix: str):
        for key, value in node.items():
            path = f"{prefix}{key}"
            owner = next((k for k in spec.loss if path == k or path.startswith(f"{k}.")), None)
            if owner is not None:
                add(path, value, f"corrections.{spec.loss[owner]}")
            elif path in spec.run:
                entry = spec.run[path]
                target, convert = entry if isinstance(entry, tuple) else (entry, _CONVERT[entry])
                if value is None:
                    add(path, value, f"{NOT_USED} (null: Tether's {target} stays)")
                    continue
                try:
                    run[target] = convert(value, get)
                    add(path, value, target)
                except NotApplied as why:
                    add(path, value, f"not applied: {why}")
                except (TypeError, ValueError):  # text where a number goes: a variable the script does not set?
                    raise ValueError(f"{shown(path)}={value!r}: not a value for {target}.") from None
            elif path in spec.differs:
                changes, why = spec.differs[path]
                add(path, value, f"not applied: {why}" if changes(value) else f"{NOT_USED} (Tether does the same)")
            elif isinstance(value, Mapping) and any(k.startswith(f"{path}.") for k in mapped):
                visit(value, f"{path}.")
            elif key == "defaults":
                add(path, value, f"{NOT_USED} as files (Hydra defaults, not composed): the framework's stock entries "
                                 "of the loss blocks are read as its defaults (the loss table shows their values); "
                                 "other entries fill blocks outside the loss")
            else:
                note = " (unknown to Tether's reader)" if any(u == path or u.startswith(f"{path}.")
                                                              for u in unknown) else ""
                add(path, value, NOT_USED + note)

    visit(data, "")
    return rows, run
