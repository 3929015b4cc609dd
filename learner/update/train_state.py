"""The learner's whole mutable state as one pytree: what the update step donates and the checkpoints save.

``TrainState`` is a ``flax.struct.dataclass`` (a pytree with a fixed structure, no methods that touch devices)::

    TrainState(
        params,          # nnx.State of the Transformer's trainable parameters (learner.model.lora.trainable: all of
                         # nnx.state(model), or only the LoRA adapters), leaves are Param variables of arrays.
        opt_state,       # optax state of learner.update.optimizer.make_optimizer(config) applied to params.
        step,            # int32 scalar: optimizer updates applied (skipped non-finite updates included).
        policy_version,  # int32 scalar: version of the published policy; +1 per update call (rollout batch).
        rng,             # uint32 [2]: raw PRNG key data (jax.random.key_data), split by every update call.
    )

Every leaf is a jax.Array; ``train_state_shardings`` gives the NamedSharding tree with the same structure (params
by the rules of `learner.model.sharding`, optimizer moments like their parameter, scalars and the key replicated), which
is what a checkpoint restores onto, possibly on another mesh. The model's graph (``nnx.split(model)[0]``) is not
part of the state: rebuild it from the ModelConfig and ``nnx.merge(graphdef, state.params)``. The key is stored
as raw uint32 data rather than a typed key so that any array serializer handles it.

With LoRA (``ModelConfig.lora``) the frozen base is not part of the state either: `create_sharded_frozen` builds it,
and ``nnx.merge(graphdef, state.params, frozen)`` is the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from learner.model.lora import base_config, trainable
from learner.model.param_init import init_sharded_params
from learner.model.sharding import DEFAULT_RULES, Rules, state_shardings
from learner.model.transformer import ModelConfig, Transformer


@struct.dataclass
class TrainState:
    """Parameters, optimizer state, counters and PRNG key of the learner (see the module docstring)."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    policy_version: jax.Array
    rng: jax.Array


def create_train_state(model: Transformer, optimizer: optax.GradientTransformation, seed: int = 0,
                       policy_version: int = 0) -> TrainState:
    """A fresh state for ``model``'s parameters: optimizer initialised, step 0.

    Example:
        >>> from learner.model.transformer import model_config
        >>> state = create_train_state(Transformer(model_config("tiny"), rngs=nnx.Rngs(0)), optax.sgd(0.1))
        >>> int(state.step), state.rng.dtype
        (0, dtype('uint32'))
    """
    params = nnx.state(model, trainable(model.config))
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                      policy_version=jnp.asarray(policy_version, jnp.int32),
                      rng=jax.random.key_data(jax.random.key(seed)))


def train_state_shardings(state: TrainState, optimizer: optax.GradientTransformation, mesh: Mesh,
                          rules: Rules = DEFAULT_RULES) -> TrainState:
    """NamedShardings of every leaf of ``state`` (which may be abstract, e.g. from ``jax.eval_shape``).

    Optimizer leaves shaped like the parameters (Adam moments) are sharded like them, the rest replicated.

    Example:
        >>> from learner.model.transformer import model_config
        >>> from learner.model.sharding import make_mesh
        >>> state = create_train_state(Transformer(model_config("tiny"), rngs=nnx.Rngs(0)), optax.adam(0.1))
        >>> shardings = train_state_shardings(state, optax.adam(0.1), make_mesh(data=2, fsdp=2, tensor=2))
        >>> shardings.opt_state[0].mu["lm_head"]["kernel"].get_value().spec, shardings.step.spec
        (P('fsdp', 'tensor'), P())
    """
    param_shardings = state_shardings(state.params, mesh, rules)
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(optimizer, lambda _, sharding: sharding, state.opt_state,
                                          param_shardings, transform_non_params=lambda _: replicated)
    return TrainState(params=param_shardings, opt_state=opt_shardings, step=replicated,
                      policy_version=replicated, rng=replicated)


def create_sharded_train_state(config: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh, *,
                               seed: int = 0, rules: Rules = DEFAULT_RULES
                               ) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """Builds the model and its train state directly in their shardings (no full copy on one device).

    Works unchanged with several processes: every process runs it and holds its shards. The model is
    initialised from ``nnx.Rngs(seed)`` by `learner.model.param_init` (a few small programs, not one growing with the
    number of layers), the state's key from ``seed``.

    Returns:
        ``(graphdef, state, shardings)``; ``shardings`` is `train_state_shardings` of the state.

    Example:
        >>> from learner.model.transformer import model_config
        >>> from learner.model.sharding import make_mesh
        >>> _, state, _ = create_sharded_train_state(model_config("tiny"), optax.adam(0.1), make_mesh(data=4, tensor=2))
        >>> state.params["lm_head"]["kernel"].get_value().sharding.spec
        P('fsdp', 'tensor')
    """
    def init():
        return create_train_state(Transformer(config, rngs=nnx.Rngs(seed)), optimizer, seed)

    def complete(params):  # the optimizer state and counters of params; params pass through (donated)
        return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                          policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key_data(jax.random.key(seed)))

    shardings = train_state_shardings(jax.eval_shape(init), optimizer, mesh, rules)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed))))
    params = nnx.filter_state(_sharded_model_state(config, mesh, seed, rules), trainable(config))
    return graphdef, jax.jit(complete, out_shardings=shardings, donate_argnums=0)(params), shardings


def create_sharded_frozen(config: ModelConfig, mesh: Mesh, *, seed: int = 0, rules: Rules = DEFAULT_RULES
                          ) -> tuple[nnx.State, nnx.State] | tuple[None, None]:
    """The frozen base of a LoRA model (every variable but the adapters) in its shardings, and those shardings;
    ``(None, None)`` without LoRA. The same seed as `create_sharded_train_state` gives the same model.

    Example:
        >>> from learner.model.lora import LoraConfig
        >>> from learner.model.transformer import model_config
        >>> from learner.model.sharding import make_mesh
        >>> frozen, _ = create_sharded_frozen(model_config("tiny", lora=LoraConfig(rank=2)), make_mesh(data=8))
        >>> sorted(frozen["layers"][0]["attn"]["q_proj"])
        ['bias', 'kernel']
    """
    if config.lora is None:
        return None, None
    frozen = _sharded_model_state(base_config(config), mesh, seed, rules)  # adapters are drawn after the base
    return frozen, state_shardings(frozen, mesh, rules)


def _sharded_model_state(config: ModelConfig, mesh: Mesh, seed: int, rules: Rules) -> nnx.State:
    """Every variable of ``Transformer(config, rngs=nnx.Rngs(seed))`` (adapters included), built in its shardings
    by `learner.model.param_init`'s small programs."""
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed))))
    return init_sharded_params(config, state_shardings(abstract, mesh, rules), seed)
