"""One vLLM engine serving smg's VllmEngine gRPC (the data plane) and vLLM's HTTP API (the control plane).

Runs in vLLM's own environment (vLLM, ``smg-grpc-servicer``), not Tether's: it imports nothing of Tether.
`rollout_client.engines.process.EngineProcess` runs it by its path (``server.engine = "vllm"`` without
``server.address``). No stock vLLM process serves both on one engine: ``vllm serve --grpc`` /
``python -m vllm.entrypoints.launchers.grpc_server`` serve the gRPC alone, ``vllm serve`` the HTTP alone; Tether
samples over the first and pauses and reloads weights over the second (``/pause``, ``/resume``, ``/is_paused`` from
``vllm/entrypoints/rl/online/api_router.py``, ``/collective_rpc`` from ``vllm/entrypoints/serve/dev/rpc``, both
with ``VLLM_SERVER_DEV_MODE=1``).

Usage (every flag of ``vllm serve`` is taken, ``--port`` excepted)::

    VLLM_SERVER_DEV_MODE=1 python rollout_client/engines/vllm_server.py --port GRPC_PORT --http-port HTTP_PORT \\
        --host 127.0.0.1 --model CHECKPOINT_DIR [vLLM flags...]

One engine (vLLM's ``build_async_engine_client``, as ``vllm serve`` builds it) is shared by smg's
``VllmEngineServicer`` on ``grpc.aio`` and vLLM's own FastAPI app (``build_and_serve``). The gRPC server starts last,
once the HTTP API answers: a healthy gRPC server means both planes are up. SIGTERM stops both and the engine.
"""

import argparse
import asyncio
import os
import signal
import socket
import sys
import time

_GRPC_OPTIONS = [  # as vLLM's own gRPC launcher (vllm/entrypoints/launchers/grpc_server.py)
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", True),
]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, int]:
    """vLLM's ``serve`` arguments (its ``--port`` is the HTTP API's, from ``--http-port``) and the gRPC port."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ports = argparse.ArgumentParser(add_help=False)
    ports.add_argument("--port", type=int, required=True, help="the gRPC data plane's port")
    ports.add_argument("--http-port", type=int, required=True, help="vLLM's HTTP API's port")
    ours, rest = ports.parse_known_args(argv)
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm_server.py")).parse_args(
        [*rest, "--port", str(ours.http_port)])
    validate_parsed_serve_args(args)
    return args, ours.port


async def _wait_listening(host: str, port: int) -> None:
    """Returns once something accepts TCP connections at ``host:port``."""
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return


async def _serve_grpc(engine, host: str, port: int, http_port: int, started: float):
    """smg's servicer and gRPC health service on ``engine``, started once the HTTP API listens."""
    import grpc
    from grpc_health.v1 import health_pb2_grpc
    from smg_grpc_proto import vllm_engine_pb2_grpc
    from smg_grpc_servicer.vllm.health_servicer import VllmHealthServicer
    from smg_grpc_servicer.vllm.servicer import VllmEngineServicer

    server = grpc.aio.server(options=_GRPC_OPTIONS)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(engine, started), server)
    health_pb2_grpc.add_HealthServicer_to_server(VllmHealthServicer(engine), server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port}")
    await _wait_listening(host, http_port)
    await server.start()
    print(f"vllm_server: gRPC on {host}:{port}, HTTP on {host}:{http_port}, ready after "
          f"{time.time() - started:.1f} s", flush=True)
    return server


def _stop_if_failed(task: asyncio.Task) -> None:
    """A gRPC server that could not start stops the process (SIGTERM: vLLM's HTTP server shuts the engine down)."""
    if not task.cancelled() and task.exception() is not None:
        print(f"vllm_server: the gRPC server failed: {task.exception()!r}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)


async def serve(args: argparse.Namespace, grpc_port: int) -> None:
    """Builds the engine, serves both planes until SIGTERM/SIGINT, then stops them and the engine."""
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve, build_async_engine_client
    from vllm.entrypoints.launchers.launcher import setup_server

    started = time.time()
    listen_address, sock = setup_server(args, reuse_port=False)  # binds the HTTP port before the engine loads
    grpc_server = None
    async with build_async_engine_client(args) as engine:
        host = args.host or "127.0.0.1"
        grpc_task = asyncio.create_task(_serve_grpc(engine, host, grpc_port, args.port, started))
        grpc_task.add_done_callback(_stop_if_failed)
        try:
            shutdown = await build_and_serve(engine, listen_address, sock, args)  # returns when HTTP stops
        finally:
            if grpc_task.done() and grpc_task.exception() is None:
                grpc_server = grpc_task.result()
                await grpc_server.stop(grace=5.0)
            else:
                grpc_task.cancel()
    try:
        await shutdown
    finally:
        sock.close()


def main(argv: list[str]) -> None:
    import uvloop
    from vllm.logger import configure_logging_from_args

    args, grpc_port = parse_args(argv)
    configure_logging_from_args(args)
    with socket.socket() as probe:  # fail fast, before the engine loads, on a taken gRPC port
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((args.host or "127.0.0.1", grpc_port))
    uvloop.run(serve(args, grpc_port))


if __name__ == "__main__":
    main(sys.argv[1:])
