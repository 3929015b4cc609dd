"""Runs a module as a child process that dies with its parent.

``python -m rollout_client.engines.child PARENT_PID [--group] TARGET ARGS...`` first asks the kernel to SIGKILL this
process when its parent exits (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing), then runs ``python -m TARGET ARGS...``
in this process (``TARGET`` a module name) or ``python TARGET ARGS...`` (``TARGET`` a ``.py`` file). `EngineProcess`
starts engines this way: a learner killed with SIGKILL leaves no engine behind.

The file also runs by its path (``python .../child.py ...``), importing nothing of Tether: that is how an engine runs
under another interpreter (e.g. a vLLM virtual environment without Tether's dependencies).

``--group``: for engines that start processes of their own (vLLM's engine core), which the kernel does not kill with
this one. The child leads a new process group, and a watcher process forked first SIGKILLs that whole group when the
child exits, however it exits (e.g. killed because the learner died).
"""

import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signal_number: int = signal.SIGKILL) -> None:
    """Send ``signal_number`` to this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal_number)
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal_number)


def kill_group_on_exit() -> None:
    """Makes this process a process group leader (unless it is one: `EngineProcess` starts it in its own session)
    and forks a watcher that SIGKILLs the group when it exits."""
    leader = os.getpid()
    if os.getpgrp() != leader:
        os.setpgid(0, 0)
    if os.fork() != 0:
        return
    # The watcher: woken by SIGTERM when the leader exits (or at once if it already has), kills what is left.
    signal.signal(signal.SIGTERM, lambda *_: None)
    die_with_parent(leader, signal.SIGTERM)
    while os.getppid() == leader:
        signal.pause()
    os.killpg(leader, signal.SIGKILL)  # the watcher is in the group: this ends it too
    os._exit(0)


def main(argv: list[str]) -> None:
    """``PARENT_PID [--group] TARGET ARGS...`` (module docstring)."""
    die_with_parent(int(argv[0]))
    rest = argv[1:]
    if rest[0] == "--group":
        kill_group_on_exit()
        rest = rest[1:]
    target, sys.argv = rest[0], [rest[0], *rest[1:]]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if __spec__ is None:  # run by its path: its own directory (rollout_client/engines) must not shadow packages
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    main(sys.argv[1:])
