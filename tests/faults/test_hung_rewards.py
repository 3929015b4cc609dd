"""Issue #49, item 4: rewards that hang cost their samples once, and hold nothing after.

A reward named by import path that never returns on 1 in 4 rows, with ``reward_timeout_s = 3``: each batch takes
at most one timeout more than the same batch without hung rows (each call's limit runs from its own start, 16 at a
time), the hung samples are skipped and named, and after four such batches the process holds no more threads than
its fixed pool and no stuck worker process (each was killed at its timeout).
"""

import threading
import time

import numpy as np
import psutil

from learner.tasks._rewards import RewardSet, make_reward

TIMEOUT_S = 3.0
BATCH = 64


def _score(reward_set: RewardSet, hung_every: int | None) -> tuple[float, np.ndarray, list[str]]:
    rows = [{"hang": hung_every is not None and i % hung_every == 0} for i in range(BATCH)]
    completions = [f"completion {i}" for i in range(BATCH)]
    started = time.monotonic()
    scores = reward_set.score(completions, ["prompt"] * BATCH, rows)
    return time.monotonic() - started, scores.total, scores.errors


def test_a_quarter_of_hung_calls_costs_one_timeout_per_batch_and_no_thread_or_process_after():
    reward_set = RewardSet([make_reward("tests.support.hanging_rewards:hang_where_asked", None)],
                           timeout_s=TIMEOUT_S, workers=16)
    _score(reward_set, None)  # starts the worker processes (not timed: their start is not the reward's time)
    clean = min(_score(reward_set, None)[0] for _ in range(2))
    threads_before = threading.active_count()
    children = psutil.Process().children(recursive=True)
    for _ in range(4):  # four steps
        elapsed, total, errors = _score(reward_set, 4)
        hung = np.arange(BATCH) % 4 == 0
        assert np.isnan(total[hung]).all() and np.isfinite(total[~hung]).all()
        assert len(errors) == BATCH // 4
        assert errors[0] == ("reward 'hang_where_asked' failed on sample 0: TimeoutError: no result within "
                             "reward_timeout_s = 3.0 s (the call was abandoned)")
        # one timeout more than a clean batch, plus (back to back, no update between) starting the 16 workers that
        # replace the killed ones: 2.2 s on the shared 2-core machine
        assert elapsed < clean + TIMEOUT_S + 10, (elapsed, clean)
        assert elapsed >= TIMEOUT_S
    assert threading.active_count() <= threads_before  # the pool's threads, nothing abandoned
    alive = [child for child in psutil.Process().children(recursive=True) if child.is_running()]
    assert len(alive) <= 16 and len(alive) <= len(children) + 16, alive
    print(f"clean batch {clean:.2f} s, with 25% hung {elapsed:.2f} s; threads {threading.active_count()}, "
          f"worker processes {len(alive)}")
