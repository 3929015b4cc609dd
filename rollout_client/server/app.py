"""Builds and runs the grpc.aio server: rollout.v1, health, reflection, auth, TLS, drain.

The server binds 127.0.0.1 unless told otherwise, prints
``rollout-server listening on HOST:PORT`` once it serves (so a parent process that
asked for port 0 learns the bound port), and on SIGTERM or SIGINT reports
NOT_SERVING, stops taking calls and lets active ones finish within the grace period.
If the engine fails in the generation loop (e.g. the device runs out of memory), the
server stops at once and the process exits with `ENGINE_FAILED_EXIT_CODE`, its log
ending with one line that names the error (after the traceback): clients see
UNAVAILABLE, and a launcher sees the exit code, instead of requests that never end.
"""

import asyncio
import dataclasses
import pathlib
import signal
import sys
import traceback

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout_client.protocol import SERVER_OPTIONS, SERVICE_NAME, pb_grpc
from rollout_client.server.auth import TokenAuthInterceptor
from rollout_client.server.generator import Generator
from rollout_client.server.scheduler import Scheduler
from rollout_client.server.service import RolloutServicer

LISTENING_PREFIX = "rollout-server listening on "
ENGINE_FAILED_EXIT_CODE = 70  # sysexits' EX_SOFTWARE: the engine failed while serving.


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Network settings of the reference server."""

    host: str = "127.0.0.1"  # Loopback unless the operator opens it up.
    port: int = 0  # 0 picks a free port; the bound one is printed.
    port_file: pathlib.Path | None = None  # Also written here, if set.
    auth_token: str | None = None  # Shared token required on rollout.v1 calls.
    tls_cert_chain: bytes | None = None  # PEM; TLS when set together with the key.
    tls_private_key: bytes | None = None
    drain_grace_s: float = 10.0  # How long active calls may finish after SIGTERM.
    pause_wait_timeout_s: float = 600.0  # How long Pause(WAIT) waits for active requests.
    policy_version: int = 0  # Version of the initial weights.
    weights_dir: pathlib.Path | None = None  # UpdateWeights reads paths only in here; None: never.


async def serve(config: ServerConfig, generator: Generator,
                servicer_class: type[RolloutServicer] = RolloutServicer) -> None:
    """Serves until SIGTERM or SIGINT, then drains; exits with `ENGINE_FAILED_EXIT_CODE` if the engine fails."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    failures: list[BaseException] = []

    def engine_failed(error: BaseException) -> None:  # on the scheduler's thread
        failures.append(error)
        loop.call_soon_threadsafe(stop.set)

    scheduler = Scheduler(generator, config.policy_version, on_failure=engine_failed)
    interceptors = [TokenAuthInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    servicer = servicer_class(scheduler, generator.info, config.pause_wait_timeout_s, generator.weight_readers,
                              generator.weight_spec, config.weights_dir)
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert_chain and config.tls_private_key:
        credentials = grpc.ssl_server_credentials([(config.tls_private_key, config.tls_cert_chain)])
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file:
        config.port_file.write_text(str(port))
    print(f"{LISTENING_PREFIX}{config.host}:{port}", flush=True)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    if failures:
        error = failures[0]
        await server.stop(0)  # first: what its cancelled calls log comes before the last words
        traceback.print_exception(error, file=sys.stderr)
        print(f"rollout-server: the engine failed, stopping (exit code {ENGINE_FAILED_EXIT_CODE}): "
              f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", file=sys.stderr,
              flush=True)
        sys.exit(ENGINE_FAILED_EXIT_CODE)
    print("rollout-server draining", file=sys.stderr, flush=True)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.drain_grace_s)
    scheduler.close()
