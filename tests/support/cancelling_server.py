"""The scripted reference server, except that it ends the first ``--cancel-attempts`` Generate calls of every request
id with ``--status`` (default CANCELLED, as a server shutting down or a transport that drops a call does).

Run as ``python -m tests.support.cancelling_server --cancel-attempts N [--status NAME] [server args]``.
"""

import collections

import grpc

from rollout_client.server.__main__ import add_scripted_arguments, scripted_engine
from rollout_client.server.cli import run, server_parser
from rollout_client.server.service import RolloutServicer

CANCEL_ATTEMPTS, STATUS = 1, grpc.StatusCode.CANCELLED  # set by main from --cancel-attempts and --status


class CancellingServicer(RolloutServicer):
    """Ends the first `CANCEL_ATTEMPTS` Generate calls of each request id with `STATUS` before it sends anything."""

    attempts: collections.Counter = collections.Counter()

    async def Generate(self, request, context):
        self.attempts[request.request_id] += 1
        if self.attempts[request.request_id] <= CANCEL_ATTEMPTS:
            await context.abort(STATUS, f"{STATUS.name} from tests.support.cancelling_server")
        async for message in super().Generate(request, context):
            yield message


def main() -> None:
    global CANCEL_ATTEMPTS, STATUS
    parser = server_parser("python -m tests.support.cancelling_server")
    add_scripted_arguments(parser)
    parser.add_argument("--cancel-attempts", type=int, default=1)
    parser.add_argument("--status", default="CANCELLED", help="a grpc.StatusCode name")
    known = parser.parse_known_args()[0]
    CANCEL_ATTEMPTS, STATUS = known.cancel_attempts, grpc.StatusCode[known.status]
    run(parser, {"scripted": scripted_engine}, None, CancellingServicer)


if __name__ == "__main__":
    main()
