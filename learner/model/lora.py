"""LoRA: low-rank adapters on a frozen base (Hu et al., 2021), as parameters of their own type.

With ``ModelConfig.lora`` set, every `learner.model.Projection` whose path matches one of
``LoraConfig.targets``
(``"layers/3/attn/q_proj"``, ...) gets a `LoRA` submodule ``lora`` holding two `LoRAParam`s::

    layers/{i}/attn/q_proj/lora/a   [D, r]          (the kernel's input axes, then the rank)
    layers/{i}/attn/q_proj/lora/b   [r, H, Dh]      (the rank, then the kernel's output axes)

and the projection computes ``x @ kernel + scale * (x @ a) @ b`` with ``scale = alpha / rank``. ``a`` starts random
(PEFT's default: uniform in ``+-1 / sqrt(fan_in)``), ``b`` at zero, so a fresh LoRA model computes exactly what its
base computes. Adapters are built after the base's parameters from the same ``nnx.Rngs``, so the base weights of a
LoRA model equal those of the model without LoRA from the same seed.

What trains is chosen by an nnx filter (`trainable`): `LoRAParam` with LoRA, every ``nnx.Param`` without. The train
state holds the trainable parameters and their optimizer state only; the rest (`frozen`) is the base, which stays in
its own dtype (bf16 allowed) and is passed to the update as an argument it never differentiates or donates. The KL
reference of a LoRA run is the base with the adapters off: the base model's graph over the same frozen arrays
(`base_config`), no second copy of the weights.

Adapters are sharded by the rule of their kernel (`learner.model.sharding.state_shardings`): ``a`` like the kernel's
input
axes, ``b`` like its output axes, the rank replicated.

For the engines and exports the adapters are merged into the kernels (`merge_adapters`), or written as a PEFT
adapter (`learner.checkpoints.peft_export`).

Several adapters on one base (``LoraConfig.adapters`` with more than one name) are stacked on a leading axis
(`StackedLoRAParam`: ``a`` ``[N, D, r]``, ``b`` ``[N, r, H, Dh]``, that axis replicated); every call then runs inside
`select_adapters`, which says the adapter of each row, and `split_adapters` gives each adapter's arrays in the
single-adapter layout (export). Each adapter's own loss: `learner.update.adapter_loss`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import pathlib
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# An adapter name is a directory name (the export's OUT_DIR/<name>/) and an engine's adapter name: no separators,
# no leading dot or dash, nothing a shell or a URL would need to quote.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters, and their rank, scale and dtype; validated when built.

    Example:
        >>> LoraConfig(rank=8, alpha=16.0).scale
        2.0
        >>> LoraConfig(rank=8, targets=("attn/[qv]_proj$",)).targets_path("layers/0/attn/v_proj")
        True
    """

    rank: int  # r: the adapters' inner width.
    alpha: float = 16.0  # the update is scaled by alpha / rank (PEFT's lora_alpha).
    # Regular expressions searched in each projection's path ("layers/0/attn/q_proj", "layers/5/mlp/down_proj");
    # a projection matching any gets adapters. The default: every attention and MLP projection of every layer.
    targets: tuple[str, ...] = tuple(f"/{name}$" for name in TARGET_NAMES)
    dtype: str = "float32"  # dtype of the adapters (and so of their optimizer state).
    # Names of several adapters trained on one base, stacked on a leading axis (multi-LoRA; `StackedLoRAParam`);
    # () or one name: a single adapter, no leading axis (the layout of a run without names).
    adapters: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank={self.rank!r} must be an int >= 1.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha={self.alpha!r} must be a number > 0.")
        if not self.targets or not all(isinstance(target, str) for target in self.targets):
            raise ValueError(f"LoraConfig.targets={self.targets!r} must be a non-empty list of regular expressions "
                             f"over projection paths, e.g. [\"/q_proj$\", \"/v_proj$\"].")
        for target in self.targets:
            try:
                re.compile(target)
            except re.error as error:
                raise ValueError(f"LoraConfig.targets: {target!r} is not a regular expression ({error}).") from None
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"LoraConfig.dtype={self.dtype!r} must be float32 or bfloat16.")
        if isinstance(self.adapters, list):
            object.__setattr__(self, "adapters", tuple(self.adapters))
        check_adapter_names(self.adapters)

    @property
    def stacked(self) -> bool:
        """Whether there are several adapters, stacked on a leading axis of every adapter matrix."""
        return len(self.adapters) > 1

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor of the adapters' product."""
        return self.alpha / self.rank

    def targets_path(self, path: str) -> bool:
        """Whether the projection at ``path`` gets adapters."""
        return any(re.search(target, path) for target in self.targets)


