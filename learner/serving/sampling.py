"""Drawing one token from the sampling distribution.

The transform itself (temperature, then top-k, top-p, min-p) lives in `learner.logprobs.sampling_transform`: the learner
replays the same code on its own logits, so PROCESSED logprobs of both sides are of the same distribution.
PROCESSED logprobs are ``log_softmax`` of the kept scaled logits (-inf elsewhere); RAW logprobs are
``log_softmax(logits)`` of the untouched model logits.
"""

import jax
import jax.numpy as jnp

from learner.logprobs.sampling_transform import processed_logprobs


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
