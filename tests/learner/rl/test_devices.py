"""The learner and the embedded server share a host's accelerators through explicit budgets (learner.rl.devices):
the defaults, the refusals naming their keys, the variables a real child process of the run receives, and the GPUs
the learner keeps when the server has its own (CPU-side: what the budgets do on a GPU is tests/accelerator/'s)."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import types

import jax
import pytest

from learner.model.transformer import model_config
from learner.rl import load_config, rollout_engines
from learner.rl.config import memory_fractions
from learner.rl.devices import configure_learner, engine_environment, local_gpu_ids
from rollout_client import EngineProcess

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("overrides, want", [
    ([], (0.65, 0.25)),  # the embedded server shares the learner's devices
    (["server.device_memory_fraction=0.1"], (0.65, 0.1)),
    (["mesh.device_memory_fraction=0.8", "server.device_memory_fraction=0.15"], (0.8, 0.15)),
    (["server.device=1"], (None, None)),  # each alone on its devices: JAX's defaults
    (["server.device=1", "server.device_memory_fraction=0.5"], (None, 0.5)),
    (["server.address='10.0.0.1:50051'"], (None, None)),  # an external engine is not ours to budget
    (["server.address='10.0.0.1:50051'", "mesh.device_memory_fraction=0.9"], (0.9, None)),
])
def test_memory_fractions(overrides, want):
    assert memory_fractions(load_config(None, overrides)) == want


@pytest.mark.parametrize("overrides, message", [
    (["mesh.device_memory_fraction=0.8"], r"mesh.device_memory_fraction=0.8 \+ server.device_memory_fraction=0.25: "
                                          r"the learner and the embedded server share each device, so together "
                                          r"they must stay <= 0.95"),
    (["server.device_memory_fraction=0"], r"server.device_memory_fraction=0: must be > 0"),
    (["mesh.device_memory_fraction=1.5"], r"mesh.device_memory_fraction=1.5: must be > 0 and <= 1"),
    (["server.device=-1"], r"server.device=-1: must be >= 0"),
    (["server.address='10.0.0.1:50051'", "server.device=1"], r"server.device=1: applies to the reference server "
                                                             r"the run launches"),
    (["server.engine=mlx", "server.device_memory_fraction=0.2"], r"server.device_memory_fraction=0.2: applies to"),
])
def test_budgets_that_cannot_work_are_refused_naming_the_keys(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_the_host_gpus_come_from_cuda_visible_devices_else_the_driver(tmp_path):
    for index in range(3):
        (tmp_path / f"0000:0{index}:00.0").mkdir()
    assert local_gpu_ids({}, tmp_path) == ["0", "1", "2"]
    assert local_gpu_ids({"CUDA_VISIBLE_DEVICES": "4, 6"}, tmp_path) == ["4", "6"]
    assert local_gpu_ids({}, tmp_path / "absent") == []


def test_the_server_gets_its_own_gpu_and_the_learner_the_others(tmp_path):
    for index in range(4):
        (tmp_path / str(index)).mkdir()
    config = load_config(None, ["server.device=2"])
    assert engine_environment(config, {}, tmp_path) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert engine_environment(config, {"CUDA_VISIBLE_DEVICES": "1,3,5,7"}, tmp_path) == {"CUDA_VISIBLE_DEVICES": "5"}
    environ = {}
    try:
        configure_learner(config, environ, tmp_path)
        assert jax.config.values["jax_cuda_visible_devices"] == "0,1,3"
    finally:
        jax.config.update("jax_cuda_visible_devices", "all")
    assert environ == {}  # alone on its GPUs, the learner keeps JAX's default budget
    configure_learner(load_config(None), environ, tmp_path)
    assert environ == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.65"}


@pytest.mark.parametrize("gpus, message", [(0, r"sees 0 NVIDIA GPU\(s\)"), (1, r"sees 1 NVIDIA GPU\(s\)"),
                                           (2, r"server.device=2: this process sees 2 GPUs \(0 to 1\)")])
def test_a_server_device_the_host_lacks_is_refused(tmp_path, gpus, message):
    for index in range(gpus):
        (tmp_path / str(index)).mkdir()
    with pytest.raises(ValueError, match=message):
        engine_environment(load_config(None, ["server.device=2"]), {}, tmp_path)


@pytest.mark.parametrize("overrides, want", [
    ([], {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25", "CUDA_VISIBLE_DEVICES": "3,5"}),  # the learner's GPUs
    (["server.device_memory_fraction=0.3"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}),
    (["server.device=1"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": None, "CUDA_VISIBLE_DEVICES": "5"}),
])
def test_the_launched_server_process_runs_with_its_budget_and_device(tmp_path, monkeypatch, overrides, want):
    """The run's own launch path (`learner.rl.rollout_engines`), with a server that reports its environment."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # what the learner's process was given
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setattr(rollout_engines, "EngineProcess",
                        lambda module, *args, **kwargs: EngineProcess("tests.support.env_reporting_server", *args,
                                                                      **kwargs))
    config = load_config(None, overrides)
    trainer = types.SimpleNamespace(model_config=model_config("tiny"), length=32)
    members = rollout_engines._tether_members(config, trainer, [2], tmp_path)
    members[0].engine.close()
    reported = json.loads((tmp_path / "server.log").read_text().splitlines()[0].removeprefix("ENV "))
    for name, value in want.items():
        assert reported[name] == value, name
    assert reported["XLA_PYTHON_CLIENT_PREALLOCATE"] is None  # preallocated: a budget that does not fit fails at start


@pytest.mark.parametrize("overrides, want", [
    ([], (None, None)),  # process 1 launches no server: its devices are its own
    (["mesh.device_memory_fraction=0.65"], (0.65, None)),
    (["server.device=1"], (None, None)),
])
def test_processes_other_than_0_keep_jax_default_unless_set(overrides, want):
    assert memory_fractions(load_config(None, overrides), process_index=1) == want


def test_each_process_of_a_distributed_run_reads_its_index_and_budget_before_any_backend(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    processes = [subprocess.Popen([sys.executable, "-m", "tests.support.budget_reporting_process",
                                   f"127.0.0.1:{port}", str(i)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outputs = [process.communicate(timeout=120) for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert [p.returncode for p in processes] == [0, 0], [err[-2000:] for _, err in outputs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert reports == [{"index": 0, "budget": "0.65", "backends_started": False},
                       {"index": 1, "budget": None, "backends_started": False}]
