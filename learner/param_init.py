"""The Transformer's initial parameters, built in their shardings by a few small programs, one per kind of part.

One jitted program for the token embedding, one for a transformer block (compiled once, run for every layer), one
for the final norm, one for the output head and, with LoRA, one for a layer's adapters (also run for every layer). A single program for the whole model (what
``jax.jit(lambda: Transformer(config, rngs=nnx.Rngs(seed)))`` is) holds one threefry expansion per kernel, so its
size grows with the number of layers (~70k HLO instructions at the qwen2-0.5b shape) and XLA:GPU compiled it for
minutes. The parts draw from one ``nnx.Rngs(seed)`` stream in the Transformer's construction order, the stream's
state passed from one program to the next, so the values equal ``Transformer(config, rngs=nnx.Rngs(seed))``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from learner.lora import FROZEN, LoRA, LoraConfig, adapter_shapes, adapter_targets
from learner.model import Block, ModelConfig, Projection, RMSNorm, Transformer, output_head, token_embedding


def init_sharded_params(config: ModelConfig, shardings: nnx.State, seed: int = 0) -> nnx.State:
    """``nnx.state(Transformer(config, rngs=nnx.Rngs(seed)))``, every leaf created directly in ``shardings``.

    Args:
        config: the model's shapes and dtypes.
        shardings: NamedShardings of the model's state (e.g. `learner.sharding.state_shardings` of it).
        seed: the seed of the ``nnx.Rngs`` the parameters are drawn from.

    Example:
        >>> from learner.model import model_config
        >>> from learner.sharding import make_mesh, state_shardings
        >>> config = model_config("tiny")
        >>> abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
        >>> params = init_sharded_params(config, state_shardings(abstract, make_mesh(data=4, tensor=2)))
        >>> params["lm_head"]["kernel"].get_value().sharding.spec
        P('fsdp', 'tensor')
    """
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed)))
    base_shardings = nnx.filter_state(shardings, FROZEN)  # the parts build no adapters
    parts: list[tuple[nnx.Module, Callable[[nnx.Rngs], nnx.Module], nnx.State]] = [
        (model.embed, lambda rngs: token_embedding(config, rngs), base_shardings["embed"])]
    parts += [(block, lambda rngs: Block(config, rngs=rngs), base_shardings["layers"][i])
              for i, block in enumerate(model.layers)]
    parts.append((model.final_norm, lambda rngs: RMSNorm(config), base_shardings["final_norm"]))
    if model.lm_head is not None:
        parts.append((model.lm_head, lambda rngs: output_head(config, rngs), base_shardings["lm_head"]))

    replicated = NamedSharding(jax.tree.leaves(shardings)[0].mesh, P())
    rngs_graphdef, rngs_state = nnx.split(nnx.Rngs(seed))
    programs = {}  # one per kind of part and shardings: every block shares one
    for module, build, part_shardings in parts:
        leaves, treedef = jax.tree.flatten(part_shardings)
        key = (type(module), treedef, tuple(leaves))
        if key not in programs:
            programs[key] = jax.jit(_part_program(build, rngs_graphdef), out_shardings=(part_shardings, replicated))
        part_state, rngs_state = programs[key](rngs_state)
        nnx.update(module, part_state)
    if config.lora is not None:  # drawn last, as Transformer.__init__ attaches them after the base, in its order
        for group in _adapter_groups(model, config):
            group_shardings = [_at(shardings, path)["lora"] for path, _ in group]
            shapes = tuple(adapter_shapes(module) for _, module in group)
            leaves, treedef = jax.tree.flatten(group_shardings)
            key = (LoRA, shapes, treedef, tuple(leaves))
            if key not in programs:
                programs[key] = jax.jit(_adapter_program(shapes, config.lora, rngs_graphdef),
                                        out_shardings=(group_shardings, replicated))
            adapters, rngs_state = programs[key](rngs_state)
            for (_, module), adapter in zip(group, adapters):
                nnx.update(module.lora, adapter)
    params = nnx.state(model)
    unset = [path for path, leaf in jax.tree.leaves_with_path(params) if not isinstance(leaf, jax.Array)]
    if unset:  # a part of the Transformer this module does not build
        raise RuntimeError(f"init_sharded_params left {jax.tree_util.keystr(unset[0])} unset: build every part of "
                           "Transformer.__init__ here, in its order")
    return params


def _part_program(build: Callable[[nnx.Rngs], nnx.Module], rngs_graphdef: nnx.GraphDef
                  ) -> Callable[[nnx.State], tuple[nnx.State, nnx.State]]:
    """``rngs state -> (state of build(rngs), the advanced rngs state)``, to be jitted."""
    def program(rngs_state):
        rngs = nnx.merge(rngs_graphdef, rngs_state)
        part = build(rngs)
        return nnx.state(part), nnx.state(rngs)
    return program


def _adapter_groups(model: Transformer, config: ModelConfig) -> list[list[tuple[tuple, Projection]]]:
    """The targeted projections in their drawing order, cut into runs of one layer each (``layers/<i>/...``, the
    only places adapters go): every layer with the same targets then shares one program."""
    groups: list[list[tuple[tuple, Projection]]] = []
    for path, module in adapter_targets(model, config.lora, Projection):
        if not groups or groups[-1][0][0][:2] != path[:2]:
            groups.append([])
        groups[-1].append((path, module))
    return groups


def _at(state: nnx.State, path: tuple) -> nnx.State:
    """The sub-state of ``state`` at a module's ``path``."""
    for key in path:
        state = state[key]
    return state


def _adapter_program(shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], lora: LoraConfig,
                     rngs_graphdef: nnx.GraphDef) -> Callable[[nnx.State], tuple[list[nnx.State], nnx.State]]:
    """``rngs state -> (the states of a LoRA per (in_shape, out_shape) of shapes, the advanced rngs state)``, to be
    jitted; one run builds one layer's adapters."""
    def program(rngs_state):
        rngs = nnx.merge(rngs_graphdef, rngs_state)
        adapters = [nnx.state(LoRA(in_shape, out_shape, lora, rngs=rngs)) for in_shape, out_shape in shapes]
        return adapters, nnx.state(rngs)
    return program
