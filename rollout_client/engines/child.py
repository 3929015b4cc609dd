"""Runs a module as a child process that dies with its parent.

``python -m rollout_client.engines.child PARENT_PID MODULE ARGS...`` first asks the kernel to SIGKILL this process
when its parent exits (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing), then runs ``python -m MODULE ARGS...`` in this
process. `EngineProcess` starts engines this way: a learner killed with SIGKILL leaves no engine behind.
"""

import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    die_with_parent(int(sys.argv[1]))
    module = sys.argv[2]
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