def check_adapter_names(names) -> None:
    """Refuses adapter names that are not distinct, non-empty names safe as a directory and an engine's adapter name.

    Example:
        >>> check_adapter_names(("math", "code"))
        >>> check_adapter_names(("math", "math"))
        Traceback (most recent call last):
        ...
        ValueError: LoraConfig.adapters=['math', 'math'] names 'math' twice: every adapter needs its own name.
    """
    if not isinstance(names, tuple) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"LoraConfig.adapters={names!r} must be a list of adapter names, e.g. [\"math\", \"code\"].")
    for name in names:
        if not ADAPTER_NAME.match(name):
            raise ValueError(f"LoraConfig.adapters={list(names)!r}: {name!r} is not an adapter name (1-64 letters, "
                             "digits, '_', '.', '-', starting with a letter or digit: it names a directory and an "
                             "engine's adapter).")
        if names.count(name) > 1:
            raise ValueError(f"LoraConfig.adapters={list(names)!r} names {name!r} twice: every adapter needs its own "
                             "name.")


class LoRAParam(nnx.Param):
    """A trainable adapter matrix (a subclass of ``nnx.Param``: filters for ``nnx.Param`` still see it)."""


class StackedLoRAParam(LoRAParam):
    """The matrices of several adapters (`LoraConfig.adapters`) stacked on a leading axis, one entry per adapter (a
    `LoRAParam`: what trains, is optimised and checkpointed is unchanged; `learner.model.sharding` replicates the
    axis)."""


