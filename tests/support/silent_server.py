"""A hung rollout.v1 server: the scripted reference server whose Generate streams never send anything (no sample,
no heartbeat), while its health check, GetServerInfo and the weight updates answer, as a server whose generation
loop is wedged does. ``--engine scripted`` (default) or ``--engine model`` (the reference model server's engine and
arguments).

Run as ``python -m tests.support.silent_server [server args]``.
"""

import asyncio

from learner.serving.__main__ import add_model_arguments, build_model_generator
from rollout_client.server.__main__ import add_scripted_arguments, scripted_engine
from rollout_client.server.cli import run, server_parser
from rollout_client.server.service import RolloutServicer


class SilentServicer(RolloutServicer):
    """Accepts every Generate call and never answers it."""

    async def Generate(self, request, context):
        await asyncio.Event().wait()
        yield  # unreachable: makes this an async generator, as a streaming handler is


def main() -> None:
    parser = server_parser("python -m tests.support.silent_server")
    add_scripted_arguments(parser)
    add_model_arguments(parser)
    run(parser, {"scripted": scripted_engine, "model": build_model_generator}, None, SilentServicer)


if __name__ == "__main__":
    main()
