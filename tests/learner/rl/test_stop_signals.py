"""`StopSignals` in a real process receiving real signals: the first raises `Interrupted` (at once, or at the end of a
hold), a second exits at once with the signal's exit code."""

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.e2e.test_main_job import REPO_ROOT, train_env

SCRIPT = textwrap.dedent("""
    import os, signal, time
    from learner.rl.stop_signals import Interrupted, StopSignals

    signals = StopSignals()
    with signals.installed():
        try:
            os.kill(os.getpid(), signal.SIG{first})
            time.sleep(5)
            print("not raised")
        except Interrupted as stop:
            print("raised", stop, stop.exit_code)
    signals = StopSignals()
    with signals.installed():
        signals.hold()
        os.kill(os.getpid(), signal.SIGINT)
        print("held")
        try:
            signals.release()
        except Interrupted as stop:
            print("released", stop)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: exits at once
        time.sleep(5)
        print("still running")
    """)


@pytest.mark.parametrize("first, exit_code", [("INT", 130), ("TERM", 143)])
def test_first_signal_raises_a_held_one_waits_for_release_a_second_exits_at_once(first, exit_code):
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(first=first)], cwd=REPO_ROOT, env=train_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [f"raised SIG{first} {exit_code}", "held", "released SIGINT"], result
    assert result.returncode == 128 + signal.SIGTERM
    assert "SIGTERM again: exiting now; the latest verified checkpoint is kept" in result.stderr
    assert "SIGINT: stopping once this step's update is done" in result.stderr
