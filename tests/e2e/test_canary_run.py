"""The publish canary (`learner.rl.canary`) on real engines: a healthy publish passes within the tolerance, and an
engine that silently keeps its start-up output head (vLLM's reload of a tied model, vllm#48312) stops the run at its
first publish that loads weights, with one error line. Reference server: a real process whose weight updates keep
the start-up head (tests/support/stale_head_server.py), driven by the real command line. MLX: the real engine, its
checkpoints written with the start-up head."""

import functools
import json
import os
import subprocess

import numpy as np
import pytest
from flax import nnx

import learner.rl.rollout_engines
from learner.model.param_paths import named_leaves
from learner.model.transformer import Transformer, model_config
from learner.rl import Run, load_config
from learner.rl.canary import CanaryMismatchError, default_tolerance
from rollout_client import EngineProcess
from tests.e2e.test_main_job import REPO_ROOT, train_command, train_env

HEAD = "lm_head/kernel"
MLX_SHORT = ["warmup.steps=2", "warmup.batch_size=16", "rollout.prompts_per_step=4", "rollout.num_samples=4",
             "update.fast_compile=true", "loop.steps=2", "canary.every=1"]


@pytest.mark.slow
def test_a_stale_head_on_the_reference_server_stops_the_run_at_its_first_publish_with_one_error_line(tmp_path):
    server = EngineProcess("tests.support.stale_head_server", ["--model-config", "tiny", "--max-seq-len", "64"],
                           tmp_path / "server.log")
    try:
        result = subprocess.run(train_command(tmp_path / "run", f"server.address={json.dumps(server.address)}",
                                              "warmup.steps=10"),
                                cwd=REPO_ROOT, env=train_env(), capture_output=True, text=True, timeout=600)
    finally:
        server.stop()
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
    # the warm-up's 10 updates are version 10: the start's publish, the first that loads weights
    assert lines[-1].startswith("error: publish canary: the tether engine at policy version 10 serves other weights "
                                "than the learner published: its logprobs of the canary's 32 tokens differ from the "
                                "learner's by "), lines[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def mlx_config(run_dir):
    return load_config(REPO_ROOT / "configs" / "mlx_engine.toml", [*MLX_SHORT, f"run_dir={json.dumps(str(run_dir))}"])


@pytest.mark.slow
def test_the_real_mlx_engine_passes_the_canary_at_the_start_and_every_step(tmp_path):
    with Run(mlx_config(tmp_path)) as run:
        records = list(run.steps())
    first, second = (record.metrics for record in records)
    diffs = [first["canary/start_max_abs_diff"], first["canary/max_abs_diff"], second["canary/max_abs_diff"]]
    # MLX and XLA compute the same float32 forward with their own kernels: a few 1e-7 on this tiny model
    assert max(diffs) < default_tolerance("mlx", "float32") / 10, diffs
    assert first["canary/tokens"] == 32


@pytest.mark.slow
def test_a_stale_head_on_the_real_mlx_engine_stops_the_run_at_its_first_publish(tmp_path, monkeypatch):
    """Every checkpoint the engine loads holds the seed's initial head (the warm-up trained the learner's: version
    2), so the engine serves a stale head from its start; the RL steps of this short run hardly move the head (their
    rewards are all 0), which is why the stale head is the seed's, not the start's."""
    seed_model = Transformer(model_config("tiny"), rngs=nnx.Rngs(0))
    seed_head = np.asarray(named_leaves(nnx.state(seed_model, nnx.Param))[HEAD])

    def seed_head_writer(write, directory, weights, **kwargs):
        return write(directory, {**weights, HEAD: seed_head}, **kwargs)

    monkeypatch.setattr(learner.rl.rollout_engines, "write_hf_checkpoint",
                        functools.partial(seed_head_writer, learner.rl.rollout_engines.write_hf_checkpoint))
    records = []
    with pytest.raises(CanaryMismatchError, match=r"the mlx engine at policy version 2 serves other weights .* "
                                                  r"tolerance 0\.0001 for float32"):
        with Run(mlx_config(tmp_path)) as run:
            records += run.steps()
    assert records == []  # caught at the start, before any step


VLLM_PYTHON = os.environ.get("TETHER_VLLM_PYTHON", "")
needs_vllm = pytest.mark.skipif(not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
                                reason="TETHER_VLLM_PYTHON names no Python of a vLLM virtual environment "
                                       "(scripts/install_vllm_cpu.sh DIR makes one: DIR/bin/python)")
VLLM_WARMUP_STEPS = 20  # the head moves away from the checkpoint's; loading the checkpoint is version 1


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    from learner.tools.make_hf_tiny import make_hf_tiny

    return make_hf_tiny(tmp_path_factory.mktemp("hf_tiny") / "files")


def vllm_config(files, run_dir, *extra):
    return load_config(REPO_ROOT / "configs" / "vllm_engine.toml", [
        f"model.hf_path={json.dumps(str(files.model))}", f"task.args.path={json.dumps(str(files.train))}",
        f"task.args.validation.path={json.dumps(str(files.test))}", f"run_dir={json.dumps(str(run_dir))}",
        f"server.python={json.dumps(VLLM_PYTHON)}", f"warmup.steps={VLLM_WARMUP_STEPS}", "warmup.batch_size=16",
        "loop.steps=1", "rollout.prompts_per_step=4", "rollout.num_samples=4", "update.fast_compile=true",
        "canary.every=1", *extra])


@pytest.mark.slow
@needs_vllm
def test_vllms_stale_tied_head_without_the_workaround_stops_the_run_at_its_first_publish(hf_tiny, tmp_path):
    """vLLM starts on the checkpoint (tied: its head is the checkpoint's embedding); the start's publish reloads the
    warmed-up weights in place, keeping that head (vllm#48312): the canary of that first publish stops the run."""
    records = []
    with pytest.raises(CanaryMismatchError, match=f"the vllm engine at policy version {VLLM_WARMUP_STEPS + 1} serves "
                                                  r"other weights .* tolerance 0\.0001 for float32"):
        with Run(vllm_config(hf_tiny, tmp_path, "server.untie_embeddings=false")) as run:
            records += run.steps()
    assert records == []


@pytest.mark.slow
@needs_vllm
def test_vllm_with_the_untie_workaround_passes_the_canary(hf_tiny, tmp_path):
    with Run(vllm_config(hf_tiny, tmp_path)) as run:
        (record,) = run.steps()
    diffs = [record.metrics["canary/start_mean_abs_diff"], record.metrics["canary/mean_abs_diff"]]
    assert max(diffs) < default_tolerance("vllm", "float32") / 10, diffs
