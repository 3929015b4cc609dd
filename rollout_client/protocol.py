"""The rollout.v1 wire protocol: generated stubs and the settings both ends must share.

Client and server import these constants from one place so that their message size
limits and keepalive policies cannot drift apart (a client that pings more often than
the server permits gets its connection closed with GOAWAY "too_many_pings").
"""

from rollout_client.proto.rollout.v1 import rollout_pb2 as pb
from rollout_client.proto.rollout.v1 import rollout_pb2_grpc as pb_grpc  # noqa: F401 (the stubs, for both ends)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# The largest message the server reads. gRPC Python has only a server-wide receive limit, not one per method, so it
# is small: a Generate request is a prompt of at most max_seq_len int32 ids, and StreamWeights sends weights in
# chunks of `weight_chunks.DEFAULT_CHUNK_BYTES` (4 MiB) plus a small header, which fit.
SERVER_MAX_RECEIVE_BYTES = 8 * 1024 * 1024
# Policy versions are integers below 2^53, so that they survive a float64 (JSON, numpy) round trip exactly, and so
# that one update cannot take the largest int64 and block every later one.
MAX_POLICY_VERSION = 2**53 - 1
AUTH_METADATA_KEY = "authorization"
CLIENT_KEEPALIVE_TIME_MS = 30_000
MIN_CHUNK_TOKENS = 64

CLIENT_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly after a server restart (gRPC's default waits 1 s, then longer).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Retries are done by the client code (it knows when a stream already yielded).
    ("grpc.enable_retries", 0),
)
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", SERVER_MAX_RECEIVE_BYTES),
    # Permits the client's pings: at most one per half its interval, also when idle.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", CLIENT_KEEPALIVE_TIME_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries the shared auth token."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)
