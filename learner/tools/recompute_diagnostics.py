"""Recomputes the off-policy corrections' diagnostics, offline, for every batch of a run's rollout log.

Reads RUN/rollout_log and computes, per logged batch, ``corrections.mismatch_metrics`` of the logged proximal
(learner) against rollout (server) logprobs; with ``--preset``, also the metrics of ``corrections.compute`` under
that preset, with the logged proximal logprobs as both current and proximal (the state before the update), so the
importance weights and rejections are those the update saw first. A batch of multi-turn episodes (rows whose
trained tokens have observations, mask 0, between them: `learner.rl.episodes`) also gets its episode statistics
(`episode_statistics`): policy turns per episode, the observations' share of the tokens, and how many policy
versions sampled one episode. Every batch gets its partial-rollout statistics (`version_statistics`: the share of
samples drawn by several policy versions, the most versions in one, and each trained token's staleness, mean and
max). Prints a table; ``--jsonl`` writes all metrics.

    python -m learner.tools.recompute_diagnostics RUN [--preset decoupled_geo_rs_token_tis] [--jsonl out.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import jax
import numpy as np

import corrections
from learner.reporting.metrics_writers import JsonlWriter, host_scalars
from learner.reporting.rollout_log import LoggedBatch, RolloutLogReader
from learner.reporting.version_stats import version_metrics, versions_per_row

COLUMNS = (
    ("kl", "rollout_corr/kl"),
    ("k3_kl", "rollout_corr/k3_kl"),
    ("chi2_tok", "rollout_corr/chi2_token"),
    ("chi2_seq", "rollout_corr/chi2_seq"),
    ("lp_diff", "rollout_corr/logprob_abs_diff_mean"),
    ("rejected", "rollout_corr/rollout_rs_masked_fraction"),
    ("is_mean", "rollout_corr/rollout_is_mean"),
    ("partial", "rollout/partial_fraction"),
    ("versions", "rollout/versions_per_sample_max"),
    ("stale", "rollout_corr/staleness_mean"),
    ("turns", "multiturn/turns_mean"),
    ("env_frac", "multiturn/env_tokens_fraction"),
)


@functools.partial(jax.jit, static_argnames="preset")
def _diagnostics(proximal, rollout, mask, advantages, preset: str | None) -> dict:
    metrics = {}
    if preset is not None:
        metrics.update(corrections.compute(
            proximal, advantages, mask, corrections.preset(preset),
            proximal_logprobs=proximal, rollout_logprobs=rollout,
        ).metrics)
    metrics.update(corrections.mismatch_metrics(proximal, rollout, mask))
    return metrics


def batch_diagnostics(batch: LoggedBatch, length: int, preset: str | None = None) -> dict[str, float]:
    """The mismatch metrics of one logged batch, plus those of ``preset``'s corrections when given.

    The per-token arrays are right-padded to ``length`` (mask 0), so that batches of every T share one compiled
    program; masked columns do not change the metrics.
    """
    padding = [(0, 0), (0, length - batch.tokens.shape[1])]
    arrays = (batch.proximal_logprobs, batch.rollout_logprobs, batch.loss_mask, batch.advantages)
    return host_scalars(_diagnostics(*(np.pad(a, padding) for a in arrays), preset=preset))


def episode_statistics(batch: LoggedBatch) -> dict[str, float]:
    """Episode statistics of a batch of multi-turn episodes; empty for single-turn rows (no observation inside).

    Per row, the episode's completion runs from its first trained token to its last; its turns are the runs of
    trained tokens, its observations the untrained tokens between them (the run's ``multiturn/turns_mean`` and
    ``multiturn/env_tokens_fraction``). ``multiturn/versions_per_episode_max``: the most policy versions that
    sampled one episode's tokens (above 1 when a publish fell between its turns).
    """
    mask = np.asarray(batch.loss_mask) != 0
    rows = np.flatnonzero(mask.any(axis=1))
    turns, env_tokens, completion = [], 0, 0
    for row in rows:
        trained = np.flatnonzero(mask[row])
        span = mask[row, trained[0]:trained[-1] + 1]
        turns.append(int(span[0]) + int(np.sum(span[1:] & ~span[:-1])))
        env_tokens += int((~span).sum())
        completion += span.size
    if not env_tokens:
        return {}
    return {"multiturn/turns_mean": float(np.mean(turns)), "multiturn/env_tokens_fraction": env_tokens / completion,
            "multiturn/versions_per_episode_max": float(versions_per_row(batch.policy_version, mask).max())}


def version_statistics(batch: LoggedBatch) -> dict[str, float]:
    """A batch's partial-rollout statistics (`learner.reporting.version_stats.version_metrics`) and its trained tokens'
    staleness, learner version - token version (``rollout_corr/staleness_mean`` and ``_max``, the update's own keys;
    left out for rows logged without the learner version)."""
    metrics = version_metrics(batch.policy_version, batch.loss_mask)
    if batch.learner_version is None or np.any(np.asarray(batch.learner_version) < 0):
        return metrics
    lag = np.asarray(batch.learner_version)[:, None] - np.asarray(batch.policy_version)
    return metrics | host_scalars(corrections.staleness_metrics(lag.astype(np.float32), batch.loss_mask))


def recompute(run_dir: str | pathlib.Path, preset: str | None = None) -> list[dict[str, float]]:
    """``{"step": step, **metrics}`` for every batch of ``run_dir``'s rollout log, in log order."""
    reader = RolloutLogReader(pathlib.Path(run_dir) / "rollout_log")
    return [{"step": batch.step, **batch_diagnostics(batch, reader.max_length, preset), **episode_statistics(batch),
             **version_statistics(batch)} for batch in reader.batches()]


def format_table(records: list[dict[str, float]]) -> str:
    """A fixed-width table of the main diagnostics, one row per step."""
    columns = [(name, key) for name, key in COLUMNS if any(key in r for r in records)]
    lines = [f"{'step':>8}" + "".join(f"{name:>11}" for name, _ in columns)]
    for r in records:
        lines.append(f"{int(r['step']):>8}" + "".join(f"{r.get(key, float('nan')):>11.4g}" for _, key in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m learner.tools.recompute_diagnostics", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=pathlib.Path, help="run directory holding rollout_log/")
    parser.add_argument("--preset", choices=sorted(corrections.PRESETS), metavar="NAME",
                        help="also run this preset's corrections (one of corrections.PRESETS)")
    parser.add_argument("--jsonl", type=pathlib.Path, help="write every metric of every step here (overwritten)")
    args = parser.parse_args(argv)
    records = recompute(args.run_dir, args.preset)
    print(format_table(records))
    if args.jsonl:
        args.jsonl.unlink(missing_ok=True)
        writer = JsonlWriter(args.jsonl)
        for record in records:
            writer.write(int(record["step"]), {k: v for k, v in record.items() if k != "step"})
        writer.close()


if __name__ == "__main__":
    main()
