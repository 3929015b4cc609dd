"""The sampling transform, in the order the learner must replay it.

Order: temperature, then top-k, then top-p, then min-p, each acting on the
renormalised result of the previous one:

1. temperature: ``logits / temperature``.
2. top-k (k > 0): keep tokens whose scaled logit is >= the k-th largest (ties at the
   boundary are all kept).
3. top-p (p < 1): sort the kept tokens by probability, descending; keep each token
   whose preceding cumulative probability is < p (the smallest prefix reaching p).
4. min-p (m > 0): keep tokens whose probability is >= m times the largest.

PROCESSED logprobs are ``log_softmax`` of the kept scaled logits (-inf elsewhere);
RAW logprobs are ``log_softmax(logits)`` of the untouched model logits.
"""

import jax
import jax.numpy as jnp


def processed_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                       min_p: jax.Array) -> jax.Array:
    """Log-probabilities of the sampling distribution for one position.

    Args:
      logits: float32 [V].
      temperature: > 0.
      top_k: int, 0 disables.
      top_p: in (0, 1]; 1 disables.
      min_p: in [0, 1); 0 disables.

    Returns:
      float32 [V], -inf outside the kept set.

    >>> logp = processed_logprobs(jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05])), 1.0, 0, 0.7, 0.0)
    >>> [round(float(p), 3) for p in jnp.exp(logp)]
    [0.625, 0.375, 0.0, 0.0]
    """
    vocab_size = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / temperature
    kth_largest = jnp.sort(scaled)[vocab_size - jnp.clip(top_k, 1, vocab_size)]
    scaled = jnp.where((top_k <= 0) | (scaled >= kth_largest), scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled)
    order = jnp.argsort(-scaled)
    sorted_probs = probs[order]
    mass_before = jnp.cumsum(sorted_probs) - sorted_probs
    keep_sorted = (mass_before < top_p) | (top_p >= 1.0)
    keep = jnp.zeros(vocab_size, bool).at[order].set(keep_sorted)
    scaled = jnp.where(keep, scaled, -jnp.inf)
    logp = jax.nn.log_softmax(scaled)
    scaled = jnp.where((min_p <= 0) | (logp >= jnp.log(min_p) + logp.max()), scaled, -jnp.inf)
    return jax.nn.log_softmax(scaled)


def sample_token(logits: jax.Array, key: jax.Array, temperature, top_k, top_p, min_p, processed_mode
                 ) -> tuple[jax.Array, jax.Array]:
    """Draws one token from the processed distribution.

    Returns:
      (token id int32, its logprob: processed if `processed_mode`, else raw).
    """
    processed = processed_logprobs(logits, temperature, top_k, top_p, min_p)
    token = jax.random.categorical(key, processed).astype(jnp.int32)
    raw = jax.nn.log_softmax(logits.astype(jnp.float32))
    return token, jnp.where(processed_mode, processed[token], raw[token])
