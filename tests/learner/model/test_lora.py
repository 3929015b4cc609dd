"""LoRA (`learner.model.lora`): adapters on a frozen base, trained alone (issue #32, items 1 and 2).

What is independent of the code under test: the adapter path's value and gradients are written here in NumPy
float64 from the formula ``y = x @ W + s * (x @ A) @ B``; the KL of a LoRA update is checked against the float64
estimator of the logprobs of the base model built WITHOUT LoRA (a separate `Transformer`), so "the reference is the
base with the adapters off" is checked against a model that never had adapters.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from corrections import CorrectionConfig, ImportanceWeights
from learner.logprobs.chunked import token_logprobs
from learner.model.lora import LoRA, LoraConfig, LoRAParam, merge_adapters
from learner.model.param_paths import named_leaves
from learner.model.sharding import make_mesh, state_shardings
from learner.model.transformer import Projection, Transformer, model_config
from learner.update.optimizer import OptimizerConfig, make_optimizer
from learner.update.step import make_update_fn, merge_model
from learner.update.train_state import create_sharded_frozen, create_sharded_train_state
from tests.support.update_problem import FAST_COMPILE, global_batch, rollout_batch, update_config

LORA = LoraConfig(rank=4, alpha=8.0)
MODEL = model_config("tiny", lora=LORA)
BASE = model_config("tiny")
# the jitted updates compile one layer (compilation dominates this file's time; a second layer adds nothing they
# check: every projection kind is in the first)
UPDATE_MODEL, UPDATE_BASE = model_config("tiny", num_layers=1, lora=LORA), model_config("tiny", num_layers=1)


def _tokens(rows=2, length=6):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (rows, length)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(length), (rows, length))


def test_fresh_lora_model_computes_exactly_its_base():
    """b = 0: the logits of a fresh LoRA model are bit-identical to those of the base from the same seed, whose
    weights are the same arrays (adapters are built after the base's parameters)."""
    lora, base = Transformer(MODEL, rngs=nnx.Rngs(3)), Transformer(BASE, rngs=nnx.Rngs(3))
    base_weights = named_leaves(nnx.state(base))
    lora_weights = named_leaves(nnx.state(lora))
    assert set(lora_weights) - set(base_weights) == {
        f"layers/{i}/{block}/{name}/lora/{ab}" for i in range(2) for block, names in
        (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
        for name in names for ab in "ab"}
    for name, array in base_weights.items():
        np.testing.assert_array_equal(lora_weights[name], array)
    tokens, positions = _tokens()
    np.testing.assert_array_equal(lora.logits(lora(tokens, positions)), base.logits(base(tokens, positions)))
    assert not np.all(lora_weights["layers/0/attn/q_proj/lora/a"] == 0)
    np.testing.assert_array_equal(lora_weights["layers/0/attn/q_proj/lora/b"], 0)


def test_targets_select_projections_by_path():
    config = model_config("tiny", lora=LoraConfig(rank=2, targets=("^layers/1/attn/[qv]_proj$",)))
    names = [name for name in named_leaves(nnx.state(Transformer(config, rngs=nnx.Rngs(0)), LoRAParam))]
    assert names == ["layers/1/attn/q_proj/lora/a", "layers/1/attn/q_proj/lora/b",
                     "layers/1/attn/v_proj/lora/a", "layers/1/attn/v_proj/lora/b"]
    with pytest.raises(ValueError, match=r"model.lora.targets=\['nothing'\] matches no projection"):
        Transformer(model_config("tiny", lora=LoraConfig(rank=2, targets=("nothing",))), rngs=nnx.Rngs(0))
    # the output head's kernel feeds the logprobs directly: an adapter there would be silently ignored
    with pytest.raises(ValueError, match=r"model.lora.targets=\['_proj\$', 'head'\] matches 'lm_head'"):
        Transformer(model_config("tiny", lora=LoraConfig(rank=2, targets=("_proj$", "head"))), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"LoraConfig.rank=0 must be an int >= 1"):
        LoraConfig(rank=0)


@pytest.mark.parametrize("in_shape,out_shape", [((6,), (2, 3)), ((2, 3), (5,))])
def test_adapter_path_and_gradients_against_float64(in_shape, out_shape):
    """``y = x @ W + s (x @ A) @ B`` and its gradients with respect to A and B, against NumPy float64 (a q_proj-like
    [D] -> [H, Dh] and an o_proj-like [H, Dh] -> [D] projection)."""
    config = model_config("tiny", lora=LoraConfig(rank=3, alpha=6.0))
    projection = Projection(in_shape, out_shape, use_bias=False, config=config, rngs=nnx.Rngs(0))
    projection.lora = nnx.data(LoRA(in_shape, out_shape, config.lora, rngs=nnx.Rngs(1)))
    rng = np.random.default_rng(0)
    projection.lora.b[...] = jnp.asarray(rng.normal(size=(3,) + out_shape), jnp.float32)  # b != 0: both paths live
    x = rng.normal(size=(4,) + in_shape).astype(np.float32)
    cotangent = rng.normal(size=(4,) + out_shape).astype(np.float32)
    graphdef, adapters, rest = nnx.split(projection, LoRAParam, ...)

    def loss(adapters):
        return jnp.sum(nnx.merge(graphdef, adapters, rest)(jnp.asarray(x)) * cotangent)

    value, grads = jax.value_and_grad(loss)(adapters)
    n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
    w = np.asarray(projection.kernel[...], np.float64).reshape(n_in, n_out)
    a = np.asarray(projection.lora.a[...], np.float64).reshape(n_in, 3)
    b = np.asarray(projection.lora.b[...], np.float64).reshape(3, n_out)
    x64, g64, scale = x.astype(np.float64).reshape(4, n_in), cotangent.astype(np.float64).reshape(4, n_out), 2.0
    y64 = x64 @ w + scale * (x64 @ a) @ b
    np.testing.assert_allclose(value, np.sum(y64 * g64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["lora"]["a"][...]).reshape(n_in, 3),
                               scale * x64.T @ (g64 @ b.T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["lora"]["b"][...]).reshape(3, n_out),
                               scale * (x64 @ a).T @ g64, rtol=1e-5, atol=1e-5)


def test_merged_kernels_compute_the_lora_model():
    """`merge_adapters` (what the engines and the merged export get) gives the LoRA model's logits in a base model."""
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype),
                                   nnx.state(model, LoRAParam)))
    merged = merge_adapters(named_leaves(nnx.to_pure_dict(nnx.state(model))), LORA.scale)
    base = Transformer(BASE, rngs=nnx.Rngs(5))
    names = named_leaves(nnx.state(base))
    assert set(merged) == set(names)
    graphdef, state = nnx.split(base)
    leaves = [jnp.asarray(merged[name]) for name in names]
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), leaves)
    base = nnx.merge(graphdef, state)
    tokens, positions = _tokens()
    lora_logits = model.logits(model(tokens, positions))
    assert float(jnp.max(jnp.abs(lora_logits - model.logits(Transformer(MODEL, rngs=nnx.Rngs(0))(tokens, positions)
                                                            )))) > 1e-2  # the adapters matter
    np.testing.assert_allclose(base.logits(base(tokens, positions)), lora_logits, rtol=1e-4, atol=1e-4)


