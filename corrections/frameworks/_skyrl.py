"""SkyRL's ``trainer.algorithm`` settings, parsed into a ``CorrectionConfig``: for users who come from SkyRL.

Key names, defaults and meanings are SkyRL's at commit a9564572 (``skyrl/train/config/config.py``,
``AlgorithmConfig`` and ``OffPolicyCorrectionConfig``). SkyRL divides by the ORIGINAL token count after its
off-policy masks (``denominator="original"``) and applies dual clip only with ``policy_loss_type="dual_clip"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from corrections._config import CorrectionConfig, ImportanceWeights, Objective, RejectionRule
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

OFF_POLICY_CORRECTION = dict(
    tis_ratio_type=None, token_tis_ratio_clip_high=2.0, sequence_tis_ratio_clip_high=5.0, sequence_mask_metric=None,
    geo_mask_high=1.01, geo_mask_low=0.99, product_mask_high=2.0, product_mask_low=0.5,
    outlier_token_is_threshold_low=None, outlier_token_is_threshold_high=None, token_mask_is_threshold_low=None,
    token_mask_is_threshold_high=None,
)
ALGORITHM = dict(
    policy_loss_type="regular", loss_reduction="token_mean", eps_clip_low=0.2, eps_clip_high=0.2, clip_ratio_c=3.0,
    use_kl_loss=True, kl_loss_coef=0.001, kl_estimator_type="k3", use_entropy_loss=False, entropy_loss_coef=0.01,
    tis_imp_ratio_cap=-1.0, use_tis=False, max_seq_len=None, off_policy_correction=None, sapo=None, clip_cov=None,
    kl_cov=None, cispo=None, dppo=None,
)
SUBSECTIONS: Mapping[str, Mapping[str, Any]] = dict(
    sapo=dict(tau_pos=1.0, tau_neg=1.05),
    clip_cov=dict(clip_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0),
    kl_cov=dict(kl_cov_frac=0.2, ppo_kl_coef=1.0),
    cispo=dict(cispo_eps_clip_low=1.0, cispo_eps_clip_high=4.0, cispo_anchor="old"),
    dppo=dict(dppo_type="binary_tv", delta_low=0.2, delta_high=0.2),
    off_policy_correction=OFF_POLICY_CORRECTION,
)
# AlgorithmConfig keys that do not change the loss: advantages, rewards, the critic, dynamic sampling.
ALGORITHM_IGNORED = frozenset((
    "advantage_estimator", "kl_ctrl", "use_kl_in_reward", "temperature", "advantage_batch_normalize",
    "value_head_prefix", "grpo_norm_by_std", "zero_variance_filter", "zero_variance_filter_tol", "lambd", "gamma",
    "value_clip", "dynamic_sampling",
))
# TrainerConfig keys besides ``algorithm`` (batching, models, checkpoints, logging): accepted and ignored.
TRAINER_IGNORED = frozenset((
    "use_expandable_segments", "sequence_parallel_backend", "strategy", "policy", "ref", "critic", "mtp",
    "fully_async", "gradient_checkpointing", "gradient_checkpointing_use_reentrant", "seed", "resume_mode",
    "resume_path", "log_path", "ckpt_path", "max_ckpts_to_keep", "ckpt_interval", "hf_save_interval", "export_path",
    "bf16", "epochs", "max_training_steps", "update_epochs_per_batch", "train_batch_size", "policy_mini_batch_size",
    "critic_mini_batch_size", "micro_train_batch_size_per_gpu", "micro_forward_batch_size_per_gpu",
    "max_tokens_per_microbatch", "recompute_old_logprobs_per_minibatch", "update_ref_every_epoch",
    "remove_microbatch_padding", "eval_batch_size", "eval_before_train", "eval_interval", "max_prompt_length",
    "flash_attn", "disable_fast_tokenizer", "project_name", "run_name", "logger", "enable_ray_gpu_monitor", "tags",
    "dump_data_batch", "dump_eval_results", "print_example_interval", "num_logger_eval_samples",
    "num_logger_train_samples", "log_example_interval", "logprobs_chunk_size", "vocab_entropy_chunk_size",
    "vocab_entropy_chunk_memory_mb", "fused_lm_head_logprob", "fused_lm_head_logprob_backend", "placement",
))
REDUCTIONS = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean"}
REDUCTIONS_UNSUPPORTED = {
    "seq_mean_token_sum_norm": "it divides by your max_seq_len; seq-mean-token-sum-norm here divides by the padded "
                               "length T of the batch (pad to max_seq_len to match).",
    "token_mean_legacy": "a mean of per-micro-batch means; the learner divides by the global token count.",
    "prompt_mean": "per-prompt-group means are not implemented.",
}
KL_ESTIMATORS = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}  # SkyRL's k3 is clamped to [-10, 10]: low_var_kl
LOSSES_UNSUPPORTED = {
    "importance_sampling": "the unclipped ratio loss -exp(lp - old)*A is not implemented.",
    "dppo": "DPPO is not implemented.",
}


def _skyrl_algorithm(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``trainer.algorithm`` block of a SkyRL config given whole, as ``trainer``/``algorithm``, or flat, and the
    keys outside the loss it gives (dotted)."""
    algorithm: dict[str, Any] = {}
    outside: dict[str, Any] = {}
    known = set(ALGORITHM) | ALGORITHM_IGNORED
    for key, value in data.items():
        if key == "trainer":
            trainer = section(value, "skyrl.trainer")
            check_keys(trainer, TRAINER_IGNORED | {"algorithm"}, "skyrl.trainer", {"algorithm"})
            outside |= ignored(trainer, TRAINER_IGNORED, "trainer.")
            part = section(trainer.get("algorithm"), "skyrl.trainer.algorithm")
            algorithm = merge_disjoint(algorithm, part, "skyrl.trainer.algorithm")
        elif key == "algorithm":
            algorithm = merge_disjoint(algorithm, section(value, "skyrl.algorithm"), "skyrl.trainer.algorithm")
        elif key in known:
            algorithm = merge_disjoint(algorithm, {key: value}, "skyrl.trainer.algorithm")
        elif key == "defaults":
            raise defaults_refused("skyrl")
        elif key != "_target_":
            unknown("skyrl", key, known | {"trainer", "algorithm"}, set(ALGORITHM) | {"trainer", "algorithm"})
    check_keys(algorithm, known, "skyrl.trainer.algorithm", ALGORITHM)
    return algorithm, outside | ignored(algorithm, ALGORITHM_IGNORED, "trainer.algorithm.")


