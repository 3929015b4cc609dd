"""The plug-in point for inference engines: what the learner talks to, and what each engine declares it can do.

The training loop uses only `Engine`: submit a request (a future of samples), publish weights under a policy
version, read the engine's identity, close. Engines differ in what they can honour (see
``shared/reference/engines.md``: MLX returns only RAW logprobs and takes weights by restart, SGLang reports
per-token versions and loads weights from disk, vLLM has engine-wide versions, ...), so each declares its
`EngineCapabilities`, and the loop states its `EngineRequirements`: `check_capabilities` refuses, before anything
runs, a run the engine cannot honour, naming every missing capability and the config key that asks for it. The
engine's sampler order decides how the learner replays it (`EngineCapabilities.replayed_order`).

The rollout.v1 client with the reference server (`rollout_client.TetherEngine`) is the first implementation.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import enum
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np

from rollout_client.sampling_params import LogprobMode, PauseMode, SamplerOrder

if TYPE_CHECKING:  # the client (and gRPC) loads only where a backend needs it
    from rollout_client.client import RolloutRequest
    from rollout_client.samples import Sample

SAMPLER_STEPS = SamplerOrder.TEMPERATURE_FIRST.steps  # the transforms a sampler may apply, in Tether's order
STEP_OFF = {"temperature": "1", "top_k": "0", "top_p": "1", "min_p": "0"}  # the value that turns each step off

# What makes two orders of the steps differ: (a, b) with both used, is a applied before b? top-k keeps the k largest
# on any scale and in any position, min-p is relative to the largest probability (which every step keeps), so only
# these change the result: the scale top-p and min-p see, and the set whose mass top-p cuts.
ORDER_FACTS = (("temperature", "top_p"), ("temperature", "min_p"), ("top_k", "top_p"), ("min_p", "top_p"))


class WeightTransport(enum.Enum):
    """How an engine receives new weights."""

    STREAMED = "streamed"  # tensors over the wire (rollout.v1 StreamWeights)
    FROM_DISK = "from_disk"  # a checkpoint directory the engine loads (SGLang update_weights_from_disk, vLLM reload)
    RESTART = "restart"  # the engine process is restarted on a new checkpoint directory (MLX)


class PartialRollouts(enum.Enum):
    """Whether and how a request keeps running across a weight update (``rollout.partial``)."""

    NONE = "none"  # it cannot (MLX: new weights by restart)
    IN_ENGINE = "in_engine"  # a KEEP pause: the engine decodes on with the new weights, stamping each token
    #   (rollout.v1)
    CONTINUED = "continued"  # an ABORT pause, then the client asks for the rest from the exact tokens so far, stamping
    #   the new version on the rest (SGLang, vLLM: `rollout_client.engines.smg.adapter`)


class VersionReporting(enum.Enum):
    """How an engine says which policy version sampled a token."""

    PER_TOKEN = "per_token"  # version spans on every sample (rollout.v1, SGLang weight_versions)
    ENGINE = "engine"  # one engine-wide version: the client stamps it when a request is admitted
    NONE = "none"  # nothing: the client stamps the version it last published


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can honour; declared by each backend."""

    logprob_modes: frozenset[LogprobMode]  # which distributions its logprobs can be of
    sampler_order: tuple[str, ...]  # the SAMPLER_STEPS it applies, in its order (the learner replays this order)
    pause_modes: frozenset[PauseMode]  # how it can pause for a weight update
    weight_transport: WeightTransport
    version_reporting: VersionReporting
    native_n: bool  # several samples per request; False: the client fans out one request per sample
    honours_seed: bool  # the same seed gives the same samples (a retried request redraws the same tokens)
    partial_rollouts: PartialRollouts = PartialRollouts.NONE

    def replayed_order(self, steps: Collection[str]) -> SamplerOrder | None:
        """The order the learner replays that acts like this engine's on ``steps`` (the SAMPLER_STEPS a run uses),
        or None if neither does. Temperature-first is preferred where both act alike (it is the cheaper replay).

        >>> caps = EngineCapabilities(frozenset(), ("top_p", "min_p", "top_k", "temperature"), frozenset(),
        ...                           WeightTransport.RESTART, VersionReporting.NONE, False, False)
        >>> caps.replayed_order(("temperature", "top_k")).name, caps.replayed_order(("temperature", "top_p")).name
        ('TEMPERATURE_FIRST', 'TEMPERATURE_LAST')
        """
        facts = _order_facts(self.sampler_order, steps)
        return next((order for order in SamplerOrder if _order_facts(order.steps, steps) == facts), None)


