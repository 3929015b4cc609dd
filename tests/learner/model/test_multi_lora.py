"""Several LoRA adapters on one base (multi-LoRA; issue #32, item 8): ``model.lora.adapters``, stacked adapter
matrices, ``TrainBatch.adapter``, each adapter's own loss in one mixed update, checkpoints and export per adapter.

What is independent of the code under test: the per-row adapter path and its gradients are written here in NumPy
float64 from ``y[b] = x[b] @ W + s * (x[b] @ A[k_b]) @ B[k_b]``; each adapter's loss is the float64 reduction of
its own rows written from the reductions' definitions; a mixed update is checked against updates of batches holding
one adapter's rows alone (the same code path, but other rows, other shapes, other sums: what must not matter).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import PartitionSpec as P

import corrections
from corrections import CorrectionConfig, ImportanceWeights
from corrections._config import REDUCTIONS
from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer, restore_target
from learner.checkpoints.peft_export import peft_tensors
from learner.export import export_run, main
from learner.model.lora import (
    LoRA,
    LoraConfig,
    LoRAParam,
    StackedLoRAParam,
    base_identity,
    merge_adapters,
    select_adapters,
)
from learner.model.param_paths import named_leaves
from learner.model.sharding import make_mesh, state_shardings
from learner.model.transformer import Projection, Transformer, model_config
from learner.rl.config import changed_keys, load_config, lora_config, to_dict
from learner.update.adapter_loss import adapter_loss_terms
from learner.update.bucketing import BucketConfig, pad_batch
from learner.update.optimizer import OptimizerConfig, make_optimizer
from learner.update.step import make_update_fn
from learner.update.train_state import (
    create_sharded_frozen,
    create_sharded_train_state,
    create_train_state,
    train_state_shardings,
)
from tests.support.update_problem import FAST_COMPILE, global_batch, rollout_batch, update_config

NAMES = ("math", "code")
LORA = LoraConfig(rank=4, alpha=8.0, adapters=NAMES)
MODEL, BASE = model_config("tiny", lora=LORA), model_config("tiny")
UPDATE_MODEL, UPDATE_BASE = model_config("tiny", num_layers=1, lora=LORA), model_config("tiny", num_layers=1)


def _lora_leaves(model):
    return named_leaves(nnx.state(model, LoRAParam))


@pytest.mark.parametrize("adapters,message", [
    (["math", "math"], "names 'math' twice"),
    ([""], "'' is not an adapter name"),
    (["a/b"], "'a/b' is not an adapter name"),
    ([".."], "'..' is not an adapter name"),
    (["math", "code"], "the RL loop trains one adapter"),
])
def test_adapter_names_are_checked_naming_the_key(adapters, message):
    with pytest.raises(ValueError, match=r"^model\.lora\.adapters=.*" + message.replace(".", r"\.")):
        load_config(None, ["model.lora.rank=4", f"model.lora.adapters={json.dumps(adapters)}"])
    assert not lora_config(load_config(None, ["model.lora.rank=4", 'model.lora.adapters=["math"]'])).stacked
    with pytest.raises(ValueError, match=r"^model\.lora\.adapters=\['math'\] names adapters of rank 0"):
        load_config(None, ['model.lora.adapters=["math"]'])
    assert LoraConfig(rank=2, adapters=["math", "code"]).adapters == ("math", "code")


def test_a_checkpoint_saved_before_model_lora_adapters_existed_still_resumes():
    """A key missing from a checkpoint's saved config counts as its default, so adding the key refuses no resume."""
    saved = to_dict(load_config(None, ["model.lora.rank=4"]))
    del saved["model"]["lora"]["adapters"]
    assert changed_keys(saved, load_config(None, ["model.lora.rank=4"])) == []
    assert changed_keys(saved, load_config(None, ["model.lora.rank=4", 'model.lora.adapters=["math"]'])) == [
        "model.lora.adapters"]


def test_one_named_adapter_keeps_the_single_adapter_layout():
    """One name (or none) builds today's single adapter: the same variables, types, shapes and values."""
    named = nnx.state(Transformer(model_config("tiny", num_layers=1, lora=LoraConfig(rank=4, alpha=8.0,
                                                                                    adapters=("math",))),
                                  rngs=nnx.Rngs(3)))
    plain = nnx.state(Transformer(model_config("tiny", num_layers=1, lora=LoraConfig(rank=4, alpha=8.0)),
                                  rngs=nnx.Rngs(3)))
    assert jax.tree.structure(named) == jax.tree.structure(plain)  # Variable types included: no StackedLoRAParam
    jax.tree.map(np.testing.assert_array_equal, named, plain)