def test_train_state_and_optimizer_hold_only_adapters_in_float32_on_a_bf16_base():
    config = model_config("tiny", param_dtype="bfloat16", num_layers=1, lora=LORA)
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=1e-3))
    mesh = make_mesh(data=8)
    _, state, _ = create_sharded_train_state(config, optimizer, mesh)
    frozen, _ = create_sharded_frozen(config, mesh)
    adapters = named_leaves(state.params)
    assert adapters and all("/lora/" in name for name in adapters)
    optimizer_arrays = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim > 0]
    assert sum(leaf.size for leaf in optimizer_arrays) == 2 * sum(leaf.size for leaf in adapters.values())
    assert {leaf.dtype for leaf in [*adapters.values(), *optimizer_arrays]} == {jnp.dtype(jnp.float32)}
    assert not any("/lora/" in name for name in named_leaves(frozen))
    assert {leaf.dtype for leaf in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    full = sum(leaf.size for leaf in jax.tree.leaves(frozen))
    assert sum(leaf.size for leaf in optimizer_arrays) < 0.25 * 2 * full  # tiny: r = 4 of D = 64


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_adapters_are_sharded_by_their_kernels_rule(shape):
    mesh = make_mesh(*shape)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(MODEL, rngs=nnx.Rngs(0))))
    specs = {name: sharding.spec for name, sharding in named_leaves(state_shardings(abstract, mesh)).items()}
    fsdp = "fsdp"  # D = 64 divides every fsdp size here
    tensor = "tensor" if 4 % shape[2] == 0 else None  # 4 query heads
    kv_tensor = "tensor" if 2 % shape[2] == 0 else None  # 2 key/value heads (not over tensor = 4)
    assert specs["layers/0/attn/q_proj/lora/a"] == P(fsdp, None)
    assert specs["layers/0/attn/q_proj/lora/b"] == P(None, tensor, None)
    assert specs["layers/0/attn/k_proj/lora/b"] == P(None, kv_tensor, None)
    assert specs["layers/0/attn/o_proj/lora/a"] == P(tensor, None, None)
    assert specs["layers/0/attn/o_proj/lora/b"] == P(None, fsdp)
    assert specs["layers/1/mlp/down_proj/lora/a"] == P("tensor", None)
    assert specs["layers/1/mlp/up_proj/lora/b"] == P(None, "tensor")


