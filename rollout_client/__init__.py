"""rollout_client: the engine interface and its backends, the rollout.v1 protocol, its client, batching and
validation of rollouts.

`Engine` is what the learner talks to; each backend declares its `EngineCapabilities` and `check_capabilities`
refuses a run it cannot honour. Backends: `TetherEngine` (rollout.v1), `MlxEngine` (the MLX servicer over its smg
proto, launched here and restarted to publish), `SGLangEngine` and `VllmEngine` (their smg protos, weights loaded from
disk through their HTTP control planes, `HttpControl`). `EnginePool` spreads requests over several engines and
survives engines that die. `rollout_client.engines.smg` is the data plane of the smg engines;
`rollout_client.request_guards`
checks requests and the engine's model before anything reaches an engine.

The reference inference server's shell lives in `rollout_client.server` (``python -m rollout_client.server`` serves
the scripted engine; ``python -m learner.serving`` the learner's model). `EngineProcess` runs an engine's server as a
child process. Nothing here imports flax or `learner`.
"""

from rollout_client.batching import RolloutBatch
from rollout_client.batching import collate
from rollout_client.buffer import RolloutBuffer
from rollout_client.client import AsyncRolloutClient
from rollout_client.client import ClientConfig
from rollout_client.client import RolloutRequest
from rollout_client.engines.base import Engine
from rollout_client.engines.base import EngineCapabilities
from rollout_client.engines.base import EngineCapabilityError
from rollout_client.engines.base import EngineInfo
from rollout_client.engines.base import EngineRequirements
from rollout_client.engines.base import PartialRollouts
from rollout_client.engines.base import VersionReporting
from rollout_client.engines.base import WeightTransport
from rollout_client.engines.base import check_capabilities
from rollout_client.engines.pool import EnginePool
from rollout_client.engines.pool import EnginesDownError
from rollout_client.engines.pool import Member
from rollout_client.engines.pool import PoolConfig
from rollout_client.engines.process import EngineExitedError
from rollout_client.engines.process import EngineProcess
from rollout_client.errors import EngineCallError
from rollout_client.errors import InvalidRolloutError
from rollout_client.errors import PolicyVersionError
from rollout_client.errors import ProtocolError
from rollout_client.errors import RolloutDeadlineError
from rollout_client.errors import RolloutError
from rollout_client.errors import RolloutUnavailableError
from rollout_client.errors import ServerNotReadyError
from rollout_client.errors import ServerSilentError
from rollout_client.engines.http_control import ControlPlaneError
from rollout_client.engines.http_control import ControlPlaneUnavailableError
from rollout_client.engines.http_control import HttpControl
from rollout_client.engines.mlx import MlxEngine
from rollout_client.request_guards import ModelIdentity
from rollout_client.request_guards import ModelMismatchError
from rollout_client.request_guards import PromptLimits
from rollout_client.request_guards import RequestRefusedError
from rollout_client.request_guards import check_model_identity
from rollout_client.sampling_params import FinishReason
from rollout_client.sampling_params import KvCache
from rollout_client.sampling_params import LogprobMode
from rollout_client.sampling_params import PauseMode
from rollout_client.sampling_params import SamplingParams
from rollout_client.samples import Sample
from rollout_client.engines.sglang import SGLangEngine
from rollout_client.sync_client import RolloutClient
from rollout_client.engines.tether import TetherEngine
from rollout_client.validation import ValidationConfig
from rollout_client.engines.vllm import VllmEngine

__all__ = [
    "AsyncRolloutClient",
    "ClientConfig",
    "ControlPlaneError",
    "ControlPlaneUnavailableError",
    "Engine",
    "EngineCapabilities",
    "EngineCallError",
    "EngineCapabilityError",
    "EngineExitedError",
    "EngineInfo",
    "EnginePool",
    "EngineProcess",
    "EngineRequirements",
    "EnginesDownError",
    "FinishReason",
    "HttpControl",
    "InvalidRolloutError",
    "KvCache",
    "LogprobMode",
    "Member",
    "MlxEngine",
    "ModelIdentity",
    "ModelMismatchError",
    "PartialRollouts",
    "PauseMode",
    "PoolConfig",
    "PromptLimits",
    "PolicyVersionError",
    "ProtocolError",
    "RequestRefusedError",
    "RolloutBatch",
    "RolloutBuffer",
    "RolloutClient",
    "RolloutDeadlineError",
    "RolloutError",
    "RolloutRequest",
    "RolloutUnavailableError",
    "SGLangEngine",
    "Sample",
    "SamplingParams",
    "ServerNotReadyError",
    "ServerSilentError",
    "TetherEngine",
    "ValidationConfig",
    "VersionReporting",
    "VllmEngine",
    "WeightTransport",
    "check_capabilities",
    "check_model_identity",
    "collate",
]
