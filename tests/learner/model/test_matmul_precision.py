"""``model.matmul_precision`` reaches every dot of every pass: the lowered StableHLO of the update (training,
proximal, reference and sampler-replay passes, forward and backward), of the trainer's proximal and RAW-rebuild
passes and of the reference server's prefill and decode carries ``precision = [HIGHEST, HIGHEST]`` on every
``dot_general`` when the compute is float32, and none when it is bfloat16 (the backend's fast path).

Protocol-level on CPU (XLA:CPU computes float32 dots in float32 whatever the attribute): what a GPU or TPU does with
the attribute is checked by tests/accelerator/ (golden logits at 1e-4).
"""

import dataclasses
import types

import jax
import numpy as np
import pytest

from learner.model.precision import resolve_matmul_precision, with_matmul_precision
from learner.model.sharding import make_mesh
from learner.rl import load_config
from learner.rl.rollout_engines import reference_server_args
from learner.rl.trainer import Trainer
from learner.serving.__main__ import add_model_arguments, build_model_generator
from learner.tasks import load_task
from learner.update.step import make_update_fn
from learner.update.train_state import create_sharded_train_state
from rollout_client.server.cli import server_parser
from tests.learner.update.test_update import SAMPLING
from tests.support import update_problem

HIGHEST = "precision = [HIGHEST, HIGHEST]"


def dot_lines(lowered) -> list[str]:
    """The ``dot_general`` ops of a lowered program (every function of the module)."""
    return [line for line in lowered.as_text().splitlines() if "stablehlo.dot_general" in line]


def assert_every_dot(lowered, highest: bool, at_least: int = 1) -> None:
    dots = dot_lines(lowered)
    assert len(dots) >= at_least, len(dots)
    marked = [HIGHEST in line for line in dots]
    assert all(marked) if highest else not any(marked), "\n".join(dots)


@pytest.mark.parametrize("setting, dtype, want", [
    ("auto", "float32", "highest"), ("auto", "bfloat16", "default"), ("auto", "float16", "default"),
    ("high", "float32", "high"), ("highest", "bfloat16", "highest"), ("default", "float32", "default")])
def test_auto_is_highest_exactly_where_the_compute_is_float32(setting, dtype, want):
    assert resolve_matmul_precision(setting, dtype) == want


def test_an_unknown_precision_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.matmul_precision='tf32': must be one of auto, highest, high"):
        load_config(None, ["model.matmul_precision=tf32"])
    with pytest.raises(ValueError, match="model.matmul_precision='tf32'"):
        resolve_matmul_precision("tf32", "float32")


def test_the_precision_wrapper_marks_plain_dots_and_leaves_default_alone():
    x = np.ones((4, 4), np.float32)
    assert_every_dot(jax.jit(with_matmul_precision(lambda a: a @ a, "highest")).lower(x), highest=True)
    assert "HIGH, HIGH" in dot_lines(jax.jit(with_matmul_precision(lambda a: a @ a, "high")).lower(x))[0]
    assert_every_dot(jax.jit(with_matmul_precision(lambda a: a @ a, "default")).lower(x), highest=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_dot_of_the_update_carries_the_precision(dtype):
    """Decoupled PPO over 2 mini-batches (a separate proximal pass), a KL reference pass, replayed top-k/top-p/min-p:
    every forward and backward dot of the one update program."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = dataclasses.replace(update_problem.MODEL, dtype=dtype)
    graphdef, state, shardings = create_sharded_train_state(model, update_problem.OPTIMIZER, mesh, seed=0)
    config = dataclasses.replace(update_problem.update_config(1), num_minibatches=2)
    update = make_update_fn(graphdef, update_problem.OPTIMIZER, config, mesh, shardings,
                            matmul_precision=resolve_matmul_precision("auto", dtype))
    batch = update_problem.rollout_batch().replace(sampling=SAMPLING)
    lowered = jax.jit(update).lower(state, batch, state.params)
    # 2 layers x (4 projections + 2 attention einsums + 3 MLP) + the head: ~19 per forward; proximal, reference and
    # the training forward, plus its backward (2 per forward dot), minus functions the lowering shares: 96 here.
    assert_every_dot(lowered, highest=dtype == "float32", at_least=90)


def test_the_trainers_passes_take_the_run_config_setting():
    config = load_config(None, ["rollout.prompts_per_step=2", "rollout.num_samples=2", "warmup.steps=0"])
    trainer = Trainer(config, load_task(config.task.name, config.task.args))
    assert trainer.matmul_precision == "highest"
    batch = update_problem.rollout_batch()
    rows, length = trainer.rows, trainer.length
    batch = jax.tree.map(lambda x: np.resize(x, (rows, length)), batch)
    batch = batch.replace(tokens=batch.tokens % trainer.model_config.vocab_size,
                          sampling=jax.tree.map(lambda x: x[:rows], SAMPLING))
    assert_every_dot(trainer.proximal_fn.lower(trainer.state.params, trainer.frozen, batch), highest=True, at_least=10)
    assert_every_dot(trainer.rebuild_fn.lower(trainer.state.params, trainer.frozen, batch), highest=True, at_least=10)
    assert_every_dot(trainer.update_fn.lower(trainer.state, batch.replace(sampling=None), None), highest=True,
                     at_least=30)
    plain = Trainer(dataclasses.replace(config, model=dataclasses.replace(config.model, matmul_precision="default")),
                    trainer.task)
    assert_every_dot(plain.proximal_fn.lower(plain.state.params, plain.frozen, batch), highest=False, at_least=10)


@pytest.mark.parametrize("server_dtype, highest", [("float32", True), ("bfloat16", False)])
def test_the_embedded_server_gets_the_setting_through_its_launch_args(server_dtype, highest):
    """The run's server command line carries ``model.matmul_precision``; the server resolves "auto" by its own
    compute dtype (``server.dtype``) and its prefill and decode dots carry the result."""
    config = load_config(None, [f"server.dtype={server_dtype}"])
    args = reference_server_args(config, types.SimpleNamespace(length=32), eos_ids=[1])
    assert args[args.index("--matmul-precision") + 1] == "auto"
    parser = server_parser("test")
    add_model_arguments(parser)
    generator = build_model_generator(parser.parse_args(args))
    params, cache, valid = generator._params, generator._cache, generator._valid
    rows = valid.shape[0]
    sampling = (np.ones(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
                np.zeros(rows, np.float32), np.zeros(rows, bool))
    decode = generator._decode.lower(params, cache, valid, np.zeros(rows, np.int32), np.zeros(rows, np.int32),
                                     np.ones(rows, bool), np.zeros((rows, 2), np.uint32), *sampling)
    prefill = generator._prefill.lower(params, cache, valid, 0, np.zeros((1, 16), np.int32), 3,
                                       np.zeros(2, np.uint32), *(x[0] for x in sampling))
    assert_every_dot(decode, highest=highest, at_least=10)
    assert_every_dot(prefill, highest=highest, at_least=10)


def test_a_precision_change_does_not_block_a_resume():
    from learner.rl.config import changed_keys, to_dict
    saved = to_dict(load_config(None))
    del saved["model"]["matmul_precision"]  # a checkpoint written before the key existed
    assert changed_keys(saved, load_config(None, ["model.matmul_precision=high"])) == []
    assert changed_keys(saved, load_config(None, ["model.param_dtype=bfloat16"])) == ["model.param_dtype"]
