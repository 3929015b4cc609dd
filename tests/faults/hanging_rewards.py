"""Rewards for the hung-reward tests (``tests.faults.hanging_rewards:<function>``): rows whose ``hang`` is true never
return, as a reward stuck on a network call or a pathological regex does."""

import time


def hang_where_asked(completion, prompt, row):
    if row.get("hang"):
        while True:
            time.sleep(3600)
    return float(len(completion))


def one_value(completions, prompts, rows):
    """A batched reward that returns one score whatever the batch (a bug that a batch of one hides)."""
    return [1.0]


one_value.batched = True
