"""verl's loss keys and their defaults: the tables of the verl reader (and of `whole`, which nests a flat block)."""

from __future__ import annotations

# verl's keys at commit 1dda039b, with the defaults of its YAML (what a user's config starts from). The dataclass
# RolloutCorrectionConfig defaults rollout_is to "sequence", but Hydra fills the block from rollout_correction.yaml.
ROLLOUT_CORRECTION = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
                          rollout_rs_threshold=None, bypass_mode=False, loss_type="ppo_clip")
ACTOR = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
             loss_agg_mode="token-mean", loss_scale_factor=None, entropy_coeff=0.0, use_kl_loss=False,
             kl_loss_coef=0.001, kl_loss_type="low_var_kl", policy_loss=None)
POLICY_LOSS = dict(loss_mode="vanilla", clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=0.0002,
                   ppo_kl_coef=0.1, dro_beta=None)
# Keys verl has that do not change the loss or its metrics: batching, optimizer, engine, checkpoints, profiling,
# advantages and rewards (compute advantages with corrections.grpo_advantages and friends).
ACTOR_IGNORED = frozenset((
    "rollout_n", "strategy", "ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu",
    "ppo_infer_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
    "ppo_infer_max_token_len_per_gpu", "freeze_vision_tower", "calculate_entropy", "calculate_sum_pi_squared",
    "use_prefix_grouper", "use_torch_compile", "ppo_epochs", "shuffle", "data_loader_seed", "checkpoint", "optim",
    "use_fused_kernels", "profiler", "engine", "model_config", "router_replay", "global_batch_info", "qat",
    "grad_clip", "ulysses_sequence_parallel_size", "entropy_from_logits_with_chunking",
    "entropy_from_logits_chunk_size", "entropy_checkpointing", "pad_to_length", "fsdp_config", "use_remove_padding",
    "use_rollout_log_probs", "megatron", "profile", "veomni", "torchtitan",
))
ALGORITHM_IGNORED = frozenset((
    "gamma", "lam", "adv_estimator", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty", "kl_ctrl",
    "use_pf_ppo", "pf_ppo", "filter_groups", "gdpo_reward_keys", "gdpo_reward_weights",
))
ACTOR_ROLLOUT_REF_IGNORED = frozenset(("model", "rollout", "ref", "hybrid_engine", "nccl_timeout"))
