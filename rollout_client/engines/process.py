"""An inference engine's server as a child process of the learner, on 127.0.0.1.

The child runs ``python -m MODULE ARGS`` (e.g. ``learner.serving``, the reference server with the learner's model)
through `rollout_client.engines.child`, so it dies with its parent: a learner killed with SIGKILL leaves no server
behind, and a rerun starts a fresh one.

Two ways to learn the port:

- ``port=None``: the module takes the server shell's ``--host``, ``--port`` and ``--port-file`` arguments
  (`rollout_client.server.cli.server_parser`): it binds a free port and reports it through the port file, and the
  constructor returns once it has.
- ``port=N``: the module takes ``--host`` and ``--port`` only and cannot report a port it picked (the MLX servicer,
  ``python -m smg_grpc_servicer.mlx.server``): it is started on port N (`free_port`), and the caller waits for it
  to serve (its health check), calling `check_alive` while it waits.

``python``: another interpreter than the learner's (e.g. a virtual environment with vLLM); the child then runs by its
file path and imports nothing of Tether, and ``module`` may be a ``.py`` file (`rollout_client.engines.child`).
``group=True``: the server's own subprocesses die with it (`rollout_client.engines.child.kill_group_on_exit`).

A server that exits raises `EngineExitedError`, naming the module, the address, the exit code and the log.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from rollout_client.errors import RolloutUnavailableError

_LOG_TAIL_CHARS = 3000
# rollout_client/engines/child.py by its path, not imported: run with ``-m`` after an import of it, runpy warns in the
# server's log (its first line, which launched servers may use to report).
_CHILD_FILE = pathlib.Path(__file__).with_name("child.py")


class EngineExitedError(RolloutUnavailableError, RuntimeError):
    """A launched engine's server exited (or never served); the message names its address, exit code and log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class EngineProcess:
    """Starts an engine's server (see the module docstring for ``port``).

    Args:
        module: the Python module that serves, run like ``python -m MODULE`` (e.g. ``"learner.serving"``).
        args: its arguments (model, dtype, ...), without host and port.
        log_path: the server's stdout and stderr go here (appended).
        start_timeout_s: how long to wait for the port (``port=None``).
        env: variables added to the server's environment (e.g. its auth token, which must not be on the command
            line, where any local user can read it).
        port: the port to serve on; None: the server picks one and reports it through a port file.
        python: the interpreter that runs the server; None: this one.
        group: the server leads a process group that is killed when it exits (its own subprocesses die with it).

    Attributes:
        address: ``"127.0.0.1:PORT"``, where the server listens.
        log_path: the server's log.

    Raises:
        EngineExitedError: the server exited or did not bind in time; names the module, the exit code and the log,
            and quotes the end of the log.
    """

    def __init__(self, module: str, args: Sequence[str], log_path: str | os.PathLike,
                 start_timeout_s: float = 180.0, env: Mapping[str, str] | None = None, port: int | None = None,
                 python: str | os.PathLike | None = None, group: bool = False):
        self.module = module
        self.log_path = pathlib.Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.address = f"127.0.0.1:{port}" if port is not None else "127.0.0.1 (port not yet bound)"
        environment = {**os.environ, **(env or {})}
        runner = ([sys.executable, "-m", "rollout_client.engines.child"] if python is None
                  else [os.fspath(python), os.fspath(_CHILD_FILE)])
        child = [*runner, str(os.getpid()), *(["--group"] if group else []), module, *args, "--host", "127.0.0.1"]
        if port is not None:
            self._process = self._start([*child, "--port", str(port)], environment)
            return
        with tempfile.TemporaryDirectory(prefix="engine-") as scratch:
            port_file = pathlib.Path(scratch) / "port"
            self._process = self._start([*child, "--port", "0", "--port-file", str(port_file)], environment)
            give_up = time.monotonic() + start_timeout_s
            while not (port_file.exists() and port_file.read_text().strip()):
                self.check_alive()
                if time.monotonic() > give_up:
                    self.stop()
                    self._fail(f"did not bind a port within {start_timeout_s:g} s and was stopped")
                time.sleep(0.05)
            self.address = f"127.0.0.1:{int(port_file.read_text())}"

    def _start(self, command: list[str], env: Mapping[str, str]) -> subprocess.Popen:
        # O_NOFOLLOW: a link planted at the log's name is refused (ELOOP), never written through
        with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644), "ab") as log:
            # its own session: a terminal's Ctrl-C reaches the learner alone, which stops the run (and then the engine)
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The server's exit code (negative: killed by that signal); None while it runs."""
        return self._process.poll()

    def check_alive(self) -> None:
        """Raises `EngineExitedError` (address, exit code, end of the log) if the server has exited."""
        if self._process.poll() is not None:
            self._fail("exited")

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (the server drains), then SIGKILL if it has not exited within ``timeout_s``; the exit code."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        return self._process.returncode

    def _fail(self, what: str) -> None:
        tail = self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
        command = f"python {self.module}" if self.module.endswith(".py") else f"python -m {self.module}"
        raise EngineExitedError(f"the engine server at {self.address} ({command}) {what} (exit code "
                                f"{self.returncode}; last line {last!r}); end of its log {self.log_path}:\n{tail}")
