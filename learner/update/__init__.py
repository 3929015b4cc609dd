"""The update: one jitted step over mini-batch and micro-batch scans, its batch, buckets, optimizer and train state.

`learner.update` re-exports `learner.update.step`; `batch`, `bucketing`, `adapter_loss`, `optimizer`,
`train_state` and `logprob_mode` are imported by name.
"""

from learner.update.step import MinibatchGradients
from learner.update.step import UpdateConfig
from learner.update.step import first_scored_token
from learner.update.step import make_update_fn
from learner.update.step import merge_model
from learner.update.step import minibatch_gradients
from learner.update.step import minibatch_update
from learner.update.step import proximal_from_training_pass
from learner.update.step import recompute_logprobs
from learner.update.step import row_adapters
from learner.update.step import update_step
from learner.update.step import whole_batch_weight_scale

__all__ = [
    "MinibatchGradients",
    "UpdateConfig",
    "first_scored_token",
    "make_update_fn",
    "merge_model",
    "minibatch_gradients",
    "minibatch_update",
    "proximal_from_training_pass",
    "recompute_logprobs",
    "row_adapters",
    "update_step",
    "whole_batch_weight_scale",
]
