"""The publish canary: after a publish, the engine samples a fixed canary and the learner scores it with its own
weights; a difference beyond the tolerance stops the run with one line (`CanaryMismatchError`).

A publish can succeed at every RPC and still leave the engine serving other weights: vLLM's in-place reload keeps a
tied-embedding model's start-up ``lm_head`` (vllm#48312), a tensor can be garbled in transit or by a loader. The
canary asks what the engine actually serves: ``CANARY_PROMPTS`` fixed prompts (token ids drawn once from a fixed seed,
below the vocabulary), up to ``CANARY_NEW_TOKENS`` tokens sampled from each (`canary_shape`: prompt and tokens fit the
run's context) at temperature 1 without truncation (so RAW
and PROCESSED logprobs are the same distribution on every engine) and never stopped early, with the logprob the
engine gives each token. The learner computes the logprobs of the same tokens with the weights it published
(`learner.logprobs.completions.completion_token_logprobs`) and compares token by token (`compare`): the mean
|difference| over the canary's tokens must stay within the tolerance. The mean, not the largest: with bfloat16
serving the largest per-token difference of a healthy publish is heavy-tailed (0.04 typical, 0.55 once in 150
canaries), the mean is not (at most 0.024), and a stale or garbled tensor moves every token.

Scoring generated tokens needs only the data plane every engine serves (rollout.v1, smg's MLX, vLLM and SGLang
protos): no engine has to score prompts, so every engine is verified the same way. The learner scores each sample
whole; only tokens the engine stamps with the published version are compared (all of them after a publish that
waited).

When (``canary.every``): the start's publish, the first step's, then every step that is a multiple of ``every``; 0
turns the canary off (said once at start). The tolerance on the mean per-token difference is ``canary.tolerance``,
else `default_tolerance` of the engine and the coarser of its serving dtype (what the run publishes:
`learner.rl.rollout_engines.publish_dtype`; an external engine serving a narrower dtype needs ``canary.tolerance``)
and the learner's parameter and compute dtypes, measured in docs/engines/weight-updates.md.

Multi-host: every process scores (the learner's weights are sharded over all of them); process 0 samples the canary
and broadcasts its tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from learner.logprobs.completions import completion_token_logprobs
from learner.rl.config import RunConfig
from learner.rl.rollout_engines import publish_dtype
from learner.update.step import merge_model
from rollout_client import LogprobMode, RolloutRequest, SamplingParams

CANARY_PROMPTS = 8  # prompts sampled per canary (one sample each)
CANARY_PROMPT_TOKENS = 12  # tokens per prompt, at most
CANARY_NEW_TOKENS = 8  # tokens the engine samples from each prompt, at most
CANARY_SEED = 48  # the prompts' token ids and the engine's sampling seed (honoured where the engine can)

# The mean per-token |engine - learner| logprob a healthy publish stays within, by dtype (the coarser of the engine's
# serving dtype and the learner's), with an engine's own where measured. Healthy maxima over 30-150 canaries of the
# main job on the embedded engine: float32 7.6e-7, bfloat16 0.024, float16 0.0027 (MLX, vLLM float32: ~5e-7); a
# stale head: docs/engines/weight-updates.md ("The publish canary").
DEFAULT_TOLERANCES = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}
ENGINE_TOLERANCES: dict[tuple[str, str], float] = {}


class CanaryMismatchError(RuntimeError):
    """The engine's logprobs of the canary differ from the learner's beyond the tolerance: it serves other weights
    than the learner published."""


@dataclasses.dataclass(frozen=True)
class CanaryResult:
    """One canary's comparison."""

    max_abs_diff: float  # the largest |engine - learner| per-token logprob (inf where either is NaN)
    mean_abs_diff: float  # their mean: what the tolerance bounds
    tokens: int  # tokens compared

    def metrics(self, seconds: float) -> dict[str, float]:
        """``canary/*``, and the seconds it took as ``perf/canary_s`` (a timing: `learner.rl.run`'s step metrics)."""
        return {"canary/max_abs_diff": self.max_abs_diff, "canary/mean_abs_diff": self.mean_abs_diff,
                "canary/tokens": float(self.tokens), "perf/canary_s": seconds}


def coarser_dtype(*dtypes: str) -> str:
    """The least precise of ``dtypes`` (bfloat16, then float16, then float32)."""
    order = ("float32", "float16", "bfloat16")
    return max(dtypes, key=order.index)


def default_tolerance(engine: str, dtype: str) -> float:
    """The tolerance for ``engine`` serving in ``dtype`` (`ENGINE_TOLERANCES`, else `DEFAULT_TOLERANCES`)."""
    return ENGINE_TOLERANCES.get((engine, dtype), DEFAULT_TOLERANCES[dtype])


