"""A synchronous facade over `AsyncRolloutClient` for learner code.

The async client lives on its own event loop in a daemon thread; every method here
submits a coroutine to that loop. `submit` returns a `concurrent.futures.Future`,
which is how the learner keeps requests in flight while it trains.
"""

import asyncio
import concurrent.futures
import threading
from collections.abc import Mapping

import numpy as np

from rollout_client.client import AsyncRolloutClient, ClientConfig, RolloutRequest
from rollout_client.protocol import pb
from rollout_client.samples import Sample
from rollout_client.sampling_params import KvCache, PauseMode


class RolloutClient:
    """Blocking client; connects (waits for SERVING) on construction.

    Raises:
      ServerNotReadyError: the server was not SERVING within `config.ready_timeout_s`.
    """

    def __init__(self, config: ClientConfig):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self._client = self._run(self._create(config))
        try:
            self.info = self._run(self._client.connect())
        except BaseException:
            self.close()
            raise

    @staticmethod
    async def _create(config: ClientConfig) -> AsyncRolloutClient:
        return AsyncRolloutClient(config)  # Built on the loop that will use its channel.

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def submit(self, request: RolloutRequest) -> concurrent.futures.Future:
        """Starts a Generate; the future resolves to its list of `Sample`."""
        return asyncio.run_coroutine_threadsafe(self._client.generate(request), self._loop)

    def generate(self, request: RolloutRequest) -> list[Sample]:
        """Samples `request` and waits for the result."""
        return self.submit(request).result()

    def server_info(self) -> pb.ServerInfo:
        self.info = self._run(self._client.server_info())
        return self.info

    def pause(self, mode: PauseMode = PauseMode.KEEP, kv_cache: KvCache = KvCache.RECOMPUTE) -> int:
        return self._run(self._client.pause(mode, kv_cache))

    def resume(self) -> int:
        return self._run(self._client.resume())

    def abort(self, request_ids: list[str]) -> list[str]:
        return self._run(self._client.abort(request_ids))

    def stream_weights(self, policy_version: int, weights: Mapping[str, np.ndarray]) -> int:
        """See `AsyncRolloutClient.stream_weights` (the server must be paused)."""
        return self._run(self._client.stream_weights(policy_version, weights))

    def publish_weights(self, policy_version: int, *, weights: Mapping[str, np.ndarray] | None = None,
                        path: str | None = None, weights_format: int = pb.WEIGHTS_FORMAT_SAFETENSORS,
                        pause_mode: PauseMode = PauseMode.KEEP, kv_cache: KvCache = KvCache.RECOMPUTE) -> int:
        """See `AsyncRolloutClient.publish_weights`."""
        return self._run(self._client.publish_weights(
            policy_version, weights=weights, path=path, weights_format=weights_format, pause_mode=pause_mode,
            kv_cache=kv_cache))

    def metrics(self) -> dict[str, int]:
        return self._client.metrics()

    def close(self) -> None:
        """Closes the channel and stops the loop thread."""
        if self._loop.is_closed():
            return
        self._run(_cancel_pending_tasks())  # requests still retrying end now, not as "Task was destroyed" at exit
        if hasattr(self, "_client"):
            self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # else a stuck call keeps it running: leave it (a daemon) to the process exit
            self._loop.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


async def _cancel_pending_tasks() -> None:
    """Cancels every other task of the running loop and waits for them to end."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
