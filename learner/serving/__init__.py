"""The reference server's model generator: the learner's own transformer behind the server shell.

``python -m learner.serving`` serves it (``--help`` lists the arguments); `rollout_client.server` holds the shell it
plugs into (gRPC service, scheduler, network settings), which knows nothing of the model.
"""

from learner.serving.model_generator import ModelGenerator
from learner.serving.model_generator import sample_key
from learner.serving.orbax_weights import read_orbax
from learner.serving.sampling import sample_token

__all__ = [
    "ModelGenerator",
    "read_orbax",
    "sample_key",
    "sample_token",
]
