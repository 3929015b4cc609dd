"""The sharded train state's init: the values and shardings of the single-program init, from programs that do not
grow with the number of layers."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from learner.model import param_init
from learner.model.lora import FROZEN, LoraConfig
from learner.model.sharding import make_mesh
from learner.model.transformer import Transformer, model_config
from learner.update.train_state import create_sharded_frozen, create_sharded_train_state, create_train_state


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True, "qk_norm": True, "num_layers": 3}],
                         ids=["untied-qkv-bias", "tied-qk-norm"])
def test_state_equals_the_single_program_init(overrides):
    """Every leaf equals, bit for bit, the one jitted program ``create_train_state(Transformer(...))`` (what the
    sharded build was before it was split into parts), in the shardings of `train_state_shardings`."""
    config, optimizer = model_config("tiny", **overrides), optax.adamw(1e-3)
    _, state, shardings = create_sharded_train_state(config, optimizer, make_mesh(data=4, tensor=2), seed=7)
    expected = jax.jit(lambda: create_train_state(Transformer(config, rngs=nnx.Rngs(7)), optimizer, seed=7))()
    assert jax.tree.structure(state) == jax.tree.structure(expected)
    for (path, want), got, sharding in zip(jax.tree.leaves_with_path(expected), jax.tree.leaves(state),
                                           jax.tree.leaves(shardings)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
        assert got.sharding == sharding, jax.tree_util.keystr(path)


def test_lora_adapters_and_base_equal_the_single_program_init():
    """With LoRA the adapters (the train state) and the frozen base come from the same small programs, the adapters
    drawn after the base as ``Transformer.__init__`` does: both equal the one-program LoRA model's, bit for bit."""
    config = model_config("tiny", lora=LoraConfig(rank=2))
    mesh = make_mesh(data=4, tensor=2)
    _, state, _ = create_sharded_train_state(config, optax.adamw(1e-3), mesh, seed=7)
    frozen, frozen_shardings = create_sharded_frozen(config, mesh, seed=7)
    model = jax.jit(lambda: nnx.state(Transformer(config, rngs=nnx.Rngs(7))))()
    for got, want in ((state.params, nnx.filter_state(model, nnx.Not(FROZEN))), (frozen, nnx.filter_state(model,
                                                                                                          FROZEN))):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for (path, expected), actual in zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected), err_msg=jax.tree_util.keystr(path))
    assert [leaf.sharding for leaf in jax.tree.leaves(frozen)] == jax.tree.leaves(frozen_shardings)


def _compiled_random_draws(tmp_path, num_layers, lora):
    """Calls of ``jax.random.normal`` / ``uniform`` (``_normal``, ``_uniform``: LoRA's ``a``) in every program compiled
    while building a train state (and, with LoRA, the frozen base) with ``num_layers`` blocks (XLA inlines each into
    its own threefry expansion)."""
    dump = tmp_path / f"layers{num_layers}"
    # A shape no other test compiles, so that the first build's programs are not in memory already.
    config = model_config("tiny", hidden_size=40, head_dim=10, intermediate_size=72, num_layers=num_layers,
                          lora=lora)
    mesh = make_mesh(data=4, tensor=2)
    param_init._part_program.cache_clear()  # compiled afresh, not taken from the process's cache
    param_init._adapter_program.cache_clear()
    previous = jax.config.read("jax_dump_ir_to")
    jax.config.update("jax_dump_ir_to", str(dump))
    try:
        create_sharded_train_state(config, optax.adamw(1e-3), mesh)
        create_sharded_frozen(config, mesh)
    finally:
        jax.config.update("jax_dump_ir_to", previous)
    return sum(len(re.findall(r"call @_(normal|uniform)\b", f.read_text())) for f in dump.glob("*.mlir"))


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=2)], ids=["full", "lora"])
def test_init_programs_do_not_grow_with_the_number_of_layers(tmp_path, lora):
    """One threefry expansion per kernel in one program made XLA:GPU compile the init for minutes: the programs
    compiled for 8 blocks draw no more than for 2 (the block's program, and a layer's adapters' program, are compiled
    once and reused). The single-program init drew 23 and 65 normals here; with LoRA the one adapter program (and
    the base built twice) drew 32 and 92 (an H100 took 87 s to build llama-1b's LoRA state that way); now 11 and 11
    (the frozen base reuses the train state's programs)."""
    two = _compiled_random_draws(tmp_path, 2, lora)
    eight = _compiled_random_draws(tmp_path, 8, lora)
    assert two > 0  # the dump saw the init programs
    assert eight <= two