def _lora_update(mesh, corrections, model=UPDATE_MODEL):
    """One jitted LoRA update of the fixed problem (plain SGD, lr 1) on ``mesh``; host ``(adapters before, after,
    frozen before, frozen after, metrics)``."""
    optimizer = optax.sgd(1.0)
    graphdef, state, shardings = create_sharded_train_state(model, optimizer, mesh, seed=0)
    frozen, frozen_shardings = create_sharded_frozen(model, mesh, seed=0)
    reference = nnx.graphdef(nnx.eval_shape(lambda: Transformer(UPDATE_BASE, rngs=nnx.Rngs(0))))
    # adapters away from zero, so that the policy differs from the base and the KL is not 0
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda x: jax.device_put(jnp.asarray(0.2 * rng.normal(size=x.shape), x.dtype), x.sharding),
                          state.params)
    state = state.replace(params=params)
    before, frozen_before = nnx.to_pure_dict(jax.device_get(state.params)), jax.device_get(nnx.to_pure_dict(frozen))
    update = make_update_fn(graphdef, optimizer, update_config(2, corrections), mesh, shardings, FAST_COMPILE,
                            frozen_shardings=frozen_shardings, reference_graphdef=reference)
    state, metrics, _ = update(state, global_batch(rollout_batch(), mesh), None, frozen)
    return (before, nnx.to_pure_dict(jax.device_get(state.params)), frozen_before,
            jax.device_get(nnx.to_pure_dict(frozen)), jax.device_get(metrics), graphdef)


KL = CorrectionConfig(importance=ImportanceWeights("token", high=2.0), kl_coef=0.25, kl_estimator="k1")


@pytest.fixture(scope="module")
def update_on_2x2x2():
    return _lora_update(make_mesh(2, 2, 2), KL)


@pytest.mark.slow  # 21 s on a quiet 2-core run: out of the default run's 15 minutes
def test_lora_update_trains_adapters_against_the_base_as_reference(update_on_2x2x2):
    """One jitted update on a (2, 2, 2) mesh: the base is unchanged, the adapters move, and ``actor/kl_loss`` is the
    float64 token mean of ``lp - ref`` where ``ref`` are the logprobs of a model built without LoRA."""
    before, after, frozen_before, frozen_after, metrics, graphdef = update_on_2x2x2
    jax.tree.map(np.testing.assert_array_equal, frozen_before, frozen_after)
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert min(moved) > 0
    batch = rollout_batch()
    model = merge_model(graphdef, nnx.State(before), nnx.State(frozen_before))
    base = Transformer(UPDATE_BASE, rngs=nnx.Rngs(0))  # the same seed: the same base weights, no adapters
    args = (jnp.asarray(batch.tokens), jnp.asarray(batch.positions), jnp.asarray(batch.attention_mask))
    lp = np.asarray(token_logprobs(model, *args, chunk_size=8), np.float64)
    ref = np.asarray(token_logprobs(base, *args, chunk_size=8), np.float64)
    mask = batch.loss_mask.astype(np.float64)
    expected = np.sum((lp - ref) * mask) / mask.sum()
    assert abs(expected) > 1e-3
    np.testing.assert_allclose(metrics["actor/kl_loss"][0], expected, rtol=1e-4, atol=1e-6)