def canary_shape(context: int) -> tuple[int, int]:
    """``(prompt tokens, new tokens)`` of a canary for a ``context`` of at least 2 positions: at most
    ``CANARY_PROMPT_TOKENS`` and ``CANARY_NEW_TOKENS``, half the context each where it is shorter.

    >>> canary_shape(2048), canary_shape(8)
    ((12, 8), (4, 4))
    """
    new_tokens = min(CANARY_NEW_TOKENS, context // 2)
    return min(CANARY_PROMPT_TOKENS, context - new_tokens), new_tokens


def canary_prompts(vocab_size: int, prompt_tokens: int = CANARY_PROMPT_TOKENS) -> list[np.ndarray]:
    """The fixed prompts: int32 ids in ``[0, vocab_size)``, the same for every run with the same vocabulary."""
    rng = np.random.default_rng(CANARY_SEED)
    return [rng.integers(0, vocab_size, prompt_tokens).astype(np.int32) for _ in range(CANARY_PROMPTS)]


def canary_requests(prompts: Sequence[np.ndarray], new_tokens: int, logprob_mode: LogprobMode
                    ) -> list[RolloutRequest]:
    """One request per prompt: temperature 1, no truncation, never stopped, seeded."""
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=new_tokens,
                              stop_token_ids=(), seed=CANARY_SEED)
    return [RolloutRequest(prompt, sampling, num_samples=1, logprob_mode=logprob_mode) for prompt in prompts]


def compare(engine_logprobs: Sequence[np.ndarray], learner_logprobs: Sequence[np.ndarray]) -> CanaryResult:
    """Token-by-token |engine - learner| over every row, in float64.

    Raises:
        ValueError: a row's lengths differ, or there is no token to compare.
    """
    diffs = []
    for row, (engine, learner) in enumerate(zip(engine_logprobs, learner_logprobs, strict=True)):
        if np.shape(engine) != np.shape(learner):
            raise ValueError(f"canary row {row}: {np.size(engine)} engine logprobs but {np.size(learner)} learner ones")
        diffs.append(np.abs(np.asarray(engine, np.float64) - np.asarray(learner, np.float64)))
    diffs = np.concatenate(diffs) if diffs else np.zeros(0)
    if diffs.size == 0:
        raise ValueError("the canary has no token to compare")
    diffs = np.where(np.isnan(diffs), np.inf, diffs)  # NaN (a garbled tensor) is a mismatch, never a pass
    return CanaryResult(max_abs_diff=float(diffs.max()), mean_abs_diff=float(diffs.mean()), tokens=int(diffs.size))


