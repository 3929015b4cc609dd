"""configs/hf_tiny.toml end to end: the files from learner.tools.make_hf_tiny (a tiny random Qwen2 checkpoint, its own
BPE tokenizer with a chat template, a jsonl dataset), a few RL steps against a real engine process, evaluation on the
validation split, and the export read back by transformers (config, tokenizer) and mlx-lm (weights and logits).

The test runs against the MLX engine (launched on the run's weights) and, marked slow, against the embedded
reference server, whose start (a second JAX process, its own compiles) makes the run costlier: 37 against 29
CPU-seconds, engine processes included (43 s and 39 s at the same load on the shared 2-core machine), and the
default suite's budget is tight.

The run is the config with smaller batches (and no warm-up: its compile would double the time again; the warm-up on
a pad == eos tokenizer is tested in tests/learner/rl/test_batches.py): every other setting, the model, tokenizer,
dataset,
reward and evaluation included, is the config's. At random initialisation the evaluation scores are ~0: here they
are checked for presence and consistency (their values: tests/learner/rl/test_hooks.py).
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from learner.checkpoints.safetensors_io import hf_tensors
from learner.model.param_paths import named_leaves
from learner.reporting.metrics_writers import read_metrics
from learner.rl import CheckpointHook, EvalHook, MetricsHook, Run, load_config
from learner.tools.make_hf_tiny import make_hf_tiny

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "configs" / "hf_tiny.toml"
STEPS = 2
NUM_SAMPLES = 4
VALIDATION_PROMPTS = 4
# At staleness 0 the engine samples with the weights the learner recomputes its logprobs with, both in float32 (MLX
# and XLA kernels, or the learner's own model code): the mean per-token log-ratio is rounding only (~1e-7 measured);
# a one-update lag or a bf16 server gives ~1e-3.
KL_TOLERANCE = 1e-4
# engine -> the run's overrides; the MLX engine reports RAW logprobs only (the sampling distribution at temperature 1)
ENGINES = {"mlx": ("server.engine='mlx'", "rollout.logprob_mode='raw'"), "tether": ()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_hf_tiny(tmp_path_factory.mktemp("hf_tiny") / "files")


def _config(files, run_dir, *extra):
    return load_config(CONFIG, [
        f"model.hf_path={json.dumps(str(files.model))}", f"task.args.path={json.dumps(str(files.train))}",
        f"task.args.validation.path={json.dumps(str(files.test))}", f"run_dir={json.dumps(str(run_dir))}",
        f"loop.steps={STEPS}", "warmup.steps=0", "rollout.prompts_per_step=4", f"rollout.num_samples={NUM_SAMPLES}",
        "server.max_batch_size=16", "update.fast_compile=true", "task.args.validation.every=1",
        f"task.args.validation.max_prompts={VALIDATION_PROMPTS}", *extra])


def _train(config):
    """Runs ``config`` with the hooks under test; returns the step records, the learner's final model, the task."""
    with Run(config, hooks=[EvalHook(), MetricsHook(), CheckpointHook(config.checkpoints.every)]) as run:
        records = list(run.steps())
        model = nnx.merge(run.trainer.graphdef, jax.device_get(run.trainer.state.params))
        return records, model, run.task


def assert_trained_on_policy(records, task):
    assert [record.step for record in records] == list(range(1, STEPS + 1))
    for record in records:
        assert record.metrics["rollout_corr/valid_tokens"] > 0 and record.metrics["rollout_corr/staleness_max"] == 0
        assert abs(record.metrics["rollout_corr/kl"]) < KL_TOLERANCE, record.metrics["rollout_corr/kl"]
        assert record.samples == 4 * NUM_SAMPLES and set(np.unique(record.rewards)) <= {0.0, 1.0}
    test_rows = task.path.with_name("test.jsonl").read_text().splitlines()
    test_questions = {json.loads(line)["question"] for line in test_rows}
    assert len(task.prompts()) == 950 and not {r["row"]["question"] for r in task.prompts()} & test_questions


