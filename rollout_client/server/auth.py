"""Shared-token authentication as a server interceptor.

Every call must carry ``authorization: Bearer <token>`` metadata, unknown methods included (so a caller without the
token learns nothing about what is served); health checks and reflection stay open so that probes work without the
secret.

The interceptor runs on the call's method and metadata, before gRPC reads the request message. A refused call gets a
handler that streams requests, so gRPC hands it the call without reading a message first, and it fails without
reading one: an unauthenticated caller cannot make the server buffer its payload.
"""

import hmac

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from rollout_client.protocol import AUTH_METADATA_KEY

OPEN_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call but health and reflection without the right token."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        supplied = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if service in OPEN_SERVICES or hmac.compare_digest(supplied.encode(), self._expected):
            return await continuation(handler_call_details)
        return _DENY


async def _deny(request_iterator, context):
    """Fails the call without reading its request."""
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong token")
    yield  # Makes this an async generator, as a response-streaming handler must be.


_DENY = grpc.stream_stream_rpc_method_handler(_deny)
