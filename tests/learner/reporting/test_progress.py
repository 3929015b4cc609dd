"""Console output of a run: the progress bar updates every step, rate-limited, and waits are announced."""

import io
import re
import threading
import time

from learner.reporting.progress import WARMUP_FIELDS, ProgressBar, Waiting


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


MULTI_TURN = {"reward/mean": 0.5, "multiturn/turns_mean": 1.75, "multiturn/tool_calls_mean": 0.5,
              "multiturn/tool_errors": 3.0}


def test_in_logs_a_line_at_most_every_5_s_and_always_the_first_and_last_step():
    stream, clock = Stream(tty=False), Clock()
    bar = ProgressBar(10, stream=stream, clock=clock)
    for step in range(1, 11):
        clock.now = 2.0 * step  # a step every 2 s: steps 1, 4 (8 s), 7 (14 s) and the last
        bar.update(step, MULTI_TURN)
    lines = stream.getvalue().splitlines()
    assert [int(re.search(r"(\d+)/10", line).group(1)) for line in lines] == [1, 4, 7, 10]
    assert lines[0].endswith("1/10 reward 0.500 turns 1.75 tools 0.50 tool_err 3")  # no rate at the first step
    assert lines[-1].endswith("tool_err 3 0.50 step/s")  # 9 steps in 18 s


def test_on_a_terminal_every_step_redraws_at_most_ten_times_a_second():
    stream, clock = Stream(tty=True), Clock()
    bar = ProgressBar(4, stream=stream, clock=clock, fields=WARMUP_FIELDS, label="warm-up")
    for step, now in zip(range(1, 5), (0.5, 0.55, 0.7, 0.71)):
        clock.now = now
        bar.update(step, {"loss": 1.0 / step})
    bar.close()
    draws = stream.getvalue().split("\r\033[K")[1:]
    assert [draw.split()[2] for draw in draws] == ["1/4", "3/4", "4/4"]  # 2/4 came 0.05 s after 1/4
    assert draws[0] == "warm-up [######..................] 1/4 loss 1.000"  # no rate yet: the first step compiles
    assert draws[-1] == "warm-up [########################] 4/4 loss 0.250 14.29 step/s\n"  # 3 steps in 0.21 s


def test_a_wait_is_announced_at_once_and_reminded_in_logs():
    stream = Stream(tty=False)
    waiting = Waiting("waiting for the first rollouts", stream=stream, remind_s=0.01).start()
    reminded = threading.Event()
    while not reminded.wait(0.01):
        if "still waiting" in stream.getvalue():
            reminded.set()
    seconds = waiting.stop()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "waiting for the first rollouts ..."
    assert re.fullmatch(r"waiting for the first rollouts: still waiting \(\d+ s\)", lines[1])
    assert waiting.stop() == seconds  # idempotent


def test_a_wait_on_a_terminal_ends_its_line_with_the_time_waited_and_a_disabled_one_writes_nothing():
    clock = Clock()
    stream = Stream(tty=True)
    with Waiting("compiling the RL update step", stream=stream, clock=clock):
        clock.now = 12.34
    assert stream.getvalue() == "compiling the RL update step ...\r\033[Kcompiling the RL update step: 12.3 s\n"
    quiet = Stream(tty=False)
    with Waiting("building the train state", stream=quiet, enabled=False):
        pass
    assert quiet.getvalue() == ""


def test_a_quiet_wait_is_announced_only_once_it_lasts():
    """A later step's phase (``quiet_s``): silent when short, announced and reminded when long."""
    short = Stream(tty=False)
    with Waiting("step 7: running the RL update", stream=short, quiet_s=60.0):
        pass
    assert short.getvalue() == ""
    long = Stream(tty=False)
    waiting = Waiting("step 7: running the RL update", stream=long, quiet_s=0.01, remind_s=0.01).start()
    while "still waiting" not in long.getvalue():
        time.sleep(0.01)
    waiting.stop()
    lines = long.getvalue().splitlines()
    assert lines[0] == "step 7: running the RL update ..."
    assert re.fullmatch(r"step 7: running the RL update: still waiting \(\d+ s\)", lines[1])
