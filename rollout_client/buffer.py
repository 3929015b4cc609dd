"""A bounded, ordered buffer of in-flight requests for asynchronous RL.

While the learner trains on one group, up to `max_in_flight` further requests are
being generated. Groups come out in submission order (deterministic given the
request stream). Samples whose oldest token is more than `max_staleness` versions
behind the learner are dropped and counted, and so are samples with a token version
ahead of the learner's: only the learner makes versions, so such a sample is corrupt
(and would pass the staleness filter with a negative lag).

Without prefetch (synchronous RL), nothing runs while the learner trains: the
first `get` after the in-flight requests are used up issues the next
`max_in_flight`, so they are sampled by the weights published in between.
"""

import collections
import concurrent.futures
from collections.abc import Iterator

from rollout_client.client import RolloutRequest
from rollout_client.engines.base import Engine
from rollout_client.samples import Sample
from rollout_client.sync_client import RolloutClient


class RolloutBuffer:
    """Keeps `max_in_flight` requests from `requests` running on `client`.

    Args:
      client: where requests run: a `rollout_client.Engine` (what the learner passes) or a `RolloutClient`;
        anything whose ``submit(request)`` returns a future of samples.
      requests: the stream of requests to issue, in order.
      max_in_flight: how many requests run while the learner works (k).
      max_staleness: largest allowed learner version - oldest token version.
      prefetch: refill as soon as a request is taken (False: only when none is left, at the next `get`).
    """

    def __init__(self, client: Engine | RolloutClient, requests: Iterator[RolloutRequest], max_in_flight: int,
                 max_staleness: int, prefetch: bool = True):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {max_in_flight}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        self._client = client
        self._requests = requests
        self._max_in_flight = max_in_flight
        self._max_staleness = max_staleness
        self._prefetch = prefetch
        self._in_flight: collections.deque[concurrent.futures.Future] = collections.deque()
        self.stale_dropped = 0
        self.ahead_dropped = 0
        if prefetch:
            self.fill()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def fill(self) -> None:
        """Submits requests until `max_in_flight` run (or the request stream ends)."""
        while len(self._in_flight) < self._max_in_flight:
            request = next(self._requests, None)
            if request is None:
                return
            self._in_flight.append(self._client.submit(request))

    def get(self, learner_version: int, timeout_s: float | None = None) -> list[Sample]:
        """The oldest request's samples with versions in [learner_version - max_staleness, learner_version].

        Refills the buffer (see `prefetch`).

        Raises:
          StopIteration: nothing in flight and the request stream is exhausted.
          Whatever the request raised (e.g. RolloutError), and TimeoutError.
        """
        if not self._in_flight and not self._prefetch:
            self.fill()
        if not self._in_flight:
            raise StopIteration("rollout buffer: request stream exhausted")
        future = self._in_flight.popleft()
        if self._prefetch:
            self.fill()
        samples = future.result(timeout_s)
        possible = [s for s in samples if s.policy_versions.max() <= learner_version]
        fresh = [s for s in possible if learner_version - s.oldest_version <= self._max_staleness]
        self.ahead_dropped += len(samples) - len(possible)
        self.stale_dropped += len(possible) - len(fresh)
        return fresh

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks until every in-flight request has finished (its samples carry the versions serving now)."""
        concurrent.futures.wait(list(self._in_flight), timeout_s)

    def metrics(self) -> dict[str, int]:
        return {"buffer/in_flight": len(self._in_flight), "buffer/stale_dropped": self.stale_dropped,
                "samples/dropped/version_ahead": self.ahead_dropped}

    def close(self) -> None:
        """Cancels what is still in flight."""
        for future in self._in_flight:
            future.cancel()
        self._in_flight.clear()
