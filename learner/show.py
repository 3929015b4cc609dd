"""A step's completions as text: ``python -m learner.show RUN_DIR [--step N] [--samples K]``.

Reads one trained batch of the run's rollout log (``RUN_DIR/rollout_log``, `learner.reporting.rollout_log`; default:
the last step logged) and prints each group's prompt once, then each sample's reward, advantage, the policy versions
that sampled its tokens (against the learner's version when it trained them) and its completion, decoded with the
run's tokenizer: ``model.hf_path``'s, or the task's (read from the newest checkpoint's metadata, as the run was
configured). A completion runs from the row's first trained token to its last; a multi-turn episode's tool output
inside it is shown as it was.

Example::

    python -m learner.show runs/default --step 31 --samples 4
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from learner.checkpoints.checkpointer import read_step
from learner.reporting.rollout_log import LoggedBatch, RolloutLogReader


def run_config(run_dir: pathlib.Path) -> dict:
    """The run's config as its newest checkpoint recorded it."""
    checkpoints = run_dir / "checkpoints"
    steps = sorted((int(path.name) for path in checkpoints.iterdir() if path.name.isdigit()), reverse=True) \
        if checkpoints.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"{checkpoints}: no checkpoint to read the run's config (its tokenizer) from")
    return read_step(checkpoints / str(steps[0]))[0].get("config") or {}


def decode(tokenizer, ids: np.ndarray) -> str:
    """The text of ``ids``, special tokens shown where the tokenizer can write them."""
    try:
        return tokenizer.decode(ids)
    except ValueError:  # the character tokenizer has no text for its special ids
        return tokenizer.decode(ids, skip_special_tokens=True)


def _versions(versions: np.ndarray) -> str:
    low, high = int(versions.min()), int(versions.max())
    return f"v{low}" if low == high else f"v{low}-{high}"


def describe(batch: LoggedBatch, tokenizer, samples: int | None = None) -> str:
    """The batch as text: a header, then per group its prompt and each sample (at most ``samples`` per group)."""
    learner = np.broadcast_to(np.asarray(-1 if batch.learner_version is None else batch.learner_version),
                              batch.rewards.shape)
    lines = [f"step {batch.step}: {len(batch.rewards)} samples, reward mean {batch.rewards.mean():.3f}, trained by "
             f"learner version {int(learner.max())}"]
    previous, shown = None, 0
    for row in range(len(batch.rewards)):
        scored = np.flatnonzero(batch.loss_mask[row] > 0)
        if not scored.size:
            continue
        first, last = int(scored[0]), int(scored[-1])
        prompt = tuple(batch.tokens[row, :first].tolist())
        if prompt != previous:
            previous, shown = prompt, 0
            lines.append(f"prompt: {json.dumps(decode(tokenizer, np.asarray(prompt)))}")
        shown += 1
        if samples is not None and shown > samples:
            continue
        completion = decode(tokenizer, batch.tokens[row, first:last + 1])
        lines.append(f"  reward {batch.rewards[row]:.3f}  advantage {batch.advantages[row, first]:+.3f}  "
                     f"sampled by {_versions(batch.policy_version[row, scored])} (learner v{int(learner[row])})  "
                     f"{json.dumps(completion)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m learner.show", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=pathlib.Path, help="the run directory (holds rollout_log/ and checkpoints/)")
    parser.add_argument("--step", type=int, help="the step to show (default: the last logged)")
    parser.add_argument("--samples", type=int, help="at most this many samples per prompt (default: all)")
    args = parser.parse_args(argv)
    try:
        if not (args.run_dir / "rollout_log").is_dir():
            raise FileNotFoundError(f"{args.run_dir / 'rollout_log'}: no rollout log (is this a run directory?)")
        reader = RolloutLogReader(args.run_dir / "rollout_log")
        logged = reader.steps.tolist()
        if not logged:
            raise ValueError(f"{args.run_dir / 'rollout_log'}: no step logged yet")
        step = logged[-1] if args.step is None else args.step
        if step not in logged:
            raise ValueError(f"--step {step}: not in the rollout log (steps {logged[0]}-{logged[-1]})")
        from learner.tasks import run_tokenizer

        tokenizer = run_tokenizer(run_config(args.run_dir))
        print(describe(reader.read(step), tokenizer, args.samples))
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
