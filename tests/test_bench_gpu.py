"""scripts/bench_gpu.py: its model-FLOPs count against an independent count of the matmul parameters, and (slow) the
whole script on the CPU at the tiny shape, as scripts/gpu_check.sh runs it on a GPU."""

import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

import pytest
from flax import nnx

from learner.model.transformer import Transformer, model_config

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
from bench_gpu import model_flops  # noqa: E402


def matmul_parameters(name: str) -> int:
    """Every kernel of the model, and the embedding when it is also the output head."""
    config = model_config(name)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "kernel" or (config.tie_embeddings and path[-1] == "embedding"):
            total += math.prod(leaf.shape)
    return total


@pytest.mark.parametrize("name", ["tiny", "qwen2-0.5b", "llama-1b"])
def test_model_flops_follow_the_issues_formula(name):
    config = model_config(name)
    rows, length = 8, 1024
    n = matmul_parameters(name)
    attention = config.num_layers * config.num_heads * config.head_dim * length
    tokens = rows * length
    assert model_flops(name, rows, length) == tokens * (8 * n + 16 * attention)
    if name == "llama-1b":  # Llama-3.2-1B: 1.24B parameters, all but the norms in matmuls
        assert 1.23e9 < n < 1.24e9


@pytest.mark.slow  # ~2 min on a loaded 2-core CPU: three worker processes compile
def test_the_script_runs_on_the_cpu_at_the_tiny_shape(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench_gpu.py"), "--compare", "tiny", "--mfu", "tiny",
                    "--rows", "2", "--length", "64", "--peak-size", "256", "--rounds", "1", "--calls", "1",
                    "--out", str(tmp_path)], check=True, env=env, cwd=REPO_ROOT, timeout=600)
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    tether, mfu = results["compare"]["tether"], results["mfu"]
    for row in tether, mfu:  # the reported figures follow from the timed seconds each row records
        assert len(row["seconds"]) == 1 and row["median_s"] == statistics.median(row["seconds"]) > 0
        assert row["tokens_per_s"] == pytest.approx(2 * 64 / row["median_s"])
    assert mfu["model_tflops"] == pytest.approx(model_flops("tiny", 2, 64) / mfu["median_s"] / 1e12)
    assert mfu["peak_tflops"] > 0 and mfu["mfu"] == pytest.approx(mfu["model_tflops"] / mfu["peak_tflops"])
    assert f"**{mfu['mfu']:.1%}**" in (tmp_path / "bench_gpu.md").read_text()