def test_stacked_adapters_start_apart_and_every_adapter_computes_the_base():
    """Every adapter's ``a`` is drawn from its own key, every ``b`` is 0: whichever adapter a row selects, the logits
    are bit for bit the base's (built without LoRA from the same seed)."""
    model, base = Transformer(UPDATE_MODEL, rngs=nnx.Rngs(3)), Transformer(UPDATE_BASE, rngs=nnx.Rngs(3))
    adapters = _lora_leaves(model)
    assert adapters["layers/0/attn/q_proj/lora/a"].shape == (2, 64, 4)
    assert adapters["layers/0/attn/o_proj/lora/b"].shape == (2, 4, 64)
    assert all(isinstance(leaf, StackedLoRAParam)
               for leaf in jax.tree.leaves(nnx.state(model, LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    for name, array in adapters.items():
        if name.endswith("/a"):
            assert np.mean(array[0] == array[1]) < 0.01, name
        else:
            np.testing.assert_array_equal(array, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (3, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), (3, 6))
    with pytest.raises(ValueError, match="needs the adapter of each row"):
        model(tokens, positions)
    expected = base.logits(base(tokens, positions))
    for rows in ([0, 1, 1], [1, 0, 0]):
        with select_adapters(model, jnp.asarray(rows)):
            np.testing.assert_array_equal(model.logits(model(tokens, positions)), expected)
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(
        nnx.state(Transformer(UPDATE_MODEL, rngs=nnx.Rngs(3))))  # the selection leaves nothing in the state


def test_stacked_adapters_shard_like_one_adapter_with_the_adapter_axis_replicated():
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(MODEL, rngs=nnx.Rngs(0))))
    specs = {name: sharding.spec for name, sharding in named_leaves(state_shardings(abstract, make_mesh(2, 2, 2))
                                                                     ).items()}
    assert specs["layers/0/attn/q_proj/lora/a"] == P(None, "fsdp", None)
    assert specs["layers/0/attn/q_proj/lora/b"] == P(None, None, "tensor", None)
    assert specs["layers/0/attn/o_proj/lora/a"] == P(None, "tensor", None, None)
    assert specs["layers/1/mlp/down_proj/lora/b"] == P(None, None, "fsdp")


@pytest.mark.parametrize("in_shape,out_shape", [((6,), (2, 3)), ((2, 3), (5,))])
def test_per_row_adapter_path_and_gradients_against_float64(in_shape, out_shape):
    """Row b runs ``x[b] @ W + s (x[b] @ A[k_b]) @ B[k_b]``; the gradient of adapter k sums over its rows only, so
    adapter 1, which no row selects, gets exactly 0 (a q_proj-like and an o_proj-like projection, 3 adapters)."""
    config = model_config("tiny", lora=LoraConfig(rank=3, alpha=6.0, adapters=("x", "y", "z")))
    projection = Projection(in_shape, out_shape, use_bias=False, config=config, rngs=nnx.Rngs(0))
    projection.lora = nnx.data(LoRA(in_shape, out_shape, config.lora, rngs=nnx.Rngs(1)))
    rng = np.random.default_rng(0)
    projection.lora.b[...] = jnp.asarray(rng.normal(size=(3, 3) + out_shape), jnp.float32)
    rows = np.array([2, 0, 2, 0])
    x = rng.normal(size=(4, 5) + in_shape).astype(np.float32)  # [B, T, *in]
    cotangent = rng.normal(size=(4, 5) + out_shape).astype(np.float32)
    graphdef, adapters, rest = nnx.split(projection, LoRAParam, ...)

    def loss(adapters):
        merged = nnx.merge(graphdef, adapters, rest)
        with select_adapters(merged, jnp.asarray(rows)):
            return jnp.sum(merged(jnp.asarray(x)) * cotangent)

    value, grads = jax.value_and_grad(loss)(adapters)
    n_in, n_out, scale = int(np.prod(in_shape)), int(np.prod(out_shape)), 2.0
    w = np.asarray(projection.kernel[...], np.float64).reshape(n_in, n_out)
    a = np.asarray(projection.lora.a[...], np.float64).reshape(3, n_in, 3)
    b = np.asarray(projection.lora.b[...], np.float64).reshape(3, 3, n_out)
    x64, g64 = x.astype(np.float64).reshape(4, 5, n_in), cotangent.astype(np.float64).reshape(4, 5, n_out)
    y64 = np.stack([x64[i] @ w + scale * (x64[i] @ a[k]) @ b[k] for i, k in enumerate(rows)])
    grad_a, grad_b = np.zeros_like(a), np.zeros_like(b)
    for i, k in enumerate(rows):
        grad_a[k] += scale * x64[i].T @ (g64[i] @ b[k].T)
        grad_b[k] += scale * (x64[i] @ a[k]).T @ g64[i]
    np.testing.assert_allclose(value, np.sum(y64 * g64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["lora"]["a"][...]).reshape(3, n_in, 3), grad_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["lora"]["b"][...]).reshape(3, 3, n_out), grad_b, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(grads["lora"]["a"][...])[1] == 0) and np.all(np.asarray(grads["lora"]["b"][...])[1] == 0)