@dataclasses.dataclass(frozen=True)
class EngineRequirements:
    """What a run needs of its engine; each field's config key is named when it is refused."""

    logprob_mode: LogprobMode  # rollout.logprob_mode
    sampler_steps: tuple[str, ...] = ()  # the SAMPLER_STEPS the run's sampler uses (rollout.temperature, top_k, ...)
    pause_mode: PauseMode = PauseMode.KEEP  # how the loop pauses to publish
    max_staleness: int = 0  # rollout.max_staleness: > 0 keeps requests in flight while the learner trains
    partial: bool = False  # rollout.partial: requests in flight run on across a publish, under the new weights
    seeded: bool = False  # loop.deterministic: the same seed must give the same samples


class EngineCapabilityError(ValueError):
    """The engine cannot honour the run's configuration; the message lists everything missing."""


def check_capabilities(engine_name: str, capabilities: EngineCapabilities, needs: EngineRequirements) -> None:
    """Raises `EngineCapabilityError` listing every requirement ``capabilities`` cannot honour.

    The learner replays the engine's sampler on its own logits in both logprob modes (PROCESSED: the engine's
    logprobs are of the sampling distribution; RAW: the learner rebuilds those from the RAW ones), so the steps a
    run uses must be applied in an order it replays (`EngineCapabilities.replayed_order`). The rebuilt logprobs use
    the learner's weights, the weights that sampled only when nothing is stale: RAW with any step is synchronous.

    >>> caps = EngineCapabilities(frozenset({LogprobMode.RAW}), ("top_p", "min_p", "top_k", "temperature"),
    ...                           frozenset(), WeightTransport.RESTART, VersionReporting.NONE, False, False)
    >>> check_capabilities("mlx", caps, EngineRequirements(LogprobMode.RAW, ("temperature", "top_p"),
    ...                                                     max_staleness=0))
    >>> check_capabilities("mlx", caps, EngineRequirements(LogprobMode.RAW, ("temperature", "top_p", "top_k"),
    ...                                                     max_staleness=1))
    Traceback (most recent call last):
    ...
    rollout_client.engines.base.EngineCapabilityError: engine 'mlx' cannot honour this run:
    - rollout.logprob_mode='raw' with rollout.temperature, rollout.top_p, rollout.top_k at rollout.max_staleness=1: the
    learner rebuilds the sampling distribution's logprobs from the raw ones with its own weights, which are the weights
    that sampled only when nothing is stale (set rollout.max_staleness=0, or rollout.logprob_mode='processed' where the
    engine offers it)
    - rollout.max_staleness=1: requests kept running across a weight update need per-token versions; this engine reports
    none (set rollout.max_staleness=0)
    """
    missing = []
    if needs.logprob_mode not in capabilities.logprob_modes:
        offered = " or ".join(sorted(mode.name.lower() for mode in capabilities.logprob_modes))
        missing.append(f"rollout.logprob_mode={needs.logprob_mode.name.lower()!r}: it returns only {offered} "
                       "logprobs")
    missing += _sampler_refusals(capabilities, needs)
    keeps_running = needs.max_staleness > 0
    if keeps_running and needs.partial:
        if capabilities.partial_rollouts == PartialRollouts.NONE:
            missing.append("rollout.partial=true: this engine cannot keep a request running across a weight update "
                           "(it takes new weights by restart; set rollout.partial=false)")
    elif keeps_running and capabilities.version_reporting != VersionReporting.PER_TOKEN:
        continued = capabilities.partial_rollouts == PartialRollouts.CONTINUED
        missing.append(f"rollout.max_staleness={needs.max_staleness}: requests kept running across a weight "
                       f"update need per-token versions; this engine reports "
                       f"{'none' if capabilities.version_reporting == VersionReporting.NONE else 'one per engine'} "
                       f"(set rollout.max_staleness=0{', or rollout.partial=true' if continued else ''})")
    elif needs.pause_mode not in capabilities.pause_modes and capabilities.weight_transport != (
            WeightTransport.RESTART):
        missing.append(f"pause mode {needs.pause_mode.name}: it pauses only with "
                       f"{', '.join(sorted(mode.name for mode in capabilities.pause_modes)) or 'nothing'}")
    if needs.seeded and not capabilities.honours_seed:
        missing.append("loop.deterministic=true: a reproducible run draws every sample from a seed; this engine does "
                       "not honour one (use server.engine='tether', or set loop.deterministic=false)")
    if missing:
        raise EngineCapabilityError(f"engine {engine_name!r} cannot honour this run:\n"
                                    + "\n".join(f"- {item}" for item in missing))


