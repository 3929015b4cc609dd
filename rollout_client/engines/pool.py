"""Several engines as one, and engines that die: the run keeps sampling while at least one engine serves.

`EnginePool` is itself an `Engine`. Each request goes to the healthy member with the fewest requests in flight. A
member whose request fails because the engine is unreachable is taken out, and the request is sent again to another
member (or waits until one is back). Then:

- a member this run launched (``relaunch`` given) is relaunched, at most ``max_relaunches`` times over the run;
- an external member is probed every ``probe_interval_s`` until it answers;

and before a member takes requests again it is given the current weights (the pool keeps the last published
``(policy_version, weights)``), so no request is ever served by stale weights it was not stamped with. An external
member is told first that it may have been restarted (`Engine.may_have_restarted`): one that remembers the version
it published would otherwise skip loading it again. `publish` sends the weights to every healthy member and returns
once all have confirmed.

When no member is left that could come back (every launched one out of relaunches, and every external one down for
``give_up_after_s``, or hung: silent on a Generate stream, `ServerSilentError`, so not taken back by a probe its
health check answers), every waiting request fails with `EnginesDownError`, whose message names each address and,
for a launched engine, its log file and exit code.

A single engine is a pool of one: that is how the loop survives a dead or restarted engine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np

from rollout_client import errors
from rollout_client.engines.base import Engine, EngineInfo
from rollout_client.engines.http_control import ControlPlaneUnavailableError

logger = logging.getLogger(__name__)

_RESENDS_TO_A_LIVE_ENGINE = 3  # a request failing this often on a launched engine whose process runs: taken out


class EnginesDownError(errors.RolloutError):
    """No engine of the run can serve any more; the message names each one and why."""


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """How hard the pool tries to get its engines back."""

    max_relaunches: int = 3  # per launched engine, over the whole run
    probe_interval_s: float = 2.0  # between attempts to reach an external engine that is down
    give_up_after_s: float = 120.0  # an external engine down this long, with no other engine serving, ends the run

    def __post_init__(self):
        if self.max_relaunches < 0:
            raise ValueError(f"max_relaunches={self.max_relaunches}: must be >= 0")
        for name in ("probe_interval_s", "give_up_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0")


@dataclasses.dataclass
class Member:
    """One engine of the pool.

    Args:
        address: where it serves (for messages and metrics).
        engine: the connected engine.
        relaunch: builds a fresh engine in its place (a launched engine), given the pool's current ``(policy_version,
            weights)`` (None before the first publish); None for an external engine.
    """

    address: str
    engine: Engine
    relaunch: Callable[[tuple[int, Mapping[str, np.ndarray]] | None], Engine] | None = None
    in_flight: int = 0
    served: int = 0  # requests it completed
    publishes: int = 0  # publishes started on it: a request that fails across one was cut by the update, not a death
    publishing: bool = False
    requests: set = dataclasses.field(default_factory=set)  # the futures of its requests in flight
    healthy: bool = True
    relaunches: int = 0
    down_since: float | None = None
    last_failure: str = ""
    took_weights: bool = False  # some publish to it was confirmed: its control endpoint was right once
    hung: bool = False  # taken out for its silence (`ServerSilentError`): an external one is not probed back

    def process_state(self) -> str:
        """For a launched engine: its exit code and log file."""
        process = getattr(self.engine, "process", None)
        if process is None:
            return ""
        return f" (exit code {process.returncode}; log {process.log_path})"


def engine_address(engine: Engine, default: str) -> str:
    """Where ``engine`` serves: its own ``address``, its launched process's, or ``default``."""
    process = getattr(engine, "process", None)
    return getattr(engine, "address", None) or getattr(process, "address", None) or default


def describe_error(error: BaseException) -> str:
    """One line: the error's type and its first line (a gRPC error's status code and details).

    >>> describe_error(RuntimeError("the engine exited\\nend of its log: ..."))
    'RuntimeError: the engine exited'
    """
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        return f"{type(error).__name__}: {error.code().name}: {error.details()}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _named(error: BaseException, call: str) -> BaseException:
    """A gRPC error status or protocol break of ``call`` as an `EngineCallError` naming the engine and the status
    (one line); any other error as it is."""
    if isinstance(error, (grpc.RpcError, errors.ProtocolError)):
        named = errors.EngineCallError(f"{call} failed: {describe_error(error)}")
        named.__cause__ = error
        return named
    return error


