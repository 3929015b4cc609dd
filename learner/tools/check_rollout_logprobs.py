"""Checks each logged token's rollout logprob against the policy version that drew it, from the run's checkpoints.

A token's rollout logprob is what the server reported when it sampled it; its ``policy_version`` names the weights
it claims to have used. For every version that has a verified checkpoint in RUN/checkpoints, this recomputes the
logprobs of that version's tokens in RUN/rollout_log under that checkpoint's parameters (float32, the named model's
or ``model.hf_path``'s architecture) and prints the largest and mean absolute difference, in three groups:

- tokens of samples drawn by one version;
- tokens of samples drawn by several versions (partial rollouts), drawn before the sample's first publish;
- the same samples' tokens drawn after a publish: under ``rollout.partial_kv = "recompute"`` they should agree as the
  first two groups do (the prefix's keys and values rebuilt under the new weights); under ``"keep"`` the difference
  measures the approximation of decoding on over the old weights' cache. (A multi-turn episode whose turns were drawn
  by different versions also counts as several versions; its turns start from a fresh prefill.)

Check a whole run by keeping a checkpoint of every version: ``--set checkpoints.every=1 --set
checkpoints.keep_last=N`` with N at least ``loop.steps + 1`` (the checkpoint after the warm-up, step 0, holds the
version that draws the first batches). Tokens of versions without a checkpoint are counted as unchecked. Needs a
sampler without top-k, top-p or min-p: the logprob is then ``log softmax(logits / temperature)``, or at temperature 1
for RAW logprobs (``rollout.logprob_mode = "raw"``). ``--max-diff X`` exits 1 when a group that should agree (all
three, the third not under ``"keep"``) differs by more than X.

    python -m learner.tools.check_rollout_logprobs RUN [--max-diff 1e-3]
"""

from __future__ import annotations

import argparse
import collections
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from learner.checkpoints.checkpointer import read_step, verify_manifest
from learner.checkpoints.reading import checkpoint_policy
from learner.logprobs.chunked import token_logprobs
from learner.logprobs.sampler_replay import truncates
from learner.reporting.rollout_log import RolloutLogReader

GROUPS = ("one version", "several versions, before a publish", "several versions, after a publish")
CACHED_VERSIONS = 4  # policies kept loaded: a batch holds a few consecutive versions


def checkpoints_by_version(run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
    """``{policy version: checkpoint directory}`` of the run's checkpoints whose manifest verifies."""
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir():
        raise SystemExit(f"{run_dir}: no checkpoints directory")
    versions = {}
    for path in sorted(path for path in checkpoints.iterdir() if path.name.isdigit()):
        if problem := verify_manifest(epath.Path(path)):
            print(f"skipping checkpoint {path.name}: {problem}")
            continue
        versions[read_step(path)[0]["policy_version"]] = path
    return versions


def token_groups(policy_version: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """int ``[B, T]``: each trained token's group (an index of `GROUPS`), -1 for the others. A sample's tokens
    before its first version change are its "before a publish" tokens; versions only grow along a sample.

    >>> token_groups(np.array([[5, 5, 5, 0], [5, 5, 6, 6]]), np.array([[1, 1, 1, 0], [0, 1, 1, 1]]))
    array([[ 0,  0,  0, -1],
           [-1,  1,  2,  2]])
    """
    trained = loss_mask > 0
    first = np.where(trained, policy_version, np.iinfo(np.int32).max).min(axis=1, keepdims=True)
    last = np.where(trained, policy_version, np.iinfo(np.int32).min).max(axis=1, keepdims=True)
    groups = np.where(first == last, 0, np.where(policy_version == first, 1, 2))
    return np.where(trained, groups, -1)


class Policies:
    """The logprobs of a checkpointed version's policy, the last few versions kept loaded."""

    def __init__(self, versions: dict[int, pathlib.Path]):
        self.versions = versions
        self.loaded: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.kept_cache = False  # a loaded version's run decoded on over the old cache (rollout.partial_kv = "keep")

    def logprobs(self, version: int, tokens: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        if version not in self.loaded:
            model, config = checkpoint_policy(self.versions[version])
            rollout = config["rollout"]
            if truncates(rollout["top_k"], rollout["top_p"], rollout["min_p"]):
                raise SystemExit("the check needs a sampler without top-k, top-p or min-p: set rollout.top_k=0, "
                                 "rollout.top_p=1, rollout.min_p=0")
            temperature = 1.0 if rollout["logprob_mode"] == "raw" else rollout["temperature"]
            graphdef, state = nnx.split(model)
            self.loaded[version] = (graphdef, state, temperature)
            self.kept_cache |= rollout["partial_kv"] == "keep"
            if len(self.loaded) > CACHED_VERSIONS:
                self.loaded.popitem(last=False)
        graphdef, state, temperature = self.loaded[version]
        return np.asarray(_logprobs(graphdef, state, tokens, attention_mask, temperature))


@functools.partial(jax.jit, static_argnums=0)
def _logprobs(graphdef, state, tokens, attention_mask, temperature):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return token_logprobs(nnx.merge(graphdef, state), tokens, positions, attention_mask, temperature=temperature)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m learner.tools.check_rollout_logprobs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=pathlib.Path, help="the run directory (rollout_log/ and checkpoints/)")
    parser.add_argument("--max-diff", type=float, help="exit 1 when a group that should agree differs by more")
    args = parser.parse_args(argv)
    if not (args.run_dir / "rollout_log").is_dir():
        raise SystemExit(f"{args.run_dir}: no rollout_log directory (the run logs its batches there)")
    policies = Policies(checkpoints_by_version(args.run_dir))
    differences = {group: [] for group in GROUPS}
    unchecked = batches = 0
    for batch in RolloutLogReader(args.run_dir / "rollout_log").batches():
        batches += 1
        groups = token_groups(batch.policy_version, batch.loss_mask)
        # real tokens: every column up to each row's last trained token (prompt and completion)
        last = np.where(batch.loss_mask > 0, np.arange(batch.tokens.shape[1]), -1).max(axis=1)
        attention_mask = np.arange(batch.tokens.shape[1]) <= last[:, None]
        for version in np.unique(batch.policy_version[groups >= 0]).tolist():
            drawn = (groups >= 0) & (batch.policy_version == version)
            if version not in policies.versions:
                unchecked += int(drawn.sum())
                continue
            difference = np.abs(policies.logprobs(version, batch.tokens, attention_mask) - batch.rollout_logprobs)
            for index, group in enumerate(GROUPS):
                differences[group].append(difference[drawn & (groups == index)])
    print(f"{args.run_dir}: {batches} batches, checkpoints of {len(policies.versions)} versions")
    print(f"{'tokens':>44} {'checked':>8} {'max |diff|':>11} {'mean |diff|':>12}")
    worst = {}
    for group, parts in differences.items():
        values = np.concatenate(parts) if parts else np.zeros(0)
        worst[group] = values.max() if values.size else 0.0
        shown = (f"{values.max():.2e}", f"{values.mean():.2e}") if values.size else ("-", "-")
        print(f"{group:>44} {values.size:>8} {shown[0]:>11} {shown[1]:>12}")
    print(f"{'no checkpoint of their version':>44} {unchecked:>8}")
    if args.max_diff is not None:
        bounded = GROUPS[:2] if policies.kept_cache else GROUPS
        over = [group for group in bounded if worst[group] > args.max_diff]
        if over:
            raise SystemExit(f"differences above --max-diff {args.max_diff}: {', '.join(over)}")


if __name__ == "__main__":
    main()
