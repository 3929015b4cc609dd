"""Shared-token authentication as a server interceptor.

Every rollout.v1 call must carry ``authorization: Bearer <token>`` metadata; health
checks and reflection stay open so that probes work without the secret.
"""

import hmac

import grpc

from rollout_client.protocol import AUTH_METADATA_KEY
from rollout_client.protocol import SERVICE_NAME


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to rollout.v1 calls without the right token."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(handler_call_details)
        supplied = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(supplied.encode(), self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _deny_like(handler)


def _deny_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that fails with UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong token")

    async def deny_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong token")
        yield  # Makes this an async generator, as a server-streaming handler must be.

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
