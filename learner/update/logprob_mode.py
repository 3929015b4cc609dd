"""RAW or PROCESSED logprobs: the learner and the engine must agree, and the ratios must be of the sampling
distribution, or every importance ratio is biased.

The learner's logprobs are of the distribution the engine sampled from: it replays the engine's transform
(temperature, top-k, top-p, min-p in the engine's order) from the parameters each rollout batch echoes. The rollout
logprobs must be of the same distribution:

- PROCESSED: the engine reports them.
- RAW (``log_softmax`` of the untouched logits; MLX always): with a sampler that changes the distribution they are
  rebuilt (`rebuilt_rollout_logprobs`). The sampled token's processed logprob is
  ``raw / T - logsumexp over the kept set of (raw logprobs / T)``; the normaliser needs every token's logprob,
  which the engine does not return, so the learner's replay at the weights that sampled supplies it, and the
  engine's own RAW logprob supplies the token's: ``processed = learner_processed + (raw - learner_raw) / T``. Exact
  when the learner's logits are the engine's; otherwise off by the kept-set average of the logit mismatch (/ T),
  the size of the mismatch itself. The weights that sampled are the learner's only at staleness 0, so RAW with a
  transform is synchronous (`rollout_client.check_capabilities` refuses the rest).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from learner.logprobs.chunked import map_token_chunks
from learner.logprobs.sampler_replay import SamplerParams, replayed_token_stats, transforms
from learner.update.batch import TrainBatch
from rollout_client.sampling_params import LogprobMode, SamplerOrder


def check_logprob_mode(learner_mode: LogprobMode | str, server_mode: LogprobMode | str) -> LogprobMode:
    """The common mode; raises ValueError at start when the two sides differ (not a silent bias later).

    >>> check_logprob_mode("processed", LogprobMode.PROCESSED).name
    'PROCESSED'
    >>> check_logprob_mode("RAW", "PROCESSED")
    Traceback (most recent call last):
    ...
    ValueError: logprob_mode: the learner computes RAW logprobs but the server returns PROCESSED ones; every importance
    ratio would be biased by the log of the sampler's kept mass. Set both to the same mode.
    """
    learner, server = _mode("learner", learner_mode), _mode("server", server_mode)
    if learner != server:
        raise ValueError(f"logprob_mode: the learner computes {learner.name} logprobs but the server returns "
                         f"{server.name} ones; every importance ratio would be biased by the log of the sampler's "
                         "kept mass. Set both to the same mode.")
    return learner


def replay_params(learner_mode: LogprobMode | str, batch, order: SamplerOrder = SamplerOrder.TEMPERATURE_FIRST
                  ) -> SamplerParams | None:
    """What to pass as ``sampling=`` to `learner.logprobs.token_logprobs` for a collated `rollout_client.RolloutBatch`
    sampled in ``order`` (the engine's `rollout_client.EngineCapabilities.replayed_order`).

    The batch's mode is checked against the learner's. A batch whose sampler changes the distribution gives its
    sampling parameters, in either mode: a RAW batch's logprobs must then be rebuilt
    (`rebuilt_rollout_logprobs`) before any ratio uses them. A batch sampled at temperature 1 without truncation
    gives None: its sampling distribution is the plain one, and replaying it would only cost the threshold search.
    """
    check_logprob_mode(learner_mode, batch.logprob_mode)
    transformed = transforms(batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    return SamplerParams.from_batch(batch, order) if transformed else None


def rebuilt_rollout_logprobs(hidden: jax.Array, output_kernel: jax.Array, batch: TrainBatch, *,
                             chunk_size: int = 512) -> dict[str, jax.Array]:
    """The sampling distribution's logprobs of a batch whose ``rollout_logprobs`` are RAW (no gradient).

    ``hidden`` ``[B, T, D]`` must come from the weights that sampled the batch (staleness 0), ``batch.sampling``
    holds its replayed sampler.

    Returns:
      ``rollout_logprobs`` ``[B, T]``: ``learner_processed + (raw - learner_raw) / T`` where ``loss_mask`` is 1,
      the batch's values elsewhere; ``log_kept_mass`` ``[B, T]``: the log of the mass the sampler kept (<= 0), for
      `learner.logprobs.truncation_bias.truncation_bias_metrics`.
    """
    sampling = batch.sampling
    stats = map_token_chunks(lambda logits, targets: replayed_token_stats(logits, targets, sampling, with_raw=True),
                             hidden, output_kernel, batch.tokens, batch.attention_mask, chunk_size=chunk_size)
    stats = jax.lax.stop_gradient(stats)
    mismatch = (batch.rollout_logprobs - stats["raw_logprobs"]) / sampling.temperature[:, None]
    rebuilt = jnp.where(batch.loss_mask > 0, stats["logprobs"] + mismatch, batch.rollout_logprobs)
    return {"rollout_logprobs": rebuilt, "log_kept_mass": stats["log_kept_mass"]}


def rebuild_batch_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: TrainBatch, *,
                           chunk_size: int = 512) -> dict[str, jax.Array]:
    """`rebuilt_rollout_logprobs` of a RAW ``batch`` at ``params`` (one forward of the model)."""
    model = nnx.merge(graphdef, params)
    hidden = model(batch.tokens, batch.positions, batch.attention_mask)
    return rebuilt_rollout_logprobs(hidden, model.output_kernel(), batch, chunk_size=chunk_size)


def _mode(side: str, mode: LogprobMode | str) -> LogprobMode:
    if isinstance(mode, LogprobMode):
        return mode
    try:
        return LogprobMode[str(mode).upper()]
    except KeyError:
        raise ValueError(f"logprob_mode ({side}): {mode!r} is not RAW or PROCESSED") from None
