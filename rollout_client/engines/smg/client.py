"""Clients of an engine that speaks an smg proto: rollout.v1's clients with the engine's data plane underneath.

`AsyncSmgClient` is `rollout_client.AsyncRolloutClient` whose stub is `rollout_client.engines.smg.adapter.SmgAdapter`:
sampling,
retries, deadlines, validation and the `Sample` objects are the rollout.v1 client's own. The smg protos have no
pause or weight RPCs: those methods raise, and the engine's control plane (e.g. `rollout_client.MlxEngine.publish`,
which restarts the engine) changes weights, holding admission meanwhile (`hold`, `release`).
`SmgClient` is the blocking facade, like `rollout_client.RolloutClient`.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_client.client import AsyncRolloutClient, ClientConfig
from rollout_client.engines.smg.adapter import SmgAdapter, SmgHealth
from rollout_client.engines.smg.dialects import SmgDialect
from rollout_client.sync_client import RolloutClient

__all__ = ["AsyncSmgClient", "SmgClient"]


class AsyncSmgClient(AsyncRolloutClient):
    """A client of one smg engine; create on the event loop that uses it, then ``await connect()``.

    Args:
      config: how to reach it (``auth_token`` and TLS as for rollout.v1).
      dialect: its proto.
      check_alive: raises if a launched engine's process exited (`rollout_client.EngineProcess.check_alive`).
      continue_interrupted: continue samples a publish interrupts from their tokens
        (`rollout_client.engines.smg.adapter`).
    """

    def __init__(self, config: ClientConfig, dialect: SmgDialect, check_alive: Callable[[], None] | None = None,
                 continue_interrupted: bool = False):
        super().__init__(config)
        self._stub = SmgAdapter(self._channel, dialect, check_alive, continue_interrupted)
        self._health = SmgHealth(self._stub)

    @property
    def model_info(self):
        """The engine's last GetModelInfoResponse (fetched by `connect` and `server_info`)."""
        return self._stub.model_info

    async def hold(self) -> None:
        """Admits no new engine request until `release`."""
        self._stub.hold()

    async def release(self, policy_version: int) -> None:
        """Admits requests again, stamped ``policy_version``."""
        self._stub.release(policy_version)
        if self._info is not None:
            self._info.policy_version = policy_version

    async def engine_rpc(self, method: str, request):
        """One unary RPC of the engine's own service (e.g. SGLang's ``LoadLoRAAdapter``), with the control deadline
        and the client's credentials; returns its reply (a gRPC error propagates)."""
        return await self._stub.call(method, request, self.config.control_deadline_s, self._metadata)

    def metrics(self) -> dict[str, int]:
        return {**super().metrics(), "generate/engine_calls": self._stub.engine_calls,
                "generate/continuations": self._stub.continuations}

    def _no_control_plane(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{method}: the {self._stub.dialect.name} engine's proto has no pause or weight "
                                   "RPCs; its engine object publishes weights (Engine.publish)")

    async def pause(self, mode=None, kv_cache=None) -> int:
        raise self._no_control_plane("pause")

    async def resume(self) -> int:
        raise self._no_control_plane("resume")

    async def stream_weights(self, policy_version, weights) -> int:
        raise self._no_control_plane("stream_weights")

    async def update_weights_from_path(self, policy_version, path, weights_format=None) -> int:
        raise self._no_control_plane("update_weights_from_path")


class SmgClient(RolloutClient):
    """Blocking client of one smg engine; connects (waits until the engine is healthy) on construction.

    Args: as `AsyncSmgClient`.

    Raises:
      ServerNotReadyError: not healthy within ``config.ready_timeout_s``.
      EngineExitedError: ``check_alive`` found the launched engine dead.
    """

    def __init__(self, config: ClientConfig, dialect: SmgDialect, check_alive: Callable[[], None] | None = None,
                 continue_interrupted: bool = False):
        self._dialect, self._check_alive, self._continue = dialect, check_alive, continue_interrupted
        super().__init__(config)

    async def _create(self, config: ClientConfig) -> AsyncSmgClient:
        return AsyncSmgClient(config, self._dialect, self._check_alive, self._continue)

    @property
    def model_info(self):
        return self._client.model_info

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Waits until the engine is healthy, then refreshes `model_info` (e.g. after a restart)."""
        self._run(self._client.wait_ready(timeout_s))
        self.server_info()

    def hold(self) -> None:
        self._run(self._client.hold())

    def release(self, policy_version: int) -> None:
        self._run(self._client.release(policy_version))

    def engine_rpc(self, method: str, request):
        """`AsyncSmgClient.engine_rpc`, blocking."""
        return self._run(self._client.engine_rpc(method, request))
