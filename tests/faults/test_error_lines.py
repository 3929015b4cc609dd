"""Bad input to ``python -m learner.train``: one ``error:`` line on stderr naming the key (or file) and the fix, exit
1, never a traceback; each found before anything trains (a real subprocess per case)."""

import re
import subprocess
import sys

import pytest

from tests.e2e.test_main_job import DEFAULT_CONFIG, REPO_ROOT, train_env

CASES = {
    "unknown model name": (["--set", 'model.name="nope"'], "model.name: unknown model config 'nope'; known: "),
    "two processes, no coordinator": (["--set", "distributed.num_processes=2"],
                                      "distributed.num_processes=2: needs distributed.coordinator"),
    "missing config file": (["--config", "{tmp}/missing.toml"], "--config {tmp}/missing.toml: no such file"),
    "mesh of 3 on 1 device": (["--set", "mesh.data=3"], "mesh.data, mesh.fsdp, mesh.tensor: mesh {'data': 3, "
                                                        "'fsdp': 1, 'tensor': 1} needs 3 devices, have 1; their "
                                                        "product must be the device count"),
    "mesh of 0": (["--set", "mesh.data=0"], "mesh.data=0: each mesh size is a positive device count, or -1"),
    "missing hf_path": (["--set", 'model.hf_path="{tmp}/no_model"'],
                        "model.hf_path='{tmp}/no_model': no config.json there"),
    "TOML syntax error": (["--config", "{tmp}/bad.toml"], "{tmp}/bad.toml: not valid TOML: Expected ']'"),
    "unknown task arg": (["--set", "task.args={num_promts=4}"], "task.args: addition_1digit() got an unexpected "
                                                                "keyword argument 'num_promts'; valid: num_prompts, "),
    "refused engine": (["--set", 'server.address="127.0.0.1:9"'], "server.address: cannot reach 127.0.0.1:9 ("),
}


def error_line(command, cwd=REPO_ROOT, stdout: list | None = None) -> str:
    """Runs ``command``; asserts exit 1 with exactly one ``error:`` line and no traceback; returns the line (and
    appends what it printed on stdout to ``stdout``)."""
    result = subprocess.run(command, cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=240)
    if stdout is not None:
        stdout.append(result.stdout)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_one_error_line_naming_the_key(tmp_path, case):
    args, expected = CASES[case]
    (tmp_path / "bad.toml").write_text('[model]\nname = "tiny"\n[loop\nsteps = 3\n')
    command = [sys.executable, "-m", "learner.train", "--config", str(DEFAULT_CONFIG),
               "--set", f'run_dir="{tmp_path}/run"', "--set", "warmup.steps=0",
               *[arg.replace("{tmp}", str(tmp_path)) for arg in args]]
    line = error_line(command)
    assert expected.replace("{tmp}", str(tmp_path)) in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()  # found before anything trained or was saved


def test_a_resume_with_another_model_is_refused_listing_every_changed_key(tmp_path):
    """Checked against the checkpoint's metadata before any array is read (another model's arrays would fail in
    orbax, asking for partial_restore)."""
    import jax.numpy as jnp

    from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
    from learner.rl import load_config, to_dict

    run_dir = tmp_path / "run"
    saved = load_config(DEFAULT_CONFIG, [f'run_dir="{run_dir}"', "warmup.steps=0", 'model.name="small"'])
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"))) as checkpointer:
        checkpointer.save(0, {"w": jnp.zeros(3)}, policy_version=0, config=to_dict(saved))
    line = error_line([sys.executable, "-m", "learner.train", "--config", str(DEFAULT_CONFIG),
                       "--set", f'run_dir="{run_dir}"', "--set", "warmup.steps=0",
                       "--set", "task.args={num_prompts=64, digits=1}"])
    assert line == (f"error: {run_dir}/checkpoints holds step 0 of a run with other settings: model.name, "
                    "task.args.digits, task.args.num_prompts changed. Use a new run_dir, or set "
                    "loop.allow_config_change = true to resume anyway")


@pytest.mark.slow  # a real run up to step 1
def test_ctrl_c_mid_run_is_one_line_and_exit_130(tmp_path):
    """SIGINT (Ctrl-C) while training: exit 130 with one line naming the checkpoint saved, no traceback (matplotlib's,
    or any other)."""
    import signal
    import time

    from learner.reporting.metrics_writers import read_metrics
    from tests.e2e.test_main_job import train_command

    run_dir = tmp_path / "run"
    process = subprocess.Popen(train_command(run_dir, "loop.steps=50", "loop.plot_every=1"), cwd=REPO_ROOT,
                               env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        give_up = time.monotonic() + 300
        while not read_metrics(run_dir / "metrics.jsonl"):
            assert process.poll() is None and time.monotonic() < give_up, "the run ended or took too long"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        stderr = process.communicate(timeout=120)[1]
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert re.search(r"^interrupted \(SIGINT\): checkpoint (\d+) saved and verified; rerun the same command to resume "
                     r"from step \1$", stderr, re.MULTILINE), stderr[-3000:]
