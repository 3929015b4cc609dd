"""An inference engine's server as a child process of the learner, on 127.0.0.1.

The child runs ``python -m MODULE ARGS`` (e.g. ``learner.serving``, the reference server with the learner's model)
through `rollout_client.engine_child`, so it dies with its parent: a learner killed with SIGKILL leaves no server
behind, and a rerun starts a fresh one. The module must take the server shell's ``--host``, ``--port`` and
``--port-file`` arguments (`rollout_client.server.cli.server_parser`): the server binds a free port and reports it
through the port file.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from collections.abc import Sequence

_LOG_TAIL_CHARS = 3000


class EngineProcess:
    """Starts an engine's server and waits until it has bound its port.

    Args:
        module: the Python module that serves, run like ``python -m MODULE`` (e.g. ``"learner.serving"``).
        args: its arguments (model, dtype, ...), without host and port.
        log_path: the server's stdout and stderr go here (appended).
        start_timeout_s: how long to wait for the port.
        env: variables added to the server's environment (e.g. its auth token, which must not be on the command
            line, where any local user can read it).

    Attributes:
        address: ``"127.0.0.1:PORT"``, where the server listens.
        log_path: the server's log.

    Raises:
        RuntimeError: the server exited or did not bind in time; names the module, the exit code and the log, and
            quotes the end of the log.
    """

    def __init__(self, module: str, args: Sequence[str], log_path: str | os.PathLike,
                 start_timeout_s: float = 180.0, env: Mapping[str, str] | None = None):
        self.module = module
        self.log_path = pathlib.Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="engine-") as scratch:
            port_file = pathlib.Path(scratch) / "port"
            with self.log_path.open("ab") as log:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "rollout_client.engine_child", str(os.getpid()), module, *args,
                     "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)],
                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
            give_up = time.monotonic() + start_timeout_s
            while not (port_file.exists() and port_file.read_text().strip()):
                if self._process.poll() is not None:
                    self._fail("exited")
                if time.monotonic() > give_up:
                    self.stop()
                    self._fail(f"did not bind a port within {start_timeout_s:g} s and was stopped")
                time.sleep(0.05)
            self.address = f"127.0.0.1:{int(port_file.read_text())}"

    @property
    def returncode(self) -> int | None:
        """The server's exit code (negative: killed by that signal); None while it runs."""
        return self._process.poll()

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
        raise RuntimeError(f"the engine server (python -m {self.module}) {what} (exit code {self.returncode}); "
                           f"end of its log {self.log_path}:\n{tail}")
