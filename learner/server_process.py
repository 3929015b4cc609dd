"""The embedded inference server: the reference server (``python -m rollout_client.server``) as a child process.

It binds 127.0.0.1 on a free port and reports the port through ``--port-file``. The child runs
``python -m learner.server_process ARGS``, which on Linux first asks the kernel to kill it when its parent dies
(``PR_SET_PDEATHSIG``), then runs the server: a learner killed with SIGKILL leaves no server behind, and a rerun
starts a fresh one and republishes the checkpoint's weights.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


class ServerProcess:
    """Starts the reference server and waits until it has bound its port.

    Args:
        server_args: arguments after ``python -m rollout_client.server`` (engine, model, dtype, ...).
        log_path: the server's stdout and stderr go here (appended).
        start_timeout_s: how long to wait for the port.

    Raises:
        RuntimeError: the server exited or did not bind in time (with the end of its log).
    """

    def __init__(self, server_args: list[str], log_path: str | os.PathLike, start_timeout_s: float = 180.0):
        self.log_path = pathlib.Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        port_file = self.log_path.with_name(f"server-port-{os.getpid()}")
        port_file.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "learner.server_process", str(os.getpid()), *server_args,
                 "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)],
                stdout=log, stderr=subprocess.STDOUT)
        give_up = time.monotonic() + start_timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > give_up:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the embedded inference server did not start; end of {self.log_path}:\n{tail}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{int(port_file.read_text())}"
        port_file.unlink()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (the server drains), then SIGKILL if it has not exited within ``timeout_s``."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[1]))
    from rollout_client.server.__main__ import main

    main(sys.argv[2:])
