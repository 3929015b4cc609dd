"""Device mesh and parameter partition rules (big_vision style: regex over the parameter path -> PartitionSpec).

One mesh with axes ``("data", "fsdp", "tensor")``: batches are split over ``("data", "fsdp")``, parameters over
``fsdp`` (their hidden axis, ZeRO-3 style) and ``tensor`` (heads, MLP width, vocabulary: Megatron style).

Axis types are passed explicitly as ``AxisType.Auto``: the model code carries no sharding annotations, and with Auto
axes ``jax.jit(in_shardings=..., out_shardings=...)`` is enough, the compiler propagates shardings through the
program. ``Explicit`` axes (the jax 0.10 default of ``jax.make_mesh``) would make shardings part of every array's
type and require annotating ops whose output sharding is ambiguous (e.g. contractions over a sharded axis).

A parameter dimension that its mesh axes do not divide evenly is replicated over those axes instead (e.g. a
vocabulary of 151,936 over ``tensor=3``), so every rule set works on every mesh.

LoRA adapters (``<projection>/lora/a`` and ``/lora/b``, `learner.model.lora`) follow the rule of their kernel: ``a``
(``in_shape + (r,)``) is sharded like the kernel's input axes, ``b`` (``(r,) + out_shape``) like its output axes, the
rank replicated; so an adapter's shards sit with the kernel's shards they update. Several adapters stacked on a
leading axis (`learner.model.lora.StackedLoRAParam`) add that axis replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from learner.model.lora import StackedLoRAParam, adapter_parts
from learner.model.param_paths import parameter_path

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

Rules = Sequence[tuple[str, P]]

# Paths are learner.model.param_paths.parameter_path of learner.model.Transformer's parameters.
DEFAULT_RULES: Rules = (
    (r"^embed/embedding$", P("tensor", "fsdp")),  # [V, D]
    (r"/attn/[qkv]_proj/kernel$", P("fsdp", "tensor", None)),  # [D, heads, Dh]
    (r"/attn/[qkv]_proj/bias$", P("tensor", None)),  # [heads, Dh]
    (r"/attn/o_proj/kernel$", P("tensor", None, "fsdp")),  # [H, Dh, D]
    (r"/mlp/(gate|up)_proj/kernel$", P("fsdp", "tensor")),  # [D, F]
    (r"/mlp/down_proj/kernel$", P("tensor", "fsdp")),  # [F, D]
    (r"^lm_head/kernel$", P("fsdp", "tensor")),  # [D, V]
    (r".*", P()),  # norms and anything else: replicated
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *, devices: Sequence[jax.Device] | None = None
              ) -> Mesh:
    """Mesh over ``("data", "fsdp", "tensor")`` with Auto axis types; one size may be -1 (the rest of the devices).

    Example:
        >>> dict(make_mesh(fsdp=2, tensor=2).shape)
        {'data': 2, 'fsdp': 2, 'tensor': 2}
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes data={data}, fsdp={fsdp}, tensor={tensor}: positive, at most one -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices are not divisible by fsdp*tensor*data sizes {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}")
    return jax.make_mesh(tuple(sizes), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def _axis_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def partition_spec(path: str, shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES) -> P:
    """PartitionSpec of the first rule whose regex matches ``path`` (``re.search``), fitted to ``shape``.

    Dimensions not divisible by their axes' total size are replicated.

    Example:
        >>> mesh = make_mesh(data=2, tensor=4)
        >>> partition_spec("lm_head/kernel", (64, 128), mesh), partition_spec("lm_head/kernel", (64, 6), mesh)
        (P('fsdp', 'tensor'), P('fsdp', None))
    """
    for pattern, spec in rules:  # noqa: B007
        if re.search(pattern, path):
            break
    else:
        raise ValueError(f"no partition rule matches parameter {path!r}")
    if len(spec) > len(shape):
        raise ValueError(f"rule {pattern!r} gives {spec} for {path!r} of rank {len(shape)}")
    fitted = [axes if dim % _axis_size(mesh, axes) == 0 else None for dim, axes in zip(shape, spec)]
    return P(*fitted)


def state_shardings(state, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Tree of NamedShardings with the structure of ``state`` (an nnx.State or any pytree of arrays).

    Example:
        >>> from flax import nnx
        >>> from learner.model.transformer import Transformer, model_config
        >>> state = nnx.state(nnx.eval_shape(lambda: Transformer(model_config("tiny"), rngs=nnx.Rngs(0))))
        >>> state_shardings(state, make_mesh(data=4, tensor=2))["embed"]["embedding"].get_value().spec
        P('tensor', 'fsdp')
    """
    shapes = {parameter_path(path): x.shape for path, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    variables = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    stacked = {parameter_path(path) for path, leaf in variables if isinstance(leaf, StackedLoRAParam)}

    def spec(path: str, shape) -> P:
        parts = adapter_parts(path)
        if parts is None:
            return partition_spec(path, shape, mesh, rules)
        prefix, which = parts
        a, b = shapes[f"{prefix}/lora/a"], shapes[f"{prefix}/lora/b"]
        if path in stacked:  # the adapters' axis replicated, the rest as for one adapter
            a, b = a[1:], b[1:]
            return P(None, *single_spec(prefix, which, a, b))
        return single_spec(prefix, which, a, b)

    def single_spec(prefix: str, which: str, a, b) -> P:
        kernel = tuple(partition_spec(f"{prefix}/kernel", a[:-1] + b[1:], mesh, rules))
        kernel += (None,) * (len(a) + len(b) - 2 - len(kernel))
        return P(*kernel[:len(a) - 1], None) if which == "a" else P(None, *kernel[len(a) - 1:])

    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, spec(parameter_path(path), x.shape)),
                                            state)


def shard_state(state, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Places ``state`` on the mesh according to the rules."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of ``[B, ...]`` batch arrays: the batch axis over ``("data", "fsdp")``, the rest replicated.

    Example:
        >>> batch_sharding(make_mesh()).spec
        P(('data', 'fsdp'),)
    """
    return NamedSharding(mesh, P(BATCH_AXES))