def _skyrl_corrections(opc: Mapping[str, Any],
                       where: str) -> tuple[ImportanceWeights | None, tuple[RejectionRule, ...]]:
    """The weights and masks of SkyRL's ``off_policy_correction`` block."""
    rules = []
    if opc["outlier_token_is_threshold_low"] is not None or opc["outlier_token_is_threshold_high"] is not None:
        rules.append(RejectionRule("outlier", opc["outlier_token_is_threshold_low"],
                                   opc["outlier_token_is_threshold_high"]))
    token_bounds = (opc["token_mask_is_threshold_low"], opc["token_mask_is_threshold_high"])
    if (token_bounds[0] is None) != (token_bounds[1] is None):
        raise unsupported(where, "token_mask_is_threshold_low/high", token_bounds,
                          "SkyRL applies the token mask only when both bounds are set and silently skips it "
                          "otherwise; set both, or neither.")
    if token_bounds[0] is not None:
        rules.append(RejectionRule("token_k1", *token_bounds))
    levels = {None: None, "token": ("token", opc["token_tis_ratio_clip_high"]),
              "sequence": ("sequence", opc["sequence_tis_ratio_clip_high"])}
    level = choice(where, "tis_ratio_type", opc["tis_ratio_type"], levels)
    importance = None if level is None else ImportanceWeights(level[0], high=level[1])
    masks = {None: None, "geometric": ("seq_mean_k1", opc["geo_mask_low"], opc["geo_mask_high"]),
             "product": ("seq_sum_k1", opc["product_mask_low"], opc["product_mask_high"])}
    mask = choice(where, "sequence_mask_metric", opc["sequence_mask_metric"], masks)
    if mask is not None:
        rules.append(RejectionRule(*mask))
    return importance, tuple(rules)