def _reference_terms(per_token, mask, rows, reduction, denominator):
    """Float64 numerator and denominator of one adapter's rows, from the reductions' definitions."""
    loss, mask = per_token[rows], mask[rows]
    counts, sums = mask.sum(axis=1), (loss * mask).sum(axis=1)
    nonempty = float(np.sum(counts > 0))
    if reduction == "token-mean":
        return sums.sum(), counts.sum()
    if reduction == "seq-mean-token-mean":
        return np.sum(sums / np.maximum(counts, 1)), nonempty
    if reduction == "seq-mean-token-sum":
        return sums.sum(), nonempty
    if reduction == "seq-mean-token-sum-norm":  # Dr. GRPO: the adapter's rows (verl, "kept": its non-empty rows) x T
        return sums.sum(), (nonempty if denominator == "kept" else len(loss)) * mask.shape[1]
    return sums.sum(), 0.0  # token-sum


@pytest.mark.parametrize("reduction,denominator", [(mode, "original") for mode in REDUCTIONS]
                         + [("seq-mean-token-sum-norm", "kept")])
def test_each_adapters_loss_is_its_own_reduction_against_float64(reduction, denominator):
    """At ratio 1 (logprobs = proximal) the PPO per-token loss is ``-A``: each adapter's numerator and denominator
    are the float64 reduction of its own rows; together the numerators are the batch's (one reduction's)."""
    rng = np.random.default_rng(4)
    adapter = np.array([0, 1, 0, 2, 1, 0, 2])
    mask = (rng.uniform(size=(7, 6)) < 0.7).astype(np.float32)
    mask[3] = 0  # adapter 2 has an empty row
    advantages = rng.normal(size=7).astype(np.float32)
    logprobs = -rng.uniform(0.5, 3.0, (7, 6)).astype(np.float32)
    config = CorrectionConfig(reduction=reduction, denominator=denominator)
    corrected = corrections.compute(logprobs, advantages, mask, config, proximal_logprobs=logprobs)
    numerators, denominators = adapter_loss_terms(corrected, jnp.asarray(adapter), 3, config)
    per_token = -np.broadcast_to(advantages.astype(np.float64)[:, None], mask.shape)
    for k in range(3):
        numerator, denom = _reference_terms(per_token, mask.astype(np.float64), adapter == k, reduction, denominator)
        np.testing.assert_allclose(numerators[k], numerator, rtol=1e-6, atol=1e-6, err_msg=f"adapter {k}")
        assert float(denominators[k]) == denom, f"adapter {k}"
    np.testing.assert_allclose(jnp.sum(numerators), corrected.loss_numerator, rtol=1e-6, atol=1e-6)


KL = CorrectionConfig(importance=ImportanceWeights("token", high=2.0), kl_coef=0.1, kl_estimator="k3")
# learner.update.optimizer's AdamW as a clipped SGD of rate 1: with b1 = b2 = 0 and eps >> |g| its step is
# -lr * g / (|g| + eps) = -g (to 1e-6 relative). max_grad_norm = 1 clips both adapters of the problem below (their
# gradient norms are ~2.6 and ~1.4), each by its own norm, as if trained alone (one global norm, ~3.0, would not).
CLIPPED_SGD = make_optimizer(OptimizerConfig(peak_learning_rate=1e6, eps=1e6, b1=0.0, b2=0.0, max_grad_norm=1.0))


