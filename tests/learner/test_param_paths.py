"""Parameter paths: one spelling for the live nnx state, its orbax round trip and the optimizer state."""

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from learner.model.param_paths import parameter_names
from learner.model.transformer import Transformer, model_config
from learner.serving import read_orbax


@pytest.fixture(scope="module")
def state():
    return nnx.state(Transformer(model_config("tiny"), rngs=nnx.Rngs(0)))


def test_names_are_the_nnx_flat_state_paths_joined(state):
    names, _ = parameter_names(state)
    assert len(names) == len(set(names))
    assert sorted(names) == sorted("/".join(map(str, path)) for path, _ in nnx.to_flat_state(state))


def test_orbax_checkpoint_of_nnx_state_reads_back_under_the_same_names(state, tmp_path):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
    weights = read_orbax(str(tmp_path / "ckpt"))
    names, _ = parameter_names(state)
    assert sorted(weights) == sorted(names)
    np.testing.assert_array_equal(weights["embed/embedding"], np.asarray(state["embed"]["embedding"].get_value()))


def test_optimizer_moments_are_named_like_their_parameters():
    names, _ = parameter_names(optax.adam(0.1).init({"mlp": {"kernel": jnp.zeros(2)}}))
    assert names == ["0", "0/mlp/kernel", "0/mlp/kernel"]  # count, mu, nu: attribute keys are not part of a path
