"""Off-policy corrections for RL on language models: pure, jit-able JAX on [T] / [B, T] arrays.

Importance weights, rejection masks, policy objectives, reductions, advantages, diagnostics, presets, and
``compute``, the pipeline that composes them. No model, no sharding. ``from_verl``, ``from_skyrl``,
``from_slime`` and ``from_areal`` (and ``config_from_dict``) read those frameworks' own config blocks (plain data);
their files are read by ``learner.rl.framework_files.read_file``.
"""

from corrections._advantages import broadcast_to_tokens
from corrections._advantages import dr_grpo_advantages
from corrections._advantages import grpo_advantages
from corrections._advantages import kl_penalty
from corrections._advantages import reinforce_pp_advantages
from corrections._advantages import rloo_advantages
from corrections._config import CorrectionConfig
from corrections._config import ImportanceWeights
from corrections._config import Objective
from corrections._config import RejectionRule
from corrections._config import config_to_dict
from corrections._diagnostics import effective_sample_size
from corrections._diagnostics import mismatch_metrics
from corrections._diagnostics import rejection_metrics
from corrections._diagnostics import staleness_metrics
from corrections._diagnostics import weight_metrics
from corrections.frameworks._areal import from_areal
from corrections._masked import METRIC_LOGPROB_FLOOR
from corrections._masked import SAFETY
from corrections._masked import masked_mean
from corrections._masked import masked_sum
from corrections._masked import safe_exp
from corrections._objectives import OBJECTIVES
from corrections._objectives import ObjectiveSpec
from corrections._objectives import cispo_loss
from corrections._objectives import clip_cov_loss
from corrections._objectives import cross_entropy_loss
from corrections._objectives import gspo_loss
from corrections._objectives import kl_cov_loss
from corrections._objectives import ppo_clip_loss
from corrections._objectives import reinforce_loss
from corrections._objectives import rollout_is_loss
from corrections._objectives import sapo_loss
from corrections.frameworks._keys import UnknownKeyWarning
from corrections.frameworks._keys import TrainingKeysWarning
from corrections.frameworks._from_dict import config_from_dict
from corrections._pipeline import Corrected
from corrections._pipeline import check_batch
from corrections._pipeline import compute
from corrections._pipeline import metrics_from_row_stats
from corrections._presets import PRESETS
from corrections._presets import VERL_PRESETS
from corrections._presets import preset
from corrections._reductions import loss_terms
from corrections._reductions import loss_terms_from_rows
from corrections._reductions import reduce_loss
from corrections._rejection import divergence_mask
from corrections._rejection import geometric_sequence_mask
from corrections._rejection import opsm_mask
from corrections._rejection import outlier_sequence_mask
from corrections._rejection import product_sequence_mask
from corrections._rejection import token_mask
from corrections.frameworks._skyrl import from_skyrl
from corrections.frameworks._slime import from_slime
from corrections._weights import batch_normalize_weights
from corrections._weights import geometric_sequence_weights
from corrections._weights import icepop_weights
from corrections._weights import off_policy_is_weights
from corrections._weights import sequence_tis_weights
from corrections._weights import token_tis_weights
from corrections._weights import unbounded_ratios
from corrections.frameworks._verl import from_verl
from corrections.frameworks._verl import verl_importance
from corrections.frameworks._verl import verl_rejection_rules

__all__ = (
    "batch_normalize_weights",
    "broadcast_to_tokens",
    "check_batch",
    "cispo_loss",
    "clip_cov_loss",
    "compute",
    "config_from_dict",
    "config_to_dict",
    "Corrected",
    "CorrectionConfig",
    "cross_entropy_loss",
    "divergence_mask",
    "dr_grpo_advantages",
    "effective_sample_size",
    "from_areal",
    "from_skyrl",
    "from_slime",
    "from_verl",
    "geometric_sequence_mask",
    "geometric_sequence_weights",
    "grpo_advantages",
    "gspo_loss",
    "icepop_weights",
    "ImportanceWeights",
    "kl_cov_loss",
    "kl_penalty",
    "loss_terms",
    "loss_terms_from_rows",
    "masked_mean",
    "masked_sum",
    "metrics_from_row_stats",
    "mismatch_metrics",
    "Objective",
    "OBJECTIVES",
    "ObjectiveSpec",
    "off_policy_is_weights",
    "opsm_mask",
    "outlier_sequence_mask",
    "ppo_clip_loss",
    "preset",
    "PRESETS",
    "product_sequence_mask",
    "reduce_loss",
    "reinforce_loss",
    "reinforce_pp_advantages",
    "rejection_metrics",
    "RejectionRule",
    "rloo_advantages",
    "rollout_is_loss",
    "safe_exp",
    "METRIC_LOGPROB_FLOOR",
    "SAFETY",
    "sapo_loss",
    "sequence_tis_weights",
    "staleness_metrics",
    "token_mask",
    "token_tis_weights",
    "TrainingKeysWarning",
    "unbounded_ratios",
    "UnknownKeyWarning",
    "VERL_PRESETS",
    "verl_importance",
    "verl_rejection_rules",
    "weight_metrics",
)
