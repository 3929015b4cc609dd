"""Parameter paths: one spelling for the live nnx state, its orbax round trip and the optimizer state."""

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from learner.model.param_paths import named_leaves, parameter_names, update_named
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


def test_update_named_sets_every_parameter_from_named_leaves():
    source = Transformer(model_config("tiny"), rngs=nnx.Rngs(7))
    target = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
    weights = {name: np.asarray(leaf) for name, leaf in named_leaves(nnx.state(source, nnx.Param)).items()}
    update_named(target, weights)
    got = named_leaves(nnx.state(target, nnx.Param))
    assert got.keys() == weights.keys()
    for name, array in weights.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_update_named_names_a_missing_parameter():
    model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
    weights = {name: np.asarray(leaf) for name, leaf in named_leaves(nnx.state(model, nnx.Param)).items()}
    del weights["final_norm/scale"]
    with pytest.raises(KeyError, match="'final_norm/scale' has no array in the weights \\(1 missing in all\\)"):
        update_named(model, weights)


def test_update_named_names_a_parameter_of_another_shape():
    model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
    weights = {name: np.asarray(leaf) for name, leaf in named_leaves(nnx.state(model, nnx.Param)).items()}
    weights["final_norm/scale"] = np.ones(65, np.float32)
    with pytest.raises(ValueError, match="'final_norm/scale': the weights' array has shape \\(65,\\), the model's "
                                         "\\(64,\\)"):
        update_named(model, weights)