def _engine_down(error: BaseException) -> bool:
    """Whether a request failed because its engine is unreachable (not because of the request or its samples)."""
    if isinstance(error, (errors.RolloutUnavailableError, errors.RolloutDeadlineError)):
        return True
    return isinstance(error, grpc.RpcError) and error.code() in (grpc.StatusCode.UNAVAILABLE,
                                                                 grpc.StatusCode.DEADLINE_EXCEEDED)


class EnginePool(Engine):
    """Several engines of one backend behind one `Engine`.

    Args:
        members: the engines, connected; all must serve the same model (checked here).
        config: relaunch and probe limits.

    Raises:
        ValueError: no members, or members that serve different models (names the addresses).
    """

    def __init__(self, members: Sequence[Member], config: PoolConfig = PoolConfig()):
        if not members:
            raise ValueError("EnginePool: at least one engine is needed")
        backends = {type(member.engine) for member in members}
        if len(backends) > 1:
            raise ValueError(f"EnginePool: one backend per run, got {sorted(b.__name__ for b in backends)}")
        self.name, self.capabilities = members[0].engine.name, members[0].engine.capabilities
        self.config = config
        self.members = list(members)
        self._lock = threading.Condition()
        self._current: tuple[int, Mapping[str, np.ndarray]] | None = None
        self._waiting: list[tuple[object, concurrent.futures.Future, int]] = []  # (request, future, resends)
        self._fatal: str | None = None
        self._closed = False
        self._counts = {"engines/redispatched": 0, "engines/relaunches": 0, "engines/taken_out": 0,
                        "engines/taken_back": 0}
        # Publishes run on threads that live as long as the pool: an engine restarted by its publish (MLX) is a
        # child process that dies with the thread that started it (PR_SET_PDEATHSIG, rollout_client.engines.child).
        self._publisher = concurrent.futures.ThreadPoolExecutor(len(self.members), "engine-publish")
        self._check_same_model()
        self._supervisor = threading.Thread(target=self._supervise, name="engine-pool", daemon=True)
        self._supervisor.start()

    def _check_same_model(self) -> None:
        identities = {member.address: member.engine.info() for member in self.members}
        first_address, first = next(iter(identities.items()))
        for address, info in identities.items():
            if (info.vocab_size, info.model_identity) != (first.vocab_size, first.model_identity):
                raise ValueError(f"the engines at {first_address} and {address} serve different models "
                                 f"(vocab {first.vocab_size} vs {info.vocab_size}, identity {first.model_identity!r} "
                                 f"vs {info.model_identity!r}): every engine of a run must serve the same model")

    # Requests.

    def submit(self, request) -> concurrent.futures.Future:
        outer = concurrent.futures.Future()
        outer.set_running_or_notify_cancel()
        self._dispatch(request, outer)
        return outer

    def _dispatch(self, request, outer: concurrent.futures.Future, resends: int = 0) -> None:
        with self._lock:
            if self._closed:
                outer.set_exception(EnginesDownError("the engine pool was closed"))
                return
            if self._fatal is not None:
                outer.set_exception(EnginesDownError(self._fatal))
                return
            healthy = [member for member in self.members if member.healthy]
            if not healthy:
                self._waiting.append((request, outer, resends))
                self._lock.notify_all()
                return
            member = min(healthy, key=lambda m: m.in_flight)
            member.in_flight += 1
            # A request sent during a publish belongs to the weights before it: if the update cuts it, it is resent.
            engine, publishes = member.engine, member.publishes - member.publishing
        try:
            inner = engine.submit(request)
        except Exception as error:  # noqa: BLE001 - the client refused before sending (e.g. a closed channel)
            self._finished(member, engine, publishes, (request, outer, resends), error=error)
            return
        with self._lock:
            member.requests.add(inner)
        inner.add_done_callback(
            lambda done: self._finished(member, engine, publishes, (request, outer, resends), done=done))

    def _finished(self, member: Member, engine: Engine, publishes: int, pending, done=None, error=None) -> None:
        request, outer, resends = pending
        if done is not None:
            error = (errors.RolloutUnavailableError("the engine was replaced while the request ran") if done.cancelled()
                     else done.exception())
        with self._lock:
            member.in_flight -= 1
            member.served += error is None
            member.requests.discard(done)
            cut_by_update = member.publishing or member.publishes != publishes  # e.g. a restart to publish (MLX)
            closed = self._closed  # `close` cancelled it: the engine is fine, the run is over
        if error is None:
            outer.set_result(done.result())
        elif closed:
            outer.set_exception(EnginesDownError("the engine pool was closed"))
        elif _engine_down(error) or self._dead(engine):
            # A launched engine whose process runs was restarting (or was briefly unreachable): resend, a few times.
            alive = getattr(engine, "process", None) is not None and not self._dead(engine)
            if isinstance(error, errors.ServerSilentError):  # hung, however alive its process or health check
                self._take_out(member, engine, describe_error(error), hung=True)
            elif not cut_by_update and not (alive and resends < _RESENDS_TO_A_LIVE_ENGINE):
                self._take_out(member, engine, describe_error(error))
            with self._lock:
                self._counts["engines/redispatched"] += 1
            self._dispatch(request, outer, resends + 1)
        else:
            outer.set_exception(_named(error, f"a request to the engine at {member.address}"))

    @staticmethod
    def _dead(engine: Engine) -> bool:
        process = getattr(engine, "process", None)
        return process is not None and process.returncode is not None

    # Health.

    def _take_out(self, member: Member, engine: Engine, why: str, hung: bool = False) -> None:
        with self._lock:
            if member.engine is not engine or not member.healthy:
                return  # already taken out (or replaced) by another failed request
            member.healthy, member.hung = False, hung
            member.down_since = time.monotonic()
            member.last_failure = why
            self._counts["engines/taken_out"] += 1
            logger.warning("engine at %s taken out: %s", member.address, why)
            self._lock.notify_all()

    def _supervise(self) -> None:
        """Brings members back (relaunch or probe), re-sends waiting requests, gives up when none can return."""
        while True:
            with self._lock:
                while not self._closed and all(member.healthy for member in self.members):
                    self._lock.wait()
                if self._closed:
                    return
                down = [member for member in self.members if not member.healthy]
            for member in down:
                self._try_to_recover(member)
            with self._lock:
                waiting, self._waiting = self._waiting, []
                self._fatal = self._fatal or self._hopeless()
            for request, outer, resends in waiting:
                self._dispatch(request, outer, resends)
            with self._lock:
                if self._fatal is None and not self._closed and any(not m.healthy for m in self.members):
                    self._lock.wait(self.config.probe_interval_s)

    def _try_to_recover(self, member: Member) -> None:
        if member.relaunch is not None:
            if member.relaunches >= self.config.max_relaunches:
                return
            member.relaunches += 1
            with self._lock:
                self._counts["engines/relaunches"] += 1
            old = member.engine
            with self._lock:
                orphans = list(member.requests)
            for request in orphans:  # cancelled, so they are resent: closing their client would leave them unresolved
                request.cancel()
            try:
                old.close()
            except Exception:  # noqa: BLE001 - the old engine is dead; closing is best effort
                pass
            with self._lock:
                current = self._current
            try:
                engine = member.relaunch(current)
            except Exception as error:  # noqa: BLE001 - counted as a failed relaunch; the message keeps why
                member.last_failure = f"relaunch {member.relaunches} failed: {describe_error(error)}"
                return
            member.address = engine_address(engine, member.address)
        else:
            if member.hung:  # its health check and server info answer while its Generate streams stay silent
                return
            engine = member.engine
            try:
                engine.info()
            except Exception:  # noqa: BLE001 - still down; probed again later
                return
            engine.may_have_restarted()  # its operator may have restarted it: the publish below loads for real
        try:
            with self._lock:
                current = self._current
            if current is not None:
                engine.publish(*current)
        except Exception as error:  # noqa: BLE001 - not back yet
            member.last_failure = f"republishing the weights failed: {describe_error(error)}"
            if member.relaunch is not None:
                member.engine = engine  # closed on the next relaunch
            return
        with self._lock:
            member.engine, member.healthy, member.down_since, member.hung = engine, True, None, False
            self._counts["engines/taken_back"] += 1
        logger.warning("engine at %s back in service%s", member.address,
                       f" (relaunch {member.relaunches})" if member.relaunch is not None else "")

    def _hopeless(self) -> str | None:
        """The end-of-run message when no member is serving and none can come back; else None."""
        if any(member.healthy for member in self.members):
            return None
        now = time.monotonic()
        for member in self.members:
            if member.relaunch is not None and member.relaunches < self.config.max_relaunches:
                return None
            if member.relaunch is None and not member.hung and now - member.down_since < self.config.give_up_after_s:
                return None
        parts = []
        for member in self.members:
            if member.relaunch is not None:
                parts.append(f"the launched engine at {member.address}{member.process_state()} was relaunched "
                             f"{member.relaunches} times (max_relaunches) and is down: {member.last_failure}")
            elif member.hung:
                parts.append(f"the engine at {member.address} is hung ({member.last_failure})")
            else:
                parts.append(f"the engine at {member.address} has been unreachable for "
                             f"{now - member.down_since:.0f} s: {member.last_failure}")
        return "no inference engine is serving: " + "; ".join(parts)  # one line: the run's last words

    # Weights and identity.

    def publish(self, policy_version: int, weights: Mapping[str, np.ndarray]) -> int:
        """Publishes to every healthy member (concurrently) and returns once all confirmed ``policy_version``.

        A member that fails here is taken out, and gets these weights when it is back.

        Raises:
            EnginesDownError: no member took the weights and none can come back.
        """
        with self._lock:
            self._current = (policy_version, weights)
            healthy = [(member, member.engine) for member in self.members if member.healthy]
            for member, _ in healthy:
                member.publishes, member.publishing = member.publishes + 1, True
        try:
            futures = {self._publisher.submit(engine.publish, policy_version, weights): (member, engine)
                       for member, engine in healthy}
            concurrent.futures.wait(futures)
        finally:
            with self._lock:
                for member, _ in healthy:
                    member.publishing = False
        confirmed = []
        for future, (member, engine) in futures.items():
            error = future.exception()
            if error is None:
                confirmed.append(future.result())
                member.took_weights = True
            elif (_engine_down(error) or self._dead(engine)
                  or (isinstance(error, ControlPlaneUnavailableError) and member.took_weights)):
                # An unreachable control endpoint that answered before is an outage (e.g. its operator restarts the
                # engine); one that never answered is a wrong address, reported now (not after give_up_after_s).
                self._take_out(member, engine, f"publish failed: {describe_error(error)}")
            else:
                raise _named(error, f"publishing to the engine at {member.address}")
        if not confirmed:
            return self._wait_for_one(policy_version)
        return min(confirmed)

    def _wait_for_one(self, policy_version: int) -> int:
        """Blocks until some member is back (it got the current weights on its way back) or the pool gives up."""
        with self._lock:
            while not any(member.healthy for member in self.members):
                if self._fatal is not None:
                    raise EnginesDownError(self._fatal)
                self._lock.notify_all()
                self._lock.wait(self.config.probe_interval_s)
        return policy_version

    def info(self) -> EngineInfo:
        with self._lock:
            healthy = [member.engine for member in self.members if member.healthy]
        return (healthy or [self.members[0].engine])[0].info()

    def metrics(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        with self._lock:
            engines = [member.engine for member in self.members if member.healthy]
            counts = dict(self._counts, **{"engines/healthy": len(engines)})
        for engine in engines:
            for name, value in engine.metrics().items():
                totals[name] = totals.get(name, 0) + value
        return totals | counts

    def close(self) -> None:
        """Closes every member; requests waiting or still in flight fail with `EnginesDownError` ("the engine pool
        was closed"), without taking any engine out or resending."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._lock.notify_all()
        for _, outer, _ in waiting:
            outer.set_exception(EnginesDownError("the engine pool was closed"))
        self._supervisor.join(timeout=30)
        self._publisher.shutdown(wait=True)
        for member in self.members:
            try:
                member.engine.close()
            except Exception:  # noqa: BLE001 - close every member even if one fails
                pass
