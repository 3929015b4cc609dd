"""Console output of a run: progress bars with live metrics, announced waits, the start-up line and the summary
table at the end.

A run is never silent for long: every wait of its start-up (the train state, the warm-up, the engine, the first
rollouts, the first update's compilation) is announced with what it waits for (`Waiting`), the warm-up and the RL
steps have a progress bar updated at every step, and the first step ends with one line saying where the start-up
time went (`StartupTimes`). On a terminal bars and waits redraw in place; otherwise (logs, CI) they print whole
lines, rate-limited, so that output stays readable when redirected.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TextIO

# (label, metric key, format) of the live fields; missing metrics are left out.
LIVE_FIELDS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("kl(k3)", "rollout_corr/k3_kl", "{:.1e}"),  # the non-negative estimator of the train/rollout KL
    ("lp_diff", "rollout_corr/logprob_abs_diff_mean", "{:.1e}"),
    ("clip", "actor/pg_clipfrac", "{:.3f}"),
    ("lag", "rollout_corr/staleness_mean", "{:.2f}"),
    ("kept", "rollout/kept_fraction", "{:.2f}"),  # share of the step's samples trained on (the rest dropped)
    ("turns", "multiturn/turns_mean", "{:.2f}"),  # multi-turn runs: per episode
    ("tools", "multiturn/tool_calls_mean", "{:.2f}"),
    ("tool_err", "multiturn/tool_errors", "{:.0f}"),  # in the step's episodes
    ("tok/s", "perf/tokens_per_s", "{:.0f}"),
)
WARMUP_FIELDS = (("loss", "loss", "{:.3f}"),)  # the warm-up's bar: its cross entropy


class ProgressBar:
    """``[#####.....] 30/60 reward 0.512 kl(k3) 1.2e-04 ... kept 1.00 ... 1.8 step/s``, updated every step (the
    rate counts from the first step, which compiles).

    On a terminal the bar redraws in place, at most every ``redraw_s``; elsewhere it prints one line at most every
    ``log_every_s`` (and always the first and the last step).

    Args:
        total: last step of the run.
        stream: where to draw (default stderr).
        fields: ``(label, metric key, format)`` of the live fields (`LIVE_FIELDS`, `WARMUP_FIELDS`).
        label: text before the bar (``"warm-up"``).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, total: int, stream: TextIO | None = None,
                 fields: Sequence[tuple[str, str, str]] = LIVE_FIELDS, label: str = "", width: int = 24,
                 redraw_s: float = 0.1, log_every_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.total, self.fields, self.label, self.width = total, fields, label, width
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.interval = redraw_s if self.interactive else log_every_s
        self.clock = clock
        self.first: tuple[int, float] | None = None  # the first step updated, and when: the rate counts from it
        self.drawn: float | None = None  # when the bar was last drawn
        self.open = False  # a terminal line is drawn and not yet ended

    def line(self, step: int, metrics: Mapping[str, float]) -> str:
        """The bar's text at ``step``."""
        filled = round(self.width * step / self.total)
        fields = [f"{label} {fmt.format(metrics[key])}" for label, key, fmt in self.fields if key in metrics]
        if self.first is not None and step > self.first[0]:  # after the first step, whose time is mostly compiling
            fields.append(f"{(step - self.first[0]) / max(self.clock() - self.first[1], 1e-9):.2f} step/s")
        return " ".join([*([self.label] if self.label else []), f"[{'#' * filled}{'.' * (self.width - filled)}]",
                         f"{step}/{self.total}", *fields])

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        if self.drawn is not None and now - self.drawn < self.interval and step != self.total:
            return
        self.drawn = now
        if self.interactive:
            self.stream.write("\r\033[K" + self.line(step, metrics))
            self.stream.flush()
            self.open = True
        else:
            print(self.line(step, metrics), file=self.stream, flush=True)

    def close(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False


class Waiting:
    """Announces a wait: ``<what> ...`` at once, then, on a terminal, the seconds waited so far, redrawn every second
    (``<what> ... 12 s``; the line ends with the total), elsewhere a ``<what>: still waiting (30 s)`` line every
    ``remind_s``. A context manager, or `start` / `stop` (idempotent) for a wait that ends inside a callback.

    Args:
        what: what is waited for, e.g. ``"starting the inference engine (log: runs/x/server.log)"``.
        stream: where to write (default stdout).
        enabled: False writes nothing (processes other than 0).
        quiet_s: announce only a wait that lasts this long (then as above); 0: at once.
    """

    def __init__(self, what: str, stream: TextIO | None = None, enabled: bool = True, remind_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, quiet_s: float = 0.0):
        self.what, self.enabled, self.clock, self.quiet_s = what, enabled, clock, quiet_s
        self.announced = False
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty()
        self.interval = 1.0 if self.interactive else remind_s
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.started = self.seconds = None

    def start(self) -> Waiting:
        self.started = self.clock()
        if self.enabled:
            if not self.quiet_s:
                self._announce()
            self.thread = threading.Thread(target=self._remind, name="tether-waiting", daemon=True)
            self.thread.start()
        return self

    def stop(self) -> float:
        """Ends the wait (once); returns the seconds waited."""
        if self.seconds is None:
            self.seconds = self.clock() - self.started
            self.done.set()
            if self.thread is not None:
                self.thread.join()
                if self.interactive and self.announced:
                    self._write(f"\r\033[K{self.what}: {self.seconds:.1f} s")
        return self.seconds

    def _announce(self) -> None:
        self.announced = True
        self._write(f"{self.what} ...", end="" if self.interactive else "\n")

    def _remind(self) -> None:
        if self.quiet_s:
            if self.done.wait(self.quiet_s):
                return
            self._announce()
        while not self.done.wait(self.interval):
            elapsed = self.clock() - self.started
            if self.interactive:
                self._write(f"\r\033[K{self.what} ... {elapsed:.0f} s", end="")
            else:
                self._write(f"{self.what}: still waiting ({elapsed:.0f} s)")

    def _write(self, text: str, end: str = "\n") -> None:
        self.stream.write(text + end)
        self.stream.flush()

    def __enter__(self) -> Waiting:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


class StartupTimes:
    """Where a run's start-up went: named phases, timed, and one line once the first step is done.

    >>> clock = iter([0.0, 1.0, 2.5, 3.0, 9.0, 10.0]).__next__
    >>> times = StartupTimes(clock=clock)
    >>> with times.phase("train state"):
    ...     pass
    >>> with times.phase("engine start"):
    ...     pass
    >>> times.line()
    'start-up: 10.0 s to the end of the first step: train state 1.5 s, engine start 6.0 s, other 2.5 s'
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str, waiting: Waiting | None = None) -> Iterator[None]:
        """Times the block as phase ``name`` (added to earlier time under that name), announcing ``waiting``."""
        started = self.clock()
        with waiting or contextlib.nullcontext():
            yield
        self.add(name, self.clock() - started)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def _phases(self) -> tuple[float, dict[str, float]]:
        """The seconds since the start, and each phase's seconds with ``other`` (the rest) last."""
        total = self.clock() - self.started
        return total, {**self.seconds, "other": total - sum(self.seconds.values())}

    def line(self) -> str:
        """``start-up: <total> s to the end of the first step: <phase> <s>, ..., other <s>``."""
        total, phases = self._phases()
        parts = [f"{name} {seconds:.1f} s" for name, seconds in phases.items()]
        return f"start-up: {total:.1f} s to the end of the first step: {', '.join(parts)}"

    def metrics(self) -> dict[str, float]:
        """The same as metrics: ``startup/<phase>_s`` (``train state`` -> ``train_state``, ``warm-up`` -> ``warmup``),
        ``startup/other_s`` and ``startup/total_s``, which the phases add up to.

        >>> times = StartupTimes(clock=iter([0.0, 1.0, 2.5, 4.0]).__next__)
        >>> with times.phase("warm-up"):
        ...     pass
        >>> times.metrics()
        {'startup/warmup_s': 1.5, 'startup/other_s': 2.5, 'startup/total_s': 4.0}
        """
        total, phases = self._phases()
        names = {name: name.replace("-", "").replace(" ", "_") for name in phases}
        return {**{f"startup/{names[name]}_s": seconds for name, seconds in phases.items()}, "startup/total_s": total}


def summary_table(rows: Sequence[tuple[str, str]]) -> str:
    """A two-column text table.

    >>> print(summary_table([("steps", "60"), ("reward", "0.31 -> 0.93")]))
    +--------+--------------+
    | steps  | 60           |
    | reward | 0.31 -> 0.93 |
    +--------+--------------+
    """
    left = max(len(name) for name, _ in rows)
    right = max(len(value) for _, value in rows)
    rule = f"+{'-' * (left + 2)}+{'-' * (right + 2)}+"
    return "\n".join([rule, *(f"| {name:<{left}} | {value:<{right}} |" for name, value in rows), rule])
