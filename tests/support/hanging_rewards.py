"""Rewards for the hung-reward tests (``tests.support.hanging_rewards:<function>``): rows whose ``hang`` is true never
return, as a reward stuck on a network call or a pathological regex does."""

import time
import zlib


def hang_where_asked(completion, prompt, row):
    if row.get("hang"):
        while True:
            time.sleep(3600)
    return float(len(completion))


def one_value(completions, prompts, rows):
    """A batched reward that returns one score whatever the batch (a bug that a batch of one hides)."""
    return [1.0]


one_value.batched = True


def hang_on_a_quarter(completion, prompt, row):
    """Never returns for about 1 completion in 4 (by the completion's and prompt's text: deterministic)."""
    if zlib.crc32(f"{prompt}|{completion}".encode()) % 4 == 0:
        hang_where_asked(completion, prompt, {"hang": True})
    return float(completion.strip() == str(row.get("answer")))


def exact(completion, prompt, row):
    """``hang_on_a_quarter`` without the hang: the clean run's reward."""
    return float(completion.strip() == str(row.get("answer")))
