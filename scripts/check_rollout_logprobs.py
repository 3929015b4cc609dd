"""Checks each logged token's rollout logprob against the policy version that drew it, from the run's checkpoints.

A token's rollout logprob is what the server reported when it sampled it; its ``policy_version`` names the weights
it claims to have used. For every version that has a checkpoint in RUN/checkpoints, this recomputes the logprobs of
that version's tokens in RUN/rollout_log under that checkpoint's parameters and prints the largest and mean absolute
difference, in three groups:

- tokens of samples drawn by one version;
- tokens of samples drawn by several versions (partial rollouts), drawn before the sample's first publish;
- the same samples' tokens drawn after a publish: under ``rollout.partial_kv = "recompute"`` they should agree as the
  first two groups do (the prefix's keys and values rebuilt under the new weights); under ``"keep"`` the difference
  measures the approximation of decoding on over the old weights' cache.

Check a whole run by keeping a checkpoint of every version: ``--set checkpoints.every=1 --set
checkpoints.keep_last=N`` with N at least ``loop.steps``. Tokens of versions without a checkpoint are counted as
unchecked. Needs a sampler without top-k, top-p or min-p (the logprob is then ``log softmax(logits / temperature)``).

    python scripts/check_rollout_logprobs.py RUN
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from learner.checkpoints.checkpointer import read_step  # noqa: E402
from learner.export import read_checkpoint_params  # noqa: E402
from learner.logprobs.chunked import token_logprobs  # noqa: E402
from learner.model.param_paths import update_named  # noqa: E402
from learner.model.transformer import Transformer, model_config  # noqa: E402
from learner.reporting.rollout_log import RolloutLogReader  # noqa: E402

GROUPS = ("one version", "several versions, before a publish", "several versions, after a publish")


def checkpoints_by_version(run_dir: pathlib.Path) -> tuple[dict[int, pathlib.Path], dict]:
    """``{policy version: checkpoint directory}`` of the run, and the run's config (from its newest checkpoint)."""
    step_dirs = sorted((path for path in (run_dir / "checkpoints").glob("*") if path.name.isdigit()),
                       key=lambda path: int(path.name))
    if not step_dirs:
        raise SystemExit(f"{run_dir}: no checkpoints/<step> directory")
    metadata = {path: read_step(path)[0] for path in step_dirs}
    return {meta["policy_version"]: path for path, meta in metadata.items()}, metadata[step_dirs[-1]]["config"]


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=pathlib.Path, help="the run directory (rollout_log/ and checkpoints/)")
    args = parser.parse_args(argv)
    versions, config = checkpoints_by_version(args.run_dir)
    rollout = config["rollout"]
    if rollout["top_k"] or rollout["top_p"] < 1 or rollout["min_p"]:
        raise SystemExit("the check needs a sampler without top-k, top-p or min-p: set rollout.top_k=0, "
                         "rollout.top_p=1, rollout.min_p=0")
    if config["model"].get("hf_path") or (config["model"].get("lora") or {}).get("rank", 0):
        raise SystemExit("the check reads a named model's full parameters (model.name): not model.hf_path or LoRA")
    model = Transformer(model_config(config["model"]["name"]), rngs=nnx.Rngs(0))
    graphdef = nnx.graphdef(model)

    @jax.jit
    def logprobs(state, tokens, attention_mask):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return token_logprobs(nnx.merge(graphdef, state), tokens, positions, attention_mask,
                              temperature=rollout["temperature"])

    differences = {group: [] for group in GROUPS}
    unchecked = 0
    batches = list(RolloutLogReader(args.run_dir / "rollout_log").batches())
    by_version: dict[int, list] = {}
    for batch in batches:
        groups = token_groups(batch.policy_version, batch.loss_mask)
        for version in np.unique(batch.policy_version[groups >= 0]):
            by_version.setdefault(int(version), []).append((batch, groups))
    for version, entries in sorted(by_version.items()):
        if version not in versions:
            unchecked += sum(int(np.sum((groups >= 0) & (batch.policy_version == version)))
                             for batch, groups in entries)
            continue
        update_named(model, read_checkpoint_params(versions[version]))
        state = nnx.state(model)
        for batch, groups in entries:
            # real tokens: every column up to each row's last trained token (prompt and completion)
            last = np.where(batch.loss_mask > 0, np.arange(batch.tokens.shape[1]), -1).max(axis=1)
            attention_mask = np.arange(batch.tokens.shape[1]) <= last[:, None]
            recomputed = np.asarray(logprobs(state, batch.tokens, attention_mask))
            difference = np.abs(recomputed - batch.rollout_logprobs)
            for index, group in enumerate(GROUPS):
                differences[group].append(difference[(groups == index) & (batch.policy_version == version)])
    print(f"{args.run_dir}: {len(batches)} batches, checkpoints of {len(versions)} versions")
    print(f"{'tokens':>44} {'checked':>8} {'max |diff|':>11} {'mean |diff|':>12}")
    for group, parts in differences.items():
        values = np.concatenate(parts) if parts else np.zeros(0)
        worst, mean = (f"{values.max():.2e}", f"{values.mean():.2e}") if values.size else ("-", "-")
        print(f"{group:>44} {values.size:>8} {worst:>11} {mean:>12}")
    print(f"{'no checkpoint of their version':>44} {unchecked:>8}")


if __name__ == "__main__":
    main()