class PublishCanary:
    """Verifies publishes of one run (see the module docstring).

    Args:
      engine_name: ``server.engine``, named in the error.
      dtype: the coarser of the engine's serving dtype and the learner's compute dtype.
      every: ``canary.every`` (0: off).
      tolerance: ``canary.tolerance``; None: `default_tolerance`.
      logprob_mode: the run's (the engine may serve only one).
      vocab_size: the learner's vocabulary (the engine's is the same: `learner.rl.rollout_engines.check_identity`).
      context: the positions the engine serves (prompt plus new tokens; `canary_shape`).
      score: ``(prompts, completions) -> per-token logprobs`` under the learner's current weights; every process
        calls it (`completion_token_logprobs` on the learner's model).
      broadcast: ``(tree, is_source) -> tree`` from process 0 to all (`learner.rl.run.broadcast`).
    """

    def __init__(self, engine_name: str, dtype: str, every: int, tolerance: float | None, logprob_mode: LogprobMode,
                 vocab_size: int, context: int, score: Callable[[list, list], list[np.ndarray]],
                 broadcast: Callable):
        self.engine_name, self.dtype, self.every = engine_name, dtype, every
        self.tolerance = default_tolerance(engine_name, dtype) if tolerance is None else tolerance
        prompt_tokens, self.new_tokens = canary_shape(context)
        self.prompts = canary_prompts(vocab_size, prompt_tokens)
        self.logprob_mode = logprob_mode
        self._score, self._broadcast = score, broadcast

    def describe(self) -> str:
        """The start-up line."""
        if not self.every:
            return "canary: off (canary.every = 0): publishes are not verified"
        return (f"canary: the {self.engine_name} engine's logprobs of {CANARY_PROMPTS} x {self.new_tokens} sampled "
                f"tokens checked against the learner's at the start, step 1 and every {self.every} steps "
                f"(tolerance {self.tolerance:g}, {self.dtype})")

    def due(self, step: int, first_step: int) -> bool:
        """Whether the publish after ``step`` is verified (``first_step - 1``: the start's publish)."""
        return bool(self.every) and (step <= first_step or step % self.every == 0)

    def verify(self, engine, policy_version: int, leader: bool) -> dict[str, float]:
        """Samples the canary from ``engine`` (process 0; None elsewhere), scores it with the learner's weights on
        every process, compares on process 0; returns ``canary/*`` metrics there (empty elsewhere).

        Raises:
            CanaryMismatchError: the difference exceeds the tolerance, or the engine returned no canary token of
                this version or no valid sample at all (process 0).
        """
        started = time.monotonic()
        completions = np.full((CANARY_PROMPTS, self.new_tokens), -1, np.int32)  # -1: past a sample's end
        engine_logprobs = np.zeros((CANARY_PROMPTS, self.new_tokens), np.float32)
        compared = np.zeros((CANARY_PROMPTS, self.new_tokens), bool)  # the published version drew the token
        if leader:
            requests = canary_requests(self.prompts, self.new_tokens, self.logprob_mode)
            futures = [engine.submit(request) for request in requests]
            samples = [future.result() for future in futures]  # [] where the client dropped the sample
            for row, (sample,) in ((row, result) for row, result in enumerate(samples) if result):
                tokens = sample.completion_token_ids[:self.new_tokens]
                completions[row, :tokens.size] = tokens
                engine_logprobs[row, :tokens.size] = sample.logprobs[:tokens.size]
                compared[row, :tokens.size] = np.asarray(sample.policy_versions[:tokens.size]) == policy_version
        completions = np.asarray(self._broadcast(completions, leader))
        rows = [index for index, row in enumerate(completions) if row[0] >= 0]
        learner = self._score([self.prompts[index] for index in rows], [completions[index][completions[index] >= 0]
                                                                        for index in rows])
        if not leader:
            return {}
        engine_rows, learner_rows = [], []
        for index, scored in zip(rows, learner):
            mask = compared[index][:scored.size]
            engine_rows.append(engine_logprobs[index][:scored.size][mask])
            learner_rows.append(scored[mask])
        if not any(samples):  # nothing to compare, and not for a version's sake: say why
            dropped = {name: count for name, count in engine.metrics().items()
                       if name.startswith("samples/dropped/") and count}
            raise CanaryMismatchError(f"publish canary: the {self.engine_name} engine returned no valid canary "
                                      f"sample at policy version {policy_version}: the client dropped every one "
                                      f"({dropped}); it serves invalid samples")
        if not sum(row.size for row in engine_rows):
            raise CanaryMismatchError(f"publish canary: the {self.engine_name} engine returned no canary token of "
                                      f"policy version {policy_version}, the version just published")
        result = compare(engine_rows, learner_rows)
        if not result.mean_abs_diff <= self.tolerance:
            raise CanaryMismatchError(
                f"publish canary: the {self.engine_name} engine at policy version {policy_version} serves other "
                f"weights than the learner published: its logprobs of the canary's {result.tokens} tokens differ "
                f"from the learner's by {result.mean_abs_diff:.3g} on average (max {result.max_abs_diff:.3g}; "
                f"tolerance {self.tolerance:g} for {self.dtype}, canary.tolerance). A stale or corrupted publish: see "
                "docs/engines/weight-updates.md")
        return result.metrics(time.monotonic() - started)


def learner_scorer(model_of: Callable, batch_rows: int = CANARY_PROMPTS) -> Callable:
    """``score`` for `PublishCanary`: `completion_token_logprobs` at temperature 1 on ``model_of()`` (the learner's
    current model), one batch of ``batch_rows`` rows (one compiled program)."""

    def score(prompts: list, completions: list) -> list[np.ndarray]:
        if not prompts:
            return []
        return completion_token_logprobs(model_of(), prompts, completions, temperature=1.0, batch_rows=batch_rows)

    return score



def publish_canary(config: RunConfig, trainer, broadcast: Callable) -> PublishCanary:
    """The canary of a run (`learner.rl.config.RunConfig`) and its `learner.rl.trainer.Trainer`: the engine's serving
    dtype is what the run publishes in (`learner.rl.rollout_engines.publish_dtype`)."""
    def model_of():
        return merge_model(trainer.graphdef, trainer.state.params, trainer.frozen)

    dtype = coarser_dtype(publish_dtype(config), config.model.param_dtype, config.model.compute_dtype)
    score = learner_scorer(model_of)
    if trainer.matmul_precision != "default":
        score = _with_precision(score, trainer.matmul_precision)
    return PublishCanary(config.server.engine, dtype, config.canary.every, config.canary.tolerance,
                         LogprobMode[config.rollout.logprob_mode.upper()], trainer.model_config.vocab_size,
                         trainer.length, score, broadcast)


def _with_precision(score: Callable, precision: str) -> Callable:
    """``score`` under the learner's matmul precision (its passes' precision: `learner.model.precision`)."""
    def scored(prompts, completions):
        with jax.default_matmul_precision(precision):
            return score(prompts, completions)

    return scored
