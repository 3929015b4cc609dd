"""RAW or PROCESSED logprobs: the learner and the server must agree, or every importance ratio is biased.

RAW: ``log_softmax`` of the untouched model logits on both sides. PROCESSED: of the sampling distribution
(temperature, top-k, top-p, min-p, renormalised); the learner replays the transform from the sampling parameters
each rollout batch echoes.
"""

from rollout_client.sampling_params import LogprobMode

from learner.sampler_replay import SamplerParams, transforms


def check_logprob_mode(learner_mode: LogprobMode | str, server_mode: LogprobMode | str) -> LogprobMode:
    """The common mode; raises ValueError at start when the two sides differ (not a silent bias later).

    >>> check_logprob_mode("processed", LogprobMode.PROCESSED).name
    'PROCESSED'
    >>> check_logprob_mode("RAW", "PROCESSED")
    Traceback (most recent call last):
    ...
    ValueError: logprob_mode: the learner computes RAW logprobs but the server returns PROCESSED ones; every importance ratio would be biased by the log of the sampler's kept mass. Set both to the same mode.
    """
    learner, server = _mode("learner", learner_mode), _mode("server", server_mode)
    if learner != server:
        raise ValueError(f"logprob_mode: the learner computes {learner.name} logprobs but the server returns "
                         f"{server.name} ones; every importance ratio would be biased by the log of the sampler's "
                         "kept mass. Set both to the same mode.")
    return learner


def replay_params(learner_mode: LogprobMode | str, batch) -> SamplerParams | None:
    """What to pass as ``sampling=`` to `learner.logprobs.token_logprobs` for a collated `rollout_client.RolloutBatch`.

    The batch's mode is checked against the learner's; PROCESSED gives the batch's sampling parameters, RAW gives
    None (plain ``log_softmax`` at temperature 1, as the server's RAW logprobs are). So does a PROCESSED batch
    sampled at temperature 1 without truncation: its processed distribution is the plain one, and replaying it
    would only cost the threshold search.
    """
    mode = check_logprob_mode(learner_mode, batch.logprob_mode)
    if mode == LogprobMode.RAW:
        return None
    transformed = transforms(batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    return SamplerParams.from_batch(batch) if transformed else None


def _mode(side: str, mode: LogprobMode | str) -> LogprobMode:
    if isinstance(mode, LogprobMode):
        return mode
    try:
        return LogprobMode[str(mode).upper()]
    except KeyError:
        raise ValueError(f"logprob_mode ({side}): {mode!r} is not RAW or PROCESSED") from None
