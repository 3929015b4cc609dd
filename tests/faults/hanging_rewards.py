"""Rewards for the hung-reward tests (``tests.faults.hanging_rewards:<function>``): rows whose ``hang`` is true never
return, as a reward stuck on a network call or a pathological regex does."""

import time


def hang_where_asked(completion, prompt, row):
    if row.get("hang"):
        while True:
            time.sleep(3600)
    return float(len(completion))
