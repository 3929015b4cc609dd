"""configs/gsm8k_qwen2.5.toml end to end on a loaded 2-core CPU (issue 39, item 7): a random ~17M-parameter Qwen2
checkpoint (scripts/bench_recipe.py, the same inputs as the GPU check's), 4 prompts x 4 samples, 3 steps, with the
config's server.max_batch_size of 512 and its evaluation at the last step.

The embedded server compiles every prefill and decode program before it serves, so no Generate waits on a compile
(no retry) and no program is built after step 2; evaluation requests go through the same retries as training's.
"""

import json
import subprocess
import sys
import types

import pytest

from learner.reporting.metrics_writers import read_metrics
from tests.e2e.test_main_job import REPO_ROOT, train_env

sys.path.insert(0, str(REPO_ROOT / "scripts"))


@pytest.mark.slow  # ~6 min on the shared 2-core machine: 18 server programs at 512 rows and 1024 slots, 3 steps, eval
def test_the_gsm8k_recipe_at_its_batch_size_finishes_on_a_cpu(tmp_path):
    import bench_recipe

    files = bench_recipe.write_inputs(tmp_path, "17m", max_seq_len=2048)
    # float32 compute: the recipe's bf16 is for accelerators (XLA:CPU runs bf16 dots slowly: 115-185 s an update of
    # 2 x 2 samples under load, in the scripts/gpu_check.sh --cpu dry run)
    options = types.SimpleNamespace(prompts=4, samples=4, new_tokens=64, steps=3, set=['model.compute_dtype="float32"'])
    command = bench_recipe.recipe_command(files, tmp_path / "run", options)
    # XLA's own code generation, not the test run's -O0 (conftest.py): this checks the run's speed under load, and
    # -O0 code decodes 512 rows several times slower (every Generate missed its deadline with it, at load ~10).
    env = {**train_env(), "XLA_FLAGS": ""}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["generate/retries"] == 0 for r in records), [r["generate/retries"] for r in records]
    for key in ("compile/programs", "server/compiled_programs"):
        assert records[1][key] == records[2][key], key
    assert "eval/reward_mean" in records[2] and records[2]["eval/dropped_samples"] == 0
    server_log = (tmp_path / "run" / "server.log").read_text()
    assert "prefill and decode programs in" in server_log
    print(json.dumps({key: value for key, value in records[0].items() if key.startswith("startup/")}))
