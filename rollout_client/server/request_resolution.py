"""Checks a GenerateRequest and fills in defaults, naming the field that is wrong.

Kept apart from the servicer so the rules can be tested without a server.
"""

import math
import secrets

import numpy as np

from rollout_client.packed_arrays import BYTES_PER_TOKEN, TOKEN_ID_DTYPE
from rollout_client.protocol import MIN_CHUNK_TOKENS, pb
from rollout_client.sampling_params import LogprobMode
from rollout_client.server.generator import GeneratorInfo, ResolvedSampling, SequenceSpec

MAX_SAMPLES_PER_REQUEST = 1024


def resolve_sampling(params: pb.SamplingParams, prompt_len: int, info: GeneratorInfo) -> ResolvedSampling:
    """Fills defaults into `params`; raises ValueError naming the first bad field."""
    context_left = info.max_seq_len - prompt_len
    resolved = ResolvedSampling(
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_k=params.top_k if params.HasField("top_k") else 0,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        min_p=params.min_p if params.HasField("min_p") else 0.0,
        max_new_tokens=min(params.max_new_tokens, context_left) if params.HasField("max_new_tokens")
        else context_left,
        stop_token_ids=tuple(params.stop_token_ids.token_ids) if params.HasField("stop_token_ids")
        else info.eos_token_ids,
        seed=params.seed if params.HasField("seed") else secrets.randbits(63),
    )
    if not 0 < resolved.temperature < math.inf:
        raise ValueError(f"sampling.temperature: must be finite and > 0, got {resolved.temperature}")
    if not 0 < resolved.top_p <= 1:
        raise ValueError(f"sampling.top_p: must be in (0, 1], got {resolved.top_p}")
    if resolved.top_k < 0:
        raise ValueError(f"sampling.top_k: must be >= 0, got {resolved.top_k}")
    if not 0 <= resolved.min_p < 1:
        raise ValueError(f"sampling.min_p: must be in [0, 1), got {resolved.min_p}")
    if params.HasField("max_new_tokens") and params.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens: must be >= 1, got {params.max_new_tokens}")
    return resolved


def resolve_request(request: pb.GenerateRequest, info: GeneratorInfo) -> list[SequenceSpec]:
    """One `SequenceSpec` per requested sample; raises ValueError naming the bad field."""
    if not request.request_id:
        raise ValueError("request_id: must not be empty")
    if request.logprob_mode not in (pb.LOGPROB_MODE_RAW, pb.LOGPROB_MODE_PROCESSED):
        raise ValueError(f"logprob_mode: must be RAW or PROCESSED, got "
                         f"{pb.LogprobMode.Name(request.logprob_mode)}")
    if len(request.prompt_token_ids) % BYTES_PER_TOKEN:
        raise ValueError(f"prompt_token_ids: {len(request.prompt_token_ids)} bytes is not a whole number of "
                         f"little-endian int32 token ids")
    prompt = np.frombuffer(request.prompt_token_ids, TOKEN_ID_DTYPE)
    if prompt.size == 0:
        raise ValueError("prompt_token_ids: must not be empty")
    if prompt.size >= info.max_seq_len:
        raise ValueError(f"prompt_token_ids: length {prompt.size} leaves no room in the "
                         f"server's context of {info.max_seq_len}")
    if prompt.min() < 0 or prompt.max() >= info.vocab_size:
        raise ValueError(f"prompt_token_ids: ids must be in [0, {info.vocab_size})")
    # Bounded before any list is built: num_samples is a number on the wire, not a size.
    num_samples = len(request.sample_indices) or (request.num_samples if request.HasField("num_samples") else 1)
    if not 1 <= num_samples <= MAX_SAMPLES_PER_REQUEST:
        raise ValueError(f"num_samples: must be in [1, {MAX_SAMPLES_PER_REQUEST}], got {num_samples}")
    indices = list(request.sample_indices) or list(range(num_samples))
    if len(set(indices)) != len(indices):
        raise ValueError("sample_indices: must be distinct")
    if request.stream_chunk_tokens and request.stream_chunk_tokens < MIN_CHUNK_TOKENS:
        raise ValueError(f"stream_chunk_tokens: must be 0 or >= {MIN_CHUNK_TOKENS}, "
                         f"got {request.stream_chunk_tokens}")
    sampling = resolve_sampling(request.sampling, prompt.size, info)
    mode = LogprobMode(request.logprob_mode)
    return [SequenceSpec(prompt_token_ids=prompt, sampling=sampling, sample_index=index, logprob_mode=mode)
            for index in indices]