def assert_evaluation_in_metrics_file(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:  # validation.every = 1: every step is evaluated
        assert row["data/validation_prompts"] == VALIDATION_PROMPTS and row["eval/dropped_samples"] == 0
        pass_1, pass_k, greedy = row["eval/pass@1"], row[f"eval/pass@{NUM_SAMPLES}"], row["eval/greedy/pass@1"]
        # exact_match scores 0 or 1 and success_threshold is 1: pass@1 is the fraction correct, the mean reward
        assert pass_1 == pytest.approx(row["eval/reward_mean"]) == pytest.approx(row["eval/exact_match/mean"])
        assert 0 <= pass_1 <= pass_k <= 1
        assert greedy * VALIDATION_PROMPTS == pytest.approx(round(greedy * VALIDATION_PROMPTS))  # one per prompt


def _export(run_dir, out_dir):
    """``python -m learner.export RUN_DIR OUT_DIR``, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "learner.export", str(run_dir), str(out_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out_dir


@nnx.jit
def _logits(model, tokens):
    """The learner's float32 logits [1, T, V] of one unpadded sequence."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return model.logits(model(tokens, positions, jnp.ones_like(tokens)))


def assert_export_loads_with_the_learners_logits(run_dir, model, task, out_dir):
    """The export of the run: the learner's weights exactly; transformers reads its config and tokenizer as the task
    does; mlx-lm loads it and computes the learner's logits."""
    import mlx.core as mx
    import mlx_lm
    import transformers

    out = _export(run_dir, out_dir)
    weights = {path: np.asarray(leaf) for path, leaf in named_leaves(nnx.state(model, nnx.Param)).items()}
    exported = safetensors.numpy.load_file(str(out / "model.safetensors"))
    expected = hf_tensors(weights, model.config)  # float32: the last step's weights, in Hugging Face names
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)

    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.architectures, config.tie_word_embeddings, config.eos_token_id) == (
        ["Qwen2ForCausalLM"], True, list(task.tokenizer.eos_ids))
    record = task.validation_records()[0]
    messages = [{"role": "user", "content": record["row"]["question"]}]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.eos_token == hf_tokenizer.pad_token == "<|endoftext|>"
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == record["prompt"]
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids == record["prompt_ids"].tolist()

    mlx_model, _ = mlx_lm.load(str(out))  # the tokenizer through transformers, the weights by mlx-lm's qwen2
    ids += hf_tokenizer.encode(record["row"]["answer"], add_special_tokens=False)
    mlx_logits = np.asarray(mlx_model(mx.array(ids)[None]).astype(mx.float32))[0]
    learner_logits = np.asarray(_logits(model, jnp.asarray(ids, jnp.int32)[None]))[0]
    # float32 in both; MLX and XLA reduce in their own orders (they agree to ~1e-6 here), while a wrong weight (a
    # transposed kernel, a lost bias, an untied head) moves these logits by far more than 1e-4.
    np.testing.assert_allclose(mlx_logits, learner_logits, atol=1e-4, rtol=0)


# One test per engine, not one per check: the run is the cost (a module fixture would be rebuilt by each xdist
# worker that runs one of its tests). 30-40 s against the MLX engine on the shared 2-core machine: the run (engine
# launches, the learner's compiles), then ~5 s for the export and the loads.
@pytest.mark.parametrize("engine", ["mlx", pytest.param("tether", marks=pytest.mark.slow)])
def test_the_config_trains_on_policy_evaluates_and_exports_a_loadable_checkpoint(engine, files, tmp_path):
    run_dir = tmp_path / "run"
    config = _config(files, run_dir, *ENGINES[engine])
    assert (config.server.engine, config.rollout.max_staleness, config.model.param_dtype, config.server.dtype) == (
        engine, 0, "float32", "float32")
    records, model, task = _train(config)
    assert_trained_on_policy(records, task)
    assert_evaluation_in_metrics_file(run_dir)
    assert_export_loads_with_the_learners_logits(run_dir, model, task, tmp_path / "export")
