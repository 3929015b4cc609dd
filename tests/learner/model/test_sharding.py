"""Sharding: mesh construction, rule matching and divisibility fallback, same logits on every mesh shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from learner.model.sharding import batch_sharding, make_mesh, partition_spec, shard_state, state_shardings
from learner.model.transformer import Transformer, model_config


@pytest.fixture(scope="module")
def model_and_batch():
    model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    lengths = np.array([16, 9, 3, 12, 16, 1, 7, 10])
    mask = np.arange(16)[None, :] < lengths[:, None]
    tokens = jnp.asarray(np.where(mask, rng.integers(0, 128, (8, 16)), 0), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (8, 16))
    return model, (tokens, positions, jnp.asarray(mask))


def _sharded_logits(model, batch, mesh):
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)
    data = batch_sharding(mesh)

    def forward(state, tokens, positions, mask):
        model = nnx.merge(graphdef, state)
        return model.logits(model(tokens, positions, mask))

    forward = jax.jit(forward, in_shardings=(shardings, data, data, data), out_shardings=data)
    return forward(shard_state(state, mesh), *batch)


def test_logits_equal_on_every_mesh(model_and_batch):
    model, batch = model_and_batch
    reference = _sharded_logits(model, batch, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    for data, fsdp, tensor in [(8, 1, 1), (2, 4, 1), (2, 2, 2)]:
        logits = _sharded_logits(model, batch, make_mesh(data, fsdp, tensor))
        np.testing.assert_allclose(logits, reference, atol=1e-5, rtol=1e-5, err_msg=f"mesh {(data, fsdp, tensor)}")


def test_make_mesh_fills_the_rest_and_validates():
    assert dict(make_mesh(fsdp=4).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(make_mesh(data=2, fsdp=-1, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="needs 4 devices"):
        make_mesh(2, 2, 1)
    with pytest.raises(ValueError, match="-1"):
        make_mesh(-1, -1, 1)


def test_first_matching_rule_wins():
    mesh = make_mesh(2, 2, 2)
    rules = ((r"kernel$", P("tensor")), (r"lm_head/kernel$", P("fsdp")), (r".*", P()))
    assert partition_spec("lm_head/kernel", (8, 8), mesh, rules) == P("tensor")
    assert partition_spec("final_norm/scale", (8,), mesh, rules) == P()


def test_indivisible_dimension_is_replicated():
    mesh = make_mesh(2, 2, 2)
    assert partition_spec("embed/embedding", (151_937, 64), mesh) == P(None, "fsdp")
    assert partition_spec("x", (6, 4), mesh, ((r"x", P(("data", "fsdp", "tensor"), "tensor")),)) == P(None, "tensor")


def test_unmatched_path_is_an_error():
    with pytest.raises(ValueError, match="no_rule"):
        partition_spec("no_rule", (4,), make_mesh(), ((r"^kernel$", P()),))


def test_default_rules_shard_attention_heads_and_mlp_width(model_and_batch):
    model, _ = model_and_batch
    shardings = state_shardings(nnx.state(model), make_mesh(2, 2, 2))
    layer = shardings["layers"][0]
    assert layer["attn"]["q_proj"]["kernel"].get_value().spec == P("fsdp", "tensor", None)
    assert layer["attn"]["o_proj"]["kernel"].get_value().spec == P("tensor", None, "fsdp")
    assert layer["mlp"]["down_proj"]["kernel"].get_value().spec == P("tensor", "fsdp")
    assert layer["attn_norm"]["scale"].get_value().spec == P()
