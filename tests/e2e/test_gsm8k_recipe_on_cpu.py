"""configs/gsm8k_qwen2.5.toml end to end on a loaded 2-core CPU (issue 39, item 7): a random ~17M-parameter Qwen2
checkpoint (learner.tools.make_gsm8k_tiny's, the same inputs as the GPU check's scripts.bench.recipe), 4 prompts x 4
samples, 3 steps, with the config's server.max_batch_size of 512 and its evaluation at the last step.

The embedded server compiles every program a request runs before it serves, so no Generate waits on a compile: the
server builds no program after step 1's record, the learner none after step 2. Evaluation requests go through the same
retries as training's. On a loaded machine a Generate can still miss its first deadline because the machine is slow
(not compiling): each retry waits twice as long (`ClientConfig.deadline_growth`), so the run finishes. With one fixed
deadline, at load ~4 (two busy loops beside the run) every attempt restarted the same samples and missed the same
33 s, and the first rollouts never came (an engine relaunched after 5 attempts; killed after 15 minutes).
"""

import json
import subprocess
import sys
import types

import pytest

from learner.reporting.metrics_writers import read_metrics
from learner.tools import make_gsm8k_tiny
from scripts.bench.recipe import recipe_command
from tests.e2e.test_main_job import REPO_ROOT, train_env


@pytest.mark.slow  # 471 s at load ~4, 807 s at ~5-6 (2-core): 18 server programs (512 rows x 1024 slots), 3 steps
def test_the_gsm8k_recipe_at_its_batch_size_finishes_on_a_cpu(tmp_path):
    files = make_gsm8k_tiny.write_inputs(tmp_path, "17m", max_seq_len=2048)
    # float32 compute: the recipe's bf16 is for accelerators (XLA:CPU runs bf16 dots slowly: 115-185 s an update of
    # 2 x 2 samples under load, in the scripts/gpu_check.sh --cpu dry run)
    options = types.SimpleNamespace(prompts=4, samples=4, new_tokens=64, steps=3, set=['model.compute_dtype="float32"'])
    command = recipe_command(files, tmp_path / "run", options)
    # XLA's own code generation, not the test run's -O0 (conftest.py): this checks the run's speed under load, and
    # -O0 code decodes 512 rows several times slower (every Generate missed its deadline with it, at load ~10).
    env = {**train_env(), "XLA_FLAGS": ""}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["server/compiled_programs"] > 0
    assert [r["server/compiled_programs"] for r in records] == [records[0]["server/compiled_programs"]] * 3
    assert records[1]["compile/programs"] == records[2]["compile/programs"]
    assert "eval/reward_mean" in records[2] and records[2]["eval/dropped_samples"] == 0
    server_log = (tmp_path / "run" / "server.log").read_text()
    assert "prefill and decode programs in" in server_log
    print(json.dumps({key: value for key, value in records[0].items() if key.startswith("startup/")}),
          "generate/retries:", [r["generate/retries"] for r in records])


@pytest.mark.slow  # 183 s at load 12-16 on the 2-core CPU with an empty compilation cache
def test_the_cpu_recipe_finishes_three_steps_and_no_step_compiles(tmp_path):
    """configs/gsm8k_cpu.toml as docs/models.md tells a user to try it (learner.tools.make_gsm8k_tiny's inputs): 3
    steps, every update program compiled at start (the first update is announced as running, not compiling), none
    built after step 1, and a reward of 0 at every step keeps its panel in learning_curves.png."""
    from learner.reporting.plots import DEFAULT_PANELS, learning_curves_figure

    files = make_gsm8k_tiny.main([str(tmp_path / "files")])
    sets = {"model.hf_path": files["model"], "task.args.path": files["train"], "run_dir": tmp_path / "run"}
    command = [sys.executable, "-m", "learner.train", "--config", str(REPO_ROOT / "configs" / "gsm8k_cpu.toml")]
    for key, value in sets.items():
        command += ["--set", f"{key}={json.dumps(str(value))}"]
    result = subprocess.run(command, cwd=REPO_ROOT, env={**train_env(), "XLA_FLAGS": ""}, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compiling the RL update step for lengths 128, 192, 256" in result.stdout
    assert "running the first RL update (its programs compiled at start) ..." in result.stdout
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["compile/programs"] == records[2]["compile/programs"]  # no program built after step 1
    titles = [axes.get_title() for axes in learning_curves_figure(records, DEFAULT_PANELS).axes]
    assert titles[0] == "reward"