def from_skyrl(config: Mapping[str, Any] | None = None, /, **keys: Any) -> CorrectionConfig:
    """The ``CorrectionConfig`` of a SkyRL ``trainer.algorithm`` block: SkyRL a9564572's losses.

    Takes SkyRL's own keys nested (``{"trainer": {"algorithm": {...}}}``, ``{"algorithm": {...}}``), dotted
    (``"trainer.algorithm.off_policy_correction.tis_ratio_type"``) or flat (the algorithm block's keys), in
    ``config`` or as keyword arguments; missing keys take SkyRL's defaults, including ``use_kl_loss=True`` with
    ``kl_loss_coef=0.001``. Read: ``policy_loss_type`` with its sub-blocks (``sapo``, ``clip_cov``, ``kl_cov``,
    ``cispo``), ``eps_clip_low/high``, ``clip_ratio_c``, ``loss_reduction``, the whole ``off_policy_correction``
    block (and the deprecated ``use_tis`` / ``tis_imp_ratio_cap``), the KL loss and the entropy bonus. Keys that
    do not touch the loss (advantage estimator, critic, batch sizes) are accepted and not applied, and listed in
    one ``TrainingKeysWarning``; unknown keys are listed (``UnknownKeyWarning``), or raise, naming the nearest
    match, inside a loss block or close to a loss key. A Hydra ``defaults`` list is refused:
    ``learner.rl.framework_files.read_file`` composes a file and settles what is left.
    docs/from-other-frameworks.md has the key-by-key table.

    >>> config = from_skyrl({"trainer": {"algorithm": {"off_policy_correction": {"tis_ratio_type": "token"}}}})
    >>> config.importance.high, config.objective.dual_clip, config.denominator, config.kl_coef
    (2.0, None, 'original', 0.001)
    >>> from_skyrl({"trainer.algorithm.off_policy_correction.tis_ratio_typ": "token"})
    Traceback (most recent call last):
    ...
    ValueError: skyrl.trainer.algorithm.off_policy_correction: unknown key 'tis_ratio_typ'; did you mean
    'tis_ratio_type'?
    """
    where = "skyrl.trainer.algorithm"
    data = merge_disjoint(nest(config or {}, "skyrl"), nest(keys, "skyrl"), "skyrl")
    given, outside = _skyrl_algorithm(data)
    warn_ignored("skyrl", outside)
    algorithm = {**ALGORITHM, **{k: v for k, v in given.items() if k in ALGORITHM}}
    sub = {}
    for name, defaults in SUBSECTIONS.items():
        block = section(algorithm[name], f"{where}.{name}")
        check_keys(block, defaults, f"{where}.{name}")
        sub[name] = {**defaults, **block}
    opc = sub["off_policy_correction"]
    if algorithm["use_tis"]:  # deprecated; SkyRL rewrites it exactly so
        opc = {**opc, "tis_ratio_type": "token", "token_tis_ratio_clip_high": algorithm["tis_imp_ratio_cap"]}
    importance, rejection = _skyrl_corrections(opc, f"{where}.off_policy_correction")
    low, high = algorithm["eps_clip_low"], algorithm["eps_clip_high"]
    loss = algorithm["policy_loss_type"]
    mode, reduction = "decoupled", None
    if loss in ("clip_cov", "kl_cov") and (importance is not None or rejection):
        raise unsupported(where, "policy_loss_type", loss, "SkyRL raises NotImplementedError for clip_cov and "
                          "kl_cov with off_policy_correction; drop one of them.")
    if loss == "cispo" and sub["cispo"]["cispo_anchor"] == "rollout":
        if importance is not None or rejection:
            raise unsupported(f"{where}.cispo", "cispo_anchor", "rollout", "Tether's bypass mode (the rollout "
                              "anchor) computes the off_policy_correction masks against the current policy, SkyRL "
                              "against the recomputed one; use cispo_anchor='old' or drop the masks.")
        mode = "bypass"
    cispo = sub["cispo"]
    objectives = {
        "regular": lambda: Objective("ppo", clip_low=low, clip_high=high),
        "dual_clip": lambda: Objective("ppo", clip_low=low, clip_high=high, dual_clip=algorithm["clip_ratio_c"]),
        "gspo": lambda: Objective("gspo", clip_low=low, clip_high=high),
        "clip_cov": lambda: Objective("clip_cov", clip_low=low, clip_high=high,
                                      clip_cov_ratio=sub["clip_cov"]["clip_ratio"],
                                      clip_cov_low=sub["clip_cov"]["clip_cov_lb"],
                                      clip_cov_high=sub["clip_cov"]["clip_cov_ub"]),
        "kl_cov": lambda: Objective("kl_cov", kl_cov_ratio=sub["kl_cov"]["kl_cov_frac"],
                                    kl_cov_coef=sub["kl_cov"]["ppo_kl_coef"]),
        "cispo": lambda: Objective("cispo", clip_low=cispo["cispo_eps_clip_low"],
                                   clip_high=cispo["cispo_eps_clip_high"]),
        "sapo": lambda: Objective("sapo", tau_pos=sub["sapo"]["tau_pos"], tau_neg=sub["sapo"]["tau_neg"]),
        "rollout_is": lambda: Objective("rollout_is", clip_low=low, clip_high=high),
        "cross_entropy": lambda: Objective("cross_entropy"),
    }
    objective = choice(where, "policy_loss_type", loss, objectives, LOSSES_UNSUPPORTED)()
    if loss == "cross_entropy":
        reduction = "token-sum"  # SkyRL's cross_entropy sums over tokens whatever loss_reduction says
    reduction = reduction or choice(where, "loss_reduction", algorithm["loss_reduction"], REDUCTIONS,
                                    REDUCTIONS_UNSUPPORTED)
    kl_estimator = choice(where, "kl_estimator_type", algorithm["kl_estimator_type"], KL_ESTIMATORS,
                          {"abs": "Tether has no |lp - ref| estimator."})
    return CorrectionConfig(
        mode=mode,
        objective=objective,
        importance=importance,
        rejection=rejection,
        reduction=reduction,
        denominator="original",
        kl_coef=float(algorithm["kl_loss_coef"]) if algorithm["use_kl_loss"] else 0.0,
        kl_estimator=kl_estimator,
        entropy_coef=float(algorithm["entropy_loss_coef"]) if algorithm["use_entropy_loss"] else 0.0,
    )
