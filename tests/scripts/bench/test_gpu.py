"""learner/reporting/mfu.py and scripts/bench/gpu.py: the model-FLOPs count against an independent count of the matmul
parameters and a hand computation, the spec-peak lookup, and (slow) the whole benchmark on the CPU at the tiny shape,
as scripts/gpu_check.sh runs it on a GPU."""

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
from learner.reporting.mfu import model_flops, spec_peak_tflops

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


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
def test_model_flops_follow_palms_formula(name):
    config = model_config(name)
    rows, length = 8, 1024
    n = matmul_parameters(name)
    attention = config.num_layers * config.num_heads * config.head_dim * length
    tokens = rows * length
    assert model_flops(config, rows, length, recompute_pass=False) == tokens * (6 * n + 12 * attention)
    assert model_flops(config, rows, length, recompute_pass=True) == tokens * (8 * n + 16 * attention)
    if name == "llama-1b":  # Llama-3.2-1B: 1.24B parameters, all but the norms in matmuls
        assert 1.23e9 < n < 1.24e9


def test_model_flops_of_the_tiny_update_by_hand():
    """tiny: D 64, F 128, V 128 (untied head), 2 layers, 4 query heads and 2 key/value heads of 16.
    Per layer q, o: 64 * 64 each; k, v: 64 * 32 each; MLP 3 * 64 * 128 = 24,576; so 36,864; N = 2 * 36,864 + 64 * 128
    = 81,920. Attention at T = 64: 2 * 4 * 16 * 64 = 8,192. B2 x T64 = 128 tokens:
    training 128 * (6 * 81,920 + 12 * 8,192) = 75,497,472; recompute 128 * (2 * 81,920 + 4 * 8,192) = 25,165,824."""
    config = model_config("tiny")
    assert model_flops(config, 2, 64, recompute_pass=False) == 75_497_472
    assert model_flops(config, 2, 64, recompute_pass=True) == 75_497_472 + 25_165_824


@pytest.mark.parametrize("device_kind, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5", 459.0), ("TPU v6 lite", 918.0),
    ("cpu", None), ("NVIDIA GeForce RTX 4090", None)])
def test_spec_peaks_of_jax_device_kinds(device_kind, tflops):
    assert spec_peak_tflops(device_kind) == tflops


@pytest.mark.slow  # ~3 min on a loaded 2-core CPU: four worker processes compile
def test_the_script_runs_on_the_cpu_at_the_tiny_shape(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-m", "scripts.bench.gpu", "--compare", "tiny", "--mfu", "tiny",
                    "--rows", "2", "--length", "64", "--peak-size", "256", "--rounds", "1", "--calls", "1",
                    "--variants", "fuse_proximal=off,remat=full", "--out", str(tmp_path)],
                   check=True, env=env, cwd=REPO_ROOT, timeout=900)
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    tether, mfu, (variant,) = results["compare"]["tether"], results["mfu"], results["variants"]
    for row in tether, mfu, variant:  # the reported figures follow from the timed seconds each row records
        assert len(row["seconds"]) == 1 and row["median_s"] == statistics.median(row["seconds"]) > 0
        assert row["tokens_per_s"] == pytest.approx(2 * 64 / row["median_s"])
    config = model_config("tiny")
    for row, recompute_pass in (mfu, False), (variant, True):  # the on-policy update runs no proximal pass unless
        assert row["proximal_pass"] is recompute_pass  # fuse_proximal is off
        flops = model_flops(config, 2, 64, recompute_pass=recompute_pass)
        assert row["model_tflops"] == pytest.approx(flops / row["median_s"] / 1e12)
        assert row["device_kind"] == "cpu" and row["spec_tflops"] is None and row["mfu"] is None  # no spec peak
        assert row["product_tflops"] > 0 and row["of_product"] == pytest.approx(row["model_tflops"]
                                                                                / row["product_tflops"])
        assert row["attention"] == "xla"
    assert variant["knobs"] == {**mfu["knobs"], "fuse_proximal": False, "remat": "full"}
    table = (tmp_path / "bench_gpu.md").read_text()
    assert "n/a (no spec peak for 'cpu')" in table and "remat full, fuse_proximal False" in table
