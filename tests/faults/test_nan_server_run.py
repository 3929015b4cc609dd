"""End to end: the main job against a server whose every sample carries a NaN logprob.

Nothing of it is trained on: the client drops every sample (counted), the run stops with a clear error and a
non-zero exit, and the newest checkpoint is the finite one it had. With the publish canary on (the default), the run
stops at its start instead: the canary's samples were dropped too, and its error line says so.
"""

import subprocess

import jax
import numpy as np
import pytest

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.rl import load_config
from learner.rl.trainer import Trainer
from learner.tasks import load_task
from rollout_client import EngineProcess
from tests.e2e.test_main_job import REPO_ROOT, train_command, train_env


@pytest.mark.slow  # 23 s on a quiet 2-core run: out of the default run's 15 minutes
def test_a_nan_producing_server_stops_the_run_and_leaves_a_finite_checkpoint(tmp_path):
    server = EngineProcess("tests.support.nan_server", ["--model-config", "tiny", "--eos-ids", "2", "--max-batch-size",
                                                        "16", "--max-seq-len", "8", "--seed", "0"],
                           tmp_path / "nan_server.log", start_timeout_s=240)
    try:
        run_dir = tmp_path / "run"  # no canary: the rollout batch's path
        result = subprocess.run(train_command(run_dir, "loop.steps=3", f'server.address="{server.address}"',
                                              "canary.every=0"),
                                cwd=REPO_ROOT, env=train_env(), capture_output=True, text=True, timeout=400)
        canaried = subprocess.run(train_command(tmp_path / "canaried", "loop.steps=3",
                                                f'server.address="{server.address}"'),
                                  cwd=REPO_ROOT, env=train_env(), capture_output=True, text=True, timeout=400)
    finally:
        server.stop()
    assert canaried.returncode == 1, canaried.stderr[-3000:]
    assert ("error: publish canary: the tether engine returned no valid canary sample at policy version 2: the "
            "client dropped every one ({'samples/dropped/non_finite_logprobs': ") in canaried.stderr
    assert "Traceback" not in canaried.stderr
    assert result.returncode == 1, result.stderr[-3000:]
    assert "error: step 1: every sample of this rollout batch was dropped (stale or invalid samples)" in result.stderr
    assert "'samples/dropped/non_finite_logprobs'" in result.stderr
    assert "Traceback" not in result.stderr

    config = load_config(REPO_ROOT / "configs" / "default.toml", ["warmup.steps=2", "rollout.prompts_per_step=4",
                                                                  "rollout.num_samples=4", "loop.steps=3"])
    trainer = Trainer(config, load_task(config.task.name, config.task.args))
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"))) as checkpointer:
        assert checkpointer.all_steps() == [0]  # the start of the run; step 1 never trained
        step, metadata = trainer.restore(checkpointer, None)
    assert step == 0 and metadata["policy_version"] == 2  # the 2 warm-up updates
    leaves = jax.tree.leaves(trainer.state.params)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves)