def test_lora_update_is_the_same_on_every_mesh(update_on_2x2x2):
    """The adapters after one update agree across mesh shapes (sharding is layout, not math)."""
    other = _lora_update(make_mesh(1, 2, 4), KL)[1]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), update_on_2x2x2[1], other)


@pytest.mark.parametrize("corrections", [
    CorrectionConfig(mode="bypass", importance=ImportanceWeights("sequence", high=2.0)),
    CorrectionConfig(importance=ImportanceWeights("token", high=2.0, batch_normalize=True), kl_coef=0.1,
                     kl_estimator="k3", entropy_coef=0.01),
], ids=["bypass_sequence_is", "decoupled_token_is_normalized_kl_entropy"])
@pytest.mark.slow  # 29 s on a quiet 2-core run: out of the default run's 15 minutes
def test_objectives_and_corrections_run_unchanged_on_a_fresh_lora_model(corrections):
    """b = 0: a LoRA update sees the base's logprobs, so every metric of its first update (loss, weights, masks, KL,
    entropy) equals that of a full fine-tuning update of the same base, whatever the corrections. One device: the
    comparison is of the math (the sharded update is checked above), and one device compiles fastest."""
    mesh = make_mesh(1, devices=jax.devices()[:1])
    batch = global_batch(rollout_batch(), mesh)
    config = update_config(2, corrections)
    graphdef, state, shardings = create_sharded_train_state(UPDATE_BASE, optax.sgd(1.0), mesh, seed=0)
    full = make_update_fn(graphdef, optax.sgd(1.0), config, mesh, shardings, FAST_COMPILE)
    _, base, _ = create_sharded_train_state(UPDATE_BASE, optax.sgd(1.0), mesh, seed=0)  # the base, not donated
    _, expected, _ = full(state, batch, base.params if corrections.kl_coef > 0 else None)
    graphdef, state, shardings = create_sharded_train_state(UPDATE_MODEL, optax.sgd(1.0), mesh, seed=0)
    frozen, frozen_shardings = create_sharded_frozen(UPDATE_MODEL, mesh, seed=0)
    reference = nnx.graphdef(nnx.eval_shape(lambda: Transformer(UPDATE_BASE, rngs=nnx.Rngs(0))))
    lora = make_update_fn(graphdef, optax.sgd(1.0), config, mesh, shardings, FAST_COMPILE,
                          frozen_shardings=frozen_shardings, reference_graphdef=reference)
    _, metrics, _ = lora(state, batch, None, frozen)
    expected, metrics = jax.device_get(expected), jax.device_get(metrics)
    assert metrics.keys() == expected.keys()
    for name in expected:
        if name != "actor/grad_norm":  # the gradients are of other parameters
            np.testing.assert_allclose(metrics[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_start_up_line_counts_the_trained_adapters_not_the_base():
    """``rank x (in + out)`` per projection of the seven default targets in each layer, counted by hand from the
    model's widths; the base's own count follows as the frozen part (a run without LoRA prints the base's count:
    tests/e2e/test_main_job.py)."""
    from learner.model.transformer import count_params
    from learner.rl.trainer import describe_train_state

    base = model_config("tiny")
    model = nnx.eval_shape(lambda: Transformer(model_config("tiny", lora=LoraConfig(rank=4)), rngs=nnx.Rngs(0)))
    d, f, q, kv = base.hidden_size, base.intermediate_size, base.num_heads * base.head_dim, \
        base.num_kv_heads * base.head_dim
    widths = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]  # q k v o gate up down: (in, out)
    adapters = base.num_layers * sum(4 * (n_in + n_out) for n_in, n_out in widths)
    line = describe_train_state(nnx.state(model, LoRAParam), model.config, 1.25)
    assert line == (f"train state: {adapters:,} trained parameters (LoRA rank 4 adapters; frozen base "
                    f"{count_params(base):,}) built in 1.2 s"), line
    plain = nnx.eval_shape(lambda: Transformer(base, rngs=nnx.Rngs(0)))
    assert describe_train_state(nnx.state(plain, nnx.Param), base, 1.25) == (
        f"train state: {count_params(base):,} parameters built in 1.2 s")
