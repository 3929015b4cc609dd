"""Plug-in tasks for real-run tests (``task.name = "tests.support.flaky_reward_task:<class>"``): one-digit addition
whose rewards misbehave."""

import dataclasses
import pathlib

from learner.tasks._digit_tasks import Addition


@dataclasses.dataclass(frozen=True)
class FlakyAddition(Addition):
    """Its reward raises once, at the first RL step of the first run; ``marker`` (a file path) remembers that it did."""

    marker: str = ""
    digits: int = 1

    def rewards(self, rows, completions):
        marker = pathlib.Path(self.marker)
        if not marker.exists():
            marker.write_text("raised once\n")
            raise RuntimeError("flaky reward: raised at the first RL step")
        return super().rewards(rows, completions)


@dataclasses.dataclass(frozen=True)
class HugeFirstReward(Addition):
    """One-digit addition computing its own rewards (no `learner.tasks.RewardSet`), 1e300 for the first sample of
    each call: beyond `learner.tasks.REWARD_BOUND`, so the loop must skip and count it."""

    digits: int = 1

    def rewards(self, rows, completions):
        rewards = super().rewards(rows, completions).astype(float)
        rewards[0] = 1e300
        return rewards
