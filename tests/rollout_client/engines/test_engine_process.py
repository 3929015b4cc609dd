"""EngineProcess: an engine's server as a child process (the scripted reference server stands in for any engine)."""

import signal
import socket
import subprocess
import sys
import time

import pytest

from rollout_client import ClientConfig, EngineProcess, RolloutClient
from tests.rollout_client.conftest import REPO_ROOT

SCRIPTED = ("--engine", "scripted", "--vocab-size", "50")


def test_serves_on_loopback_and_stops_on_sigterm(tmp_path):
    engine = EngineProcess("rollout_client.server", SCRIPTED, tmp_path / "logs" / "engine.log", start_timeout_s=60)
    try:
        assert engine.address.startswith("127.0.0.1:") and engine.returncode is None
        with RolloutClient(ClientConfig(target=engine.address, ready_timeout_s=30)) as client:
            assert client.server_info().vocab_size == 50
    finally:
        assert engine.stop() == 0  # SIGTERM: the server drains and exits cleanly
    assert engine.returncode == 0
    assert "rollout-server listening on" in engine.log_path.read_text()


def test_failed_start_names_module_exit_code_and_log(tmp_path):
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError) as caught:
        EngineProcess("rollout_client.server", ["--no-such-flag"], log, start_timeout_s=60)
    message = str(caught.value)
    assert "python -m rollout_client.server" in message and "exit code 2" in message and str(log) in message
    assert "unrecognized arguments: --no-such-flag" in message  # the end of the log


def test_engine_dies_with_its_parent(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from rollout_client import EngineProcess\n"
         f"engine = EngineProcess('rollout_client.server', {list(SCRIPTED)!r}, sys.argv[1], start_timeout_s=60)\n"
         "print(engine.address, flush=True)\n"
         "time.sleep(600)\n", str(tmp_path / "engine.log")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        host, port = parent.stdout.readline().strip().rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return  # nothing listens any more: the engine is gone
        time.sleep(0.1)
    pytest.fail(f"the engine at {host}:{port} outlived its SIGKILLed parent")


SPAWNER = """import importlib.util, subprocess, sys, time
assert importlib.util.find_spec("pool") is None, "rollout_client/engines shadows top-level modules"
grandchild = subprocess.Popen(["sleep", "600"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_grouped_engine_run_by_path_takes_its_own_subprocesses_along_when_its_parent_is_killed(tmp_path):
    """``python=`` runs the child by its path (another interpreter: nothing of Tether imported, nothing shadowed) and
    ``group=True`` kills what the engine started (vLLM's engine core) with it: here a SIGKILLed learner's engine's
    ``sleep``."""
    script, pid_file = tmp_path / "spawner.py", tmp_path / "grandchild.pid"
    script.write_text(SPAWNER)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from rollout_client import EngineProcess\n"
         f"engine = EngineProcess({str(script)!r}, [{str(pid_file)!r}], sys.argv[1], port=1, python=sys.executable,"
         " group=True)\n"
         "print(engine.pid, flush=True)\n"
         "time.sleep(600)\n", str(tmp_path / "engine.log")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
        give_up = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < give_up, (tmp_path / "engine.log").read_text()
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        assert _alive(engine_pid) and _alive(grandchild)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
    give_up = time.monotonic() + 20
    while _alive(engine_pid) or _alive(grandchild):
        assert time.monotonic() < give_up, f"engine {engine_pid} or its subprocess {grandchild} outlived the learner"
        time.sleep(0.1)
