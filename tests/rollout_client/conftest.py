"""Fixtures that run reference servers as real processes on 127.0.0.1."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from rollout_client import ClientConfig, RolloutClient

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


class ServerProcess:
    """A server subprocess; `port` is read from its --port-file."""

    def __init__(self, argv: list[str], workdir: pathlib.Path, env: dict | None = None, port: int = 0):
        self.argv = argv
        self.workdir = workdir
        self.env = {**os.environ, **(env or {})}
        self.port = port
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts (or restarts, on the same port) and waits for the bound port."""
        port_file = self.workdir / f"port-{time.monotonic_ns()}"
        self.log = open(self.workdir / "server.log", "ab")
        self.process = subprocess.Popen(
            [*self.argv, "--port", str(self.port), "--port-file", str(port_file)],
            cwd=REPO_ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        give_up = time.monotonic() + START_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text()):
            if self.process.poll() is not None or time.monotonic() > give_up:
                self.stop()
                raise RuntimeError(f"server did not start: {self.output()[-3000:]}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def output(self) -> str:
        return (self.workdir / "server.log").read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: the server dies without draining."""
        self.process.kill()
        self.process.wait(timeout=10)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Signals the server and waits; kills it if it does not exit. Returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        return self.process.returncode


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(*extra_args, module=..., env=...) -> ServerProcess, stopped at teardown."""
    servers = []

    def start(*extra_args: str, module: str = "rollout_client.server", script: str | None = None,
              env: dict | None = None) -> ServerProcess:
        entry = [script] if script else ["-m", module]
        workdir = tmp_path / f"server{len(servers)}"
        workdir.mkdir()
        server = ServerProcess([sys.executable, *entry, *extra_args], workdir, env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(signal.SIGKILL)


SCRIPTED = ("--engine", "scripted", "--vocab-size", "1000")


@pytest.fixture
def scripted_server(start_server, tmp_path):
    """A scripted-engine server that produces a token every 2 ms and reads weights paths in the test's tmp_path."""
    return start_server(*SCRIPTED, "--step-delay-s", "0.002", "--weights-dir", str(tmp_path))


@pytest.fixture
def client(scripted_server):
    with RolloutClient(ClientConfig(target=scripted_server.target, ready_timeout_s=30)) as rollout_client:
        yield rollout_client