def _sampler_refusals(capabilities: EngineCapabilities, needs: EngineRequirements) -> list[str]:
    """What of the run's sampler the learner cannot replay (or the engine cannot apply), one line per reason."""
    steps = needs.sampler_steps
    keys = ", ".join(f"rollout.{step}" for step in steps)
    refusals = [f"rollout.{step}: it does not apply {step} (its sampler: {', '.join(capabilities.sampler_order)}; "
                f"set rollout.{step}={STEP_OFF[step]})" for step in steps if step not in capabilities.sampler_order]
    if not refusals and capabilities.replayed_order(steps) is None:
        facts = _order_facts(capabilities.sampler_order, steps)
        conflicts = min(({pair for pair, fact in facts.items() if _order_facts(order.steps, steps)[pair] != fact}
                         for order in SamplerOrder), key=len)
        fixes = " or ".join(sorted({f"rollout.{step}={STEP_OFF[step]}" for pair in conflicts for step in pair}))
        engine_order = ", ".join(step for step in capabilities.sampler_order if step in steps)
        replayed = " or ".join(f"({', '.join(order.steps)})" for order in SamplerOrder)
        together = " with ".join(f"rollout.{step}" for step in steps)
        refusals.append(f"{together}: it applies them in the order {engine_order}, and the learner replays "
                        f"{replayed} (set {fixes})")
    if needs.logprob_mode == LogprobMode.RAW and steps and needs.max_staleness > 0:
        refusals.append(f"rollout.logprob_mode='raw' with {keys} at rollout.max_staleness={needs.max_staleness}: "
                        "the learner rebuilds the sampling distribution's logprobs from the raw ones with its own "
                        "weights, which are the weights that sampled only when nothing is stale (set "
                        "rollout.max_staleness=0, or rollout.logprob_mode='processed' where the engine offers it)")
    return refusals


def _order_facts(order: tuple[str, ...], steps: Collection[str]) -> dict[tuple[str, str], bool]:
    """For each pair of ORDER_FACTS with both steps used: is the first applied before the second in ``order``?"""
    return {(a, b): order.index(a) < order.index(b) for a, b in ORDER_FACTS
            if a in steps and b in steps and a in order and b in order}


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """The engine's identity and state, checked against the learner's at start."""

    policy_version: int  # the version it serves now
    vocab_size: int  # token ids it can embed (prompts must stay below the learner's vocabulary too)
    eos_token_ids: tuple[int, ...]  # its default stop tokens
    max_seq_len: int  # prompt + completion limit
    model_identity: str  # a digest of the served model's config, or its name


class Engine(abc.ABC):
    """An inference engine as the learner sees it. Backends implement this and declare their capabilities."""

    name: str  # the ``server.engine`` value that selects it
    capabilities: EngineCapabilities

    @abc.abstractmethod
    def info(self) -> EngineInfo:
        """Asks the engine for its current identity and policy version."""

    @abc.abstractmethod
    def submit(self, request: RolloutRequest) -> concurrent.futures.Future[list[Sample]]:
        """Starts sampling a `rollout_client.RolloutRequest`; the future resolves to its list of `Sample`."""

    @abc.abstractmethod
    def publish(self, policy_version: int, weights: Mapping[str, np.ndarray]) -> int:
        """Makes the engine serve ``weights`` as ``policy_version``; returns the version it confirms."""

    def may_have_restarted(self) -> None:  # noqa: B027
        """The engine was unreachable and answers again: it may have been restarted on other weights, so the next
        `publish` must load the weights even at the version published last (`rollout_client.engines.pool` calls this
        before it takes an external engine back). Nothing by default: right for an engine whose `publish` asks the
        engine what it serves (rollout.v1)."""

    def metrics(self) -> dict[str, float]:
        """Counters of the engine's client (retries, drops, ...), logged every step."""
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the connection (and stops an engine process this object launched)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