def test_the_optimizer_clips_each_stacked_adapter_by_its_own_norm():
    grads = {"w": jnp.array([[3.0, 4.0, 0.0], [0.3, 0.4, 0.0]])}  # adapter norms 5 and 0.5
    params = {"w": jnp.zeros((2, 3))}
    updates, _ = CLIPPED_SGD.update(grads, CLIPPED_SGD.init(params), params, global_norm=jnp.array([5.0, 0.5]))
    clipped = np.array([[0.6, 0.8, 0.0], [0.3, 0.4, 0.0]])  # min(1, 1 / norm) per adapter
    np.testing.assert_allclose(updates["w"], -1e6 * clipped / (np.abs(clipped) + 1e6), rtol=1e-6)
ADAPTER = np.arange(16) % 2  # rollout_batch's rows alternate between the adapters (its last row is fully masked)


def _update(mesh, batch, microbatches):
    """One jitted mixed update (`CLIPPED_SGD`) of `UPDATE_MODEL`'s adapters, set away from 0 so that the adapters
    differ; host ``(adapters before, after, metrics)``."""
    optimizer = CLIPPED_SGD
    graphdef, state, shardings = create_sharded_train_state(UPDATE_MODEL, optimizer, mesh, seed=0)
    frozen, frozen_shardings = create_sharded_frozen(UPDATE_MODEL, mesh, seed=0)
    reference = nnx.graphdef(nnx.eval_shape(lambda: Transformer(UPDATE_BASE, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(2)
    state = state.replace(params=jax.tree.map(
        lambda x: jax.device_put(jnp.asarray(0.2 * rng.normal(size=x.shape), x.dtype), x.sharding), state.params))
    before = nnx.to_pure_dict(jax.device_get(state.params))
    update = make_update_fn(graphdef, optimizer, update_config(microbatches, KL), mesh, shardings, FAST_COMPILE,
                            frozen_shardings=frozen_shardings, reference_graphdef=reference)
    state, metrics, _ = update(state, global_batch(batch, mesh), None, frozen)
    return before, nnx.to_pure_dict(jax.device_get(state.params)), jax.device_get(metrics)


def _rows(batch, rows):
    return jax.tree.map(lambda x: np.asarray(x)[rows], batch)


@pytest.fixture(scope="module")
def mixed_on_one_device():
    return _update(make_mesh(1, devices=jax.devices()[:1]), rollout_batch().replace(adapter=ADAPTER), 1)


def test_a_mixed_update_trains_each_adapter_as_a_batch_of_its_rows_alone(mixed_on_one_device):
    """Adapter k after one update of the mixed batch equals adapter k after an update of k's rows alone (each
    adapter's loss is its own token mean, its gradient clipped by its own norm), and the other adapter does not move
    there: its gradient is exactly 0. Tolerance: float32 sums over other rows and shapes (the mixed batch's token
    sums hold both adapters' rows)."""
    before, mixed, metrics = mixed_on_one_device
    mesh = make_mesh(1, devices=jax.devices()[:1])
    batch = rollout_batch()
    for k in (0, 1):
        rows = np.flatnonzero(ADAPTER == k)
        _, alone, alone_metrics = _update(mesh, _rows(batch, rows).replace(adapter=ADAPTER[rows]), 1)
        jax.tree.map(lambda m, s, k=k: np.testing.assert_allclose(m[k], s[k], rtol=2e-5, atol=1e-7), mixed, alone)
        jax.tree.map(lambda b, s, k=k: np.testing.assert_array_equal(s[1 - k], b[1 - k]), before, alone)
        np.testing.assert_allclose(metrics[f"actor/pg_loss_adapter{k}"], alone_metrics["actor/pg_loss"], rtol=1e-5)
    moved = [float(np.max(np.abs(a - b)[k])) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(mixed))
             for k in (0, 1)]
    assert min(moved) > 0
    np.testing.assert_allclose(metrics["actor/pg_loss"],
                               metrics["actor/pg_loss_adapter0"] + metrics["actor/pg_loss_adapter1"], rtol=1e-6)
    assert min(metrics["actor/grad_norm_adapter0"], metrics["actor/grad_norm_adapter1"]) > 1.0  # both clipped


def test_a_mixed_update_is_the_same_on_every_mesh_and_micro_batch_count(mixed_on_one_device):
    """(2, 2, 2) with 2 micro-batches, against one device with one: the adapters agree (sharding and gradient
    accumulation are layout, not math; each adapter's denominator is summed over micro-batches before dividing)."""
    other = _update(make_mesh(2, 2, 2), rollout_batch().replace(adapter=ADAPTER), 2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), mixed_on_one_device[1], other[1])


def test_padding_rows_get_adapter_0():
    batch = rollout_batch().replace(adapter=np.ones(16, np.int32))
    padded = pad_batch(batch, BucketConfig(min_length=24), row_multiple=32)
    assert padded.adapter.tolist() == [1] * 16 + [0] * 16 and padded.tokens.shape == (32, 24)


def test_batch_wide_corrections_and_bad_adapter_indices_are_refused():
    mesh = make_mesh(1, devices=jax.devices()[:1])
    graphdef, state, shardings = create_sharded_train_state(UPDATE_MODEL, optax.sgd(1.0), mesh, seed=0)
    frozen, frozen_shardings = create_sharded_frozen(UPDATE_MODEL, mesh, seed=0)
    normalized = CorrectionConfig(importance=ImportanceWeights("token", high=2.0, batch_normalize=True))
    update = make_update_fn(graphdef, optax.sgd(1.0), update_config(1, normalized), mesh, shardings, FAST_COMPILE,
                            frozen_shardings=frozen_shardings)
    batch = rollout_batch()
    with pytest.raises(ValueError, match="batch_normalize with 2 LoRA adapters"):
        update(state, global_batch(batch.replace(adapter=ADAPTER), mesh), None, frozen)
    with pytest.raises(ValueError, match=r"TrainBatch.adapter holds 2, outside \[0, 2\)"):
        update(state, global_batch(batch.replace(adapter=ADAPTER * 2), mesh), None, frozen)


def test_stacked_checkpoint_restores_on_another_mesh_and_exports_one_peft_adapter_per_name(tmp_path):
    """The adapters round-trip a checkpoint onto another mesh as `StackedLoRAParam`s; the export writes
    ``OUT/<name>/`` per adapter, each the single-adapter PEFT layout of that adapter, and ``--merged`` needs
    ``--adapter`` (then it is the base with that adapter merged)."""
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(5)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype),
                                   nnx.state(model, LoRAParam)))
    optimizer = optax.adam(1e-3)
    state = create_train_state(model, optimizer)
    run_config = to_dict(load_config(None, ["model.lora.rank=4", "model.lora.alpha=8.0"]))
    run_config["model"]["lora"]["adapters"] = list(NAMES)  # what a library run of two adapters records
    run_dir = tmp_path / "run"
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"), async_save=False)) as checkpointer:
        checkpointer.save(3, state, policy_version=3, config=run_config, extra_metadata={
            "lora_base": base_identity(None, run_config["model"]["name"], run_config["loop"]["seed"])})
        mesh = make_mesh(1, 2, 4)
        restored = checkpointer.restore(restore_target(state, train_state_shardings(state, optimizer, mesh))).state
    leaves = jax.tree.leaves(restored.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert {type(leaf) for leaf in leaves} == {StackedLoRAParam}
    adapters = {name: np.asarray(array) for name, array in _lora_leaves(model).items()}
    jax.tree.map(np.testing.assert_array_equal, named_leaves(restored.params), adapters)

    out = export_run(run_dir, tmp_path / "peft")
    assert sorted(path.name for path in out.iterdir()) == sorted(NAMES)
    single = model_config("tiny", lora=LoraConfig(rank=4, alpha=8.0))
    for k, name in enumerate(NAMES):
        tensors = safetensors.numpy.load_file(str(out / name / "adapter_model.safetensors"))
        expected = peft_tensors({path: array[k] for path, array in adapters.items()}, single)
        assert tensors.keys() == expected.keys()
        jax.tree.map(np.testing.assert_array_equal, tensors, expected)
        assert json.loads((out / name / "adapter_config.json").read_text())["r"] == 4
    with pytest.raises(ValueError, match=r"--merged with the adapters \['math', 'code'\].*--adapter NAME"):
        export_run(run_dir, tmp_path / "merged", merged=True)
    with pytest.raises(ValueError, match=r"--adapter 'chat': the run's adapters are \['math', 'code'\]"):
        export_run(run_dir, tmp_path / "merged", merged=True, adapter="chat")
    main([str(run_dir), str(tmp_path / "merged"), "--merged", "--adapter", "code"])
    weights = safetensors.numpy.load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = named_leaves(nnx.state(Transformer(BASE, rngs=nnx.Rngs(0))))
    expected = merge_adapters({**{path: np.asarray(x) for path, x in base.items()},
                               **{path: array[1] for path, array in adapters.items()}}, LORA.scale)
    q = expected["layers/0/attn/q_proj/kernel"].reshape(64, -1).T  # transformers' [out, in]
    np.testing.assert_allclose(weights["model.layers.0.self_attn.q_proj.weight"], q, rtol=1e-6)