class LoRA(nnx.Module):
    """The adapter pair of one projection with kernel ``in_shape + out_shape``: ``scale * (x @ a) @ b``.

    With several adapters (``config.stacked``) ``a`` is ``[N, *in_shape, r]`` and ``b`` ``[N, r, *out_shape]``, every
    adapter's ``a`` drawn from its own key, and each row of the batch runs through its own adapter
    (`select_adapters` says which).
    """

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], config: LoraConfig, *,
                 rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(math.prod(in_shape))

        def draw(key):
            return jax.random.uniform(key, in_shape + (config.rank,), jnp.float32, -bound, bound)

        if config.stacked:
            count = len(config.adapters)
            self.a = StackedLoRAParam(jax.vmap(draw)(jax.random.split(rngs.params(), count)).astype(config.dtype))
            self.b = StackedLoRAParam(jnp.zeros((count, config.rank) + out_shape, config.dtype))
            self.row_adapters = nnx.data(None)  # [B] int, the adapter of each row, within `select_adapters`
        else:
            self.a = LoRAParam(draw(rngs.params()).astype(config.dtype))
            self.b = LoRAParam(jnp.zeros((config.rank,) + out_shape, config.dtype))
        self.scale = config.scale

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[N, in_size] -> [N, out_size]`` in the adapters' dtype; stacked, the N rows are B-major (``[B, ...]``
        flattened, B the number of rows `select_adapters` was given)."""
        a, b = self.a[...], self.b[...]
        if not isinstance(self.a, StackedLoRAParam):
            a = a.reshape(-1, a.shape[-1])
            return (x.astype(a.dtype) @ a) @ (self.scale * b.reshape(b.shape[0], -1))
        if self.row_adapters is None:
            raise ValueError("a model with several LoRA adapters (model.lora.adapters) needs the adapter of each row: "
                             "call it within learner.model.lora.select_adapters(model, adapter)")
        count, rank = a.shape[0], a.shape[-1]
        # Each row's matrices by a one-hot matmul rather than a gather: the gradient is a matmul too (a gather's is
        # a scatter-add, slow to compile on the CPU and slow on a TPU), exact, and rows of one adapter give the
        # others exactly zero.
        one_hot = jax.nn.one_hot(self.row_adapters, count, dtype=a.dtype)  # [B, N]
        rows = one_hot.shape[0]
        a = (one_hot @ a.reshape(count, -1)).reshape(rows, -1, rank)  # [B, in, r]
        b = (one_hot @ (self.scale * b).reshape(count, -1)).reshape(rows, rank, -1)  # [B, r, out]
        h = jnp.einsum("bti,bir->btr", x.astype(a.dtype).reshape(rows, -1, a.shape[1]), a)
        return jnp.einsum("btr,bro->bto", h, b).reshape(-1, b.shape[-1])


@contextlib.contextmanager
def select_adapters(model: nnx.Module, adapter: jax.Array):
    """Within the block, row ``b`` of every call of ``model`` runs through adapter ``adapter[b]`` (``[B]`` int, an
    index into `LoraConfig.adapters`); a model without stacked adapters is unaffected.

    The selection is an attribute of the stacked `LoRA` modules for the block's duration (like a mode flag), reset
    on exit so that the model's state holds nothing of it. An index outside ``[0, N)`` selects no adapter (the row
    runs the base alone): `learner.update.adapter_loss.check_adapter_indices` refuses such batches.

    Example::

        with select_adapters(model, jnp.array([0, 1])):  # row 0 through adapter 0, row 1 through adapter 1
            hidden = model(tokens, positions)
    """
    stacked = [module for _, module in nnx.iter_modules(model)
               if isinstance(module, LoRA) and isinstance(module.a, StackedLoRAParam)]
    for module in stacked:
        module.row_adapters = adapter
    try:
        yield model
    finally:
        for module in stacked:
            module.row_adapters = None


def stacked_adapter_count(params: nnx.State) -> int:
    """N of a state whose adapters are stacked (`StackedLoRAParam`), else 1."""
    stacked = [leaf for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
               if isinstance(leaf, StackedLoRAParam)]
    return stacked[0].shape[0] if stacked else 1


def split_adapters(weights: Mapping[str, np.ndarray], names: tuple[str, ...]) -> dict[str, dict[str, np.ndarray]]:
    """``{path: array}`` with stacked adapters (``[N, ...]``, `LoraConfig.adapters` = ``names``) -> ``{name:
    {path: array}}``, each in the single-adapter layout (the other paths, e.g. the base's, are not copied).

    Example:
        >>> weights = {"p/lora/a": np.zeros((2, 3, 1)), "p/lora/b": np.ones((2, 1, 4))}
        >>> {name: {path: x.shape for path, x in w.items()} for name, w in split_adapters(weights, ("x", "y")).items()}
        {'x': {'p/lora/a': (3, 1), 'p/lora/b': (1, 4)}, 'y': {'p/lora/a': (3, 1), 'p/lora/b': (1, 4)}}
    """
    adapters = {path: np.asarray(array) for path, array in weights.items() if adapter_parts(path) is not None}
    for path, array in adapters.items():
        if array.shape[0] != len(names):
            raise ValueError(f"{path} holds {array.shape[0]} adapters, model.lora.adapters names {len(names)}")
    return {name: {path: array[index] for path, array in adapters.items()} for index, name in enumerate(names)}


def adapter_targets(model: nnx.Module, config: LoraConfig, projection_type: type) -> list[tuple[tuple, nnx.Module]]:
    """``(path, module)`` of every ``projection_type`` module of ``model`` that gets adapters, in the order their
    adapters draw from the random stream (sorted paths).

    Raises:
        ValueError: no projection matches, or one outside the layers (the output head), naming ``model.lora.targets``.
    """
    targets = [(path, module) for path, module in nnx.iter_modules(model)
               if isinstance(module, projection_type) and config.targets_path("/".join(map(str, path)))]
    if not targets:
        raise ValueError(f"model.lora.targets={list(config.targets)!r} matches no projection; paths look like "
                         "\"layers/0/attn/q_proj\" or \"layers/0/mlp/down_proj\".")
    outside = ["/".join(map(str, path)) for path, _ in targets if path[0] != "layers"]
    if outside:  # the output head's kernel feeds the chunked logprobs directly: an adapter there would do nothing
        raise ValueError(f"model.lora.targets={list(config.targets)!r} matches {outside[0]!r}: only the attention "
                         "and MLP projections of the layers take adapters; anchor the patterns, e.g. \"/q_proj$\".")
    return sorted(targets, key=lambda item: tuple(map(str, item[0])))


def adapter_shapes(projection: nnx.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(in_shape, out_shape)`` of the `LoRA` of a projection (its kernel is ``in_shape + out_shape``)."""
    shape = projection.kernel.shape
    return tuple(shape[:projection.num_in_axes]), tuple(shape[projection.num_in_axes:])


def attach_adapters(model: nnx.Module, config: LoraConfig, projection_type: type, rngs: nnx.Rngs) -> None:
    """Gives every ``projection_type`` module of ``model`` whose path matches ``config.targets`` a `LoRA`."""
    for _, module in adapter_targets(model, config, projection_type):
        module.lora = nnx.data(LoRA(*adapter_shapes(module), config, rngs=rngs))


def trainable(config) -> nnx.filterlib.Filter:
    """The nnx filter of what trains under a ``ModelConfig``: the adapters with LoRA, every parameter without."""
    return LoRAParam if config.lora is not None else nnx.Param


FROZEN = nnx.Not(LoRAParam)  # the base of a LoRA model: every variable but the adapters


def base_config(config):
    """The ``ModelConfig`` of the base (LoRA off): its graph over a LoRA model's frozen state is the KL reference."""
    return dataclasses.replace(config, lora=None)


_ADAPTER = re.compile(r"^(.*)/lora/([ab])$")


def adapter_parts(path: str) -> tuple[str, str] | None:
    """``"layers/0/attn/q_proj/lora/a"`` -> ``("layers/0/attn/q_proj", "a")``; None for any other path."""
    match = _ADAPTER.match(path)
    return None if match is None else (match.group(1), match.group(2))


def merge_adapters(weights: Mapping[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """``{path: array}`` of a LoRA model -> the base's paths, each adapted kernel replaced by
    ``kernel + scale * a @ b`` (computed in float32, stored in the kernel's dtype).

    Example:
        >>> weights = {"p/kernel": np.zeros((2, 3)), "p/lora/a": np.ones((2, 1)), "p/lora/b": np.ones((1, 3))}
        >>> merge_adapters(weights, 0.5)["p/kernel"].tolist()
        [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
    """
    merged = {path: array for path, array in weights.items() if adapter_parts(path) is None}
    for path in weights:
        parts = adapter_parts(path)
        if parts is None or parts[1] != "a":
            continue
        prefix = parts[0]
        kernel = np.asarray(merged[f"{prefix}/kernel"])
        a = np.asarray(weights[f"{prefix}/lora/a"], np.float32)
        b = np.asarray(weights[f"{prefix}/lora/b"], np.float32)
        delta = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)
        merged[f"{prefix}/kernel"] = (kernel.astype(np.float32) + scale * delta.reshape(kernel.shape)
                                      ).astype(kernel.dtype)
    return merged


def base_identity(hf_path: str | None, model_name: str, seed: int) -> dict:
    """What a LoRA checkpoint records of its base (it does not hold the base): the Hugging Face checkpoint's
    resolved path and the sha256 of its ``config.json`` and ``*.safetensors`` files, or, for a base initialised from
    a seed, the model name and the seed.

    Example:
        >>> base_identity(None, "tiny", 3)
        {'path': None, 'sha256': None, 'model': 'tiny', 'seed': 3}
    """
    if not hf_path:
        return {"path": None, "sha256": None, "model": model_name, "seed": seed}
    directory = pathlib.Path(hf_path).resolve()
    digest = hashlib.sha256()
    for file in [directory / "config.json", *sorted(directory.glob("*.safetensors"))]:
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return {"path": str(directory), "sha256": digest.hexdigest(), "model": None, "seed": None}


def check_base_identity(saved: Mapping | None, current: Mapping, checkpoint: str) -> None:
    """Refuses to resume LoRA adapters on another base than they were trained on (by content, not by path)."""
    if saved is None:
        raise ValueError(f"{checkpoint} records no LoRA base (lora_base): it is not a LoRA run's checkpoint; resume "
                         "it with model.lora.rank = 0, or use a new run_dir")
    if not same_base(saved, current):
        raise ValueError(f"{checkpoint} holds LoRA adapters of the base {dict(saved)}, but model.hf_path / "
                         f"model.name / loop.seed give the base {dict(current)}: resume on the base the adapters "
                         "were trained on, or use a new run_dir")


def same_base(saved: Mapping, current: Mapping) -> bool:
    """Whether two `base_identity` records name the same base: by the files' sha256 where ``current`` has one, else
    by model name and seed.

    Example:
        >>> same_base(base_identity(None, "tiny", 3), base_identity(None, "tiny", 4))
        False
    """
    keys = ("sha256",) if current.get("sha256") else ("model", "seed")
    return all(saved.get(key) == current.get(key) for key in keys)
