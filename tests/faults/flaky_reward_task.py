"""A task for real-run tests (``task.name = "tests.faults.flaky_reward_task:FlakyAddition"``): one-digit addition
whose reward raises once, at the first RL step of the first run; ``marker`` (a file path) remembers that it did."""

import dataclasses
import pathlib

from learner.tasks._digit_tasks import Addition


@dataclasses.dataclass(frozen=True)
class FlakyAddition(Addition):
    marker: str = ""
    digits: int = 1

    def rewards(self, rows, completions):
        marker = pathlib.Path(self.marker)
        if not marker.exists():
            marker.write_text("raised once\n")
            raise RuntimeError("flaky reward: raised at the first RL step")
        return super().rewards(rows, completions)
