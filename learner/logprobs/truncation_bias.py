"""How biased RAW logprobs are under truncated sampling: the log of the probability mass the sampler kept.

With RAW logprobs from the server, the learner's ratio is between untruncated distributions while the tokens were
drawn from the truncated one; a token's log-weight between the two is minus the log of the kept mass, so the mean
log kept mass over valid tokens says how large the uncorrected truncation bias is (0: none).
"""

import jax
import jax.numpy as jnp

from learner.logprobs.chunked import map_token_chunks
from learner.logprobs.sampler_replay import SamplerParams, replayed_token_stats


def log_kept_mass(hidden: jax.Array, output_kernel: jax.Array, tokens: jax.Array, attention_mask: jax.Array, *,
                  sampling: SamplerParams, chunk_size: int = 512) -> jax.Array:
    """Per token, log of the mass that the replayed sampler keeps (<= 0), aligned like `logprobs_from_hidden`.

    The mass is that of the temperature-scaled distribution at the position that predicts the token; the kept set
    always includes the token itself. Costs one more chunked pass of the output head (no gradient).
    """
    stats = map_token_chunks(lambda logits, targets: replayed_token_stats(logits, targets, sampling),
                             hidden, output_kernel, tokens, attention_mask, chunk_size=chunk_size)
    return jax.lax.stop_gradient(stats["log_kept_mass"])


def truncation_bias_metrics(log_mass: jax.Array, loss_mask: jax.Array) -> dict[str, jax.Array]:
    """``sampler/log_kept_mass_mean`` (masked mean) and ``sampler/log_kept_mass_min`` over valid tokens.

    >>> m = truncation_bias_metrics(jnp.log(jnp.array([[0.5, 0.25, 1.0]])), jnp.array([[1, 1, 0]]))
    >>> round(float(m["sampler/log_kept_mass_mean"]), 4), round(float(m["sampler/log_kept_mass_min"]), 4)
    (-1.0397, -1.3863)
    """
    valid = jnp.asarray(loss_mask).astype(bool)
    count = jnp.maximum(jnp.sum(valid), 1)
    return {"sampler/log_kept_mass_mean": jnp.sum(jnp.where(valid, log_mass, 0.0)) / count,
            "sampler/log_kept_mass_min": jnp.min(jnp.where(valid, log_mass, 0.0))}

