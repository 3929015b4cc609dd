"""The Transformer's initial parameters, built in their shardings by a few small programs, one per kind of part.

One jitted program for the token embedding, one for a transformer block (compiled once, run for every layer), one
for the final norm, one for the output head and, with LoRA, one for a layer's adapters (also run for every layer),
each cached for the process. A single program for the whole model (what
``jax.jit(lambda: Transformer(config, rngs=nnx.Rngs(seed)))`` is) holds one threefry expansion per kernel, so its
size grows with the number of layers (~70k HLO instructions at the qwen2-0.5b shape) and XLA:GPU compiled it for
minutes. The parts draw from one ``nnx.Rngs(seed)`` stream in the Transformer's construction order, the stream's
state passed from one program to the next, so the values equal ``Transformer(config, rngs=nnx.Rngs(seed))``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from learner.model.lora import FROZEN, LoRA, LoraConfig, adapter_shapes, adapter_targets, base_config
from learner.model.transformer import Block, ModelConfig, Projection, RMSNorm, Transformer, output_head, token_embedding


def init_sharded_params(config: ModelConfig, shardings: nnx.State, seed: int = 0) -> nnx.State:
    """``nnx.state(Transformer(config, rngs=nnx.Rngs(seed)))``, every leaf created directly in ``shardings``.

    Args:
        config: the model's shapes and dtypes.
        shardings: NamedShardings of the model's state (e.g. `learner.model.sharding.state_shardings` of it).
        seed: the seed of the ``nnx.Rngs`` the parameters are drawn from.

    Example:
        >>> from learner.model.transformer import model_config
        >>> from learner.model.sharding import make_mesh, state_shardings
        >>> config = model_config("tiny")
        >>> abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
        >>> params = init_sharded_params(config, state_shardings(abstract, make_mesh(data=4, tensor=2)))
        >>> params["lm_head"]["kernel"].get_value().sharding.spec
        P('fsdp', 'tensor')
    """
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed)))
    base, base_shardings = base_config(config), nnx.filter_state(shardings, FROZEN)  # the parts build no adapters
    parts = [("embed", model.embed, base_shardings["embed"])]
    parts += [("block", block, base_shardings["layers"][i]) for i, block in enumerate(model.layers)]
    parts.append(("final_norm", model.final_norm, base_shardings["final_norm"]))
    if model.lm_head is not None:
        parts.append(("lm_head", model.lm_head, base_shardings["lm_head"]))

    replicated = NamedSharding(jax.tree.leaves(shardings)[0].mesh, P())
    rngs_state = nnx.state(nnx.Rngs(seed))
    for kind, module, part_shardings in parts:
        leaves, treedef = jax.tree.flatten(part_shardings)
        part_state, rngs_state = _part_program(kind, base, treedef, tuple(leaves), replicated)(rngs_state)
        nnx.update(module, part_state)
    if config.lora is not None:  # drawn last, as Transformer.__init__ attaches them after the base, in its order
        for group in _adapter_groups(model, config):
            leaves, treedef = jax.tree.flatten([_at(shardings, path)["lora"] for path, _ in group])
            shapes = tuple(adapter_shapes(module) for _, module in group)
            program = _adapter_program(shapes, config.lora, treedef, tuple(leaves), replicated)
            adapters, rngs_state = program(rngs_state)
            for (_, module), adapter in zip(group, adapters):
                nnx.update(module.lora, adapter)
    params = nnx.state(model)
    unset = [path for path, leaf in jax.tree.leaves_with_path(params) if not isinstance(leaf, jax.Array)]
    if unset:  # a part of the Transformer this module does not build
        raise RuntimeError(f"init_sharded_params left {jax.tree_util.keystr(unset[0])} unset: build every part of "
                           "Transformer.__init__ here, in its order")
    return params


_PARTS: dict[str, Callable[[ModelConfig, nnx.Rngs], nnx.Module]] = {  # Transformer.__init__'s parts, in its order
    "embed": token_embedding,
    "block": lambda config, rngs: Block(config, rngs=rngs),
    "final_norm": lambda config, rngs: RMSNorm(config),
    "lm_head": output_head,
}


@functools.cache
def _rngs_graphdef() -> nnx.GraphDef:
    """The structure of every seed's ``nnx.Rngs`` (made when first needed: it starts JAX's backend)."""
    return nnx.graphdef(nnx.Rngs(0))


# Programs are cached for the process: a LoRA run builds the base twice (its train state, to draw the adapters after
# it, and its frozen base) and tests build the same shapes many times; each program compiles once.
@functools.lru_cache(maxsize=64)
def _part_program(kind: str, config: ModelConfig, treedef, leaves: tuple, replicated: NamedSharding):
    """Jitted ``rngs state -> (state of the part, the advanced rngs state)``, the part's state in the shardings
    ``leaves`` (of ``treedef``)."""
    rngs_graphdef = _rngs_graphdef()

    def program(rngs_state):
        rngs = nnx.merge(rngs_graphdef, rngs_state)
        return nnx.state(_PARTS[kind](config, rngs)), nnx.state(rngs)
    return jax.jit(program, out_shardings=(jax.tree.unflatten(treedef, leaves), replicated))


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


@functools.lru_cache(maxsize=64)
def _adapter_program(shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], lora: LoraConfig, treedef,
                     leaves: tuple, replicated: NamedSharding):
    """Jitted ``rngs state -> (the states of a LoRA per (in_shape, out_shape) of shapes, the advanced rngs state)``,
    in the shardings ``leaves`` (of ``treedef``); one run builds one layer's adapters."""
    rngs_graphdef = _rngs_graphdef()

    def program(rngs_state):
        rngs = nnx.merge(rngs_graphdef, rngs_state)
        adapters = [nnx.state(LoRA(in_shape, out_shape, lora, rngs=rngs)) for in_shape, out_shape in shapes]
        return adapters, nnx.state(rngs)
    return jax.jit(program, out_shardings=(jax.tree.unflatten(treedef, leaves), replicated))
