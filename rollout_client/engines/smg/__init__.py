"""The data plane of the engines that speak an smg proto (``smg-grpc-proto``: MLX, SGLang, vLLM).

`SmgDialect` says what differs between the engines' protos (`MLX` so far); `SmgAdapter` answers rollout.v1's sampling
calls over any of them, so that `AsyncSmgClient` / `SmgClient` are the rollout.v1 clients with their retries,
deadlines, validation and `Sample` objects. A new smg engine is a new dialect plus its control plane.
"""

from rollout_client.engines.smg.client import AsyncSmgClient
from rollout_client.engines.smg.client import SmgClient
from rollout_client.engines.smg.dialects import MLX
from rollout_client.engines.smg.dialects import EngineSampling
from rollout_client.engines.smg.dialects import SmgDialect
from rollout_client.engines.smg.adapter import SmgAdapter
from rollout_client.engines.smg.adapter import SmgHealth

__all__ = [
    "MLX",
    "AsyncSmgClient",
    "EngineSampling",
    "SmgAdapter",
    "SmgClient",
    "SmgDialect",
    "SmgHealth",
]
