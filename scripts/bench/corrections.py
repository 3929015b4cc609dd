"""Benchmark: the full correction pipeline on CPU, against the machine's copy bandwidth and a NumPy version.

Pipeline: token TIS (C=2) + geometric sequence mask [0.999, 1.001] + PPO with dual clip + token-mean +
every diagnostic (34 metrics; the NumPy version computes the same ones). Reports, for each shape: time per
call (median), effective bandwidth (bytes of inputs read and outputs written / time), its ratio to a
large-array copy bandwidth measured in the same run, the speed-up over a plain NumPy implementation of the
same pipeline, and, for scale, the same call with its metrics dropped (the per-token outputs alone) against
the same byte count.

    python -m scripts.bench.corrections [--shapes 256x4096 1024x1024] [--repeats 20]
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import corrections

CONFIG = corrections.CorrectionConfig(
    objective=corrections.Objective("ppo", dual_clip=3.0),
    importance=corrections.ImportanceWeights("token", high=2.0),
    rejection=(corrections.RejectionRule("geometric", 0.999, 1.001),),
)


def median_seconds(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(repeats, nbytes=512 * 2**20):
    """Bytes read + written per second by a large array copy (NumPy, and XLA: the better of the two)."""
    src = np.random.default_rng(0).random(nbytes // 8)
    dst = np.empty_like(src)
    numpy_seconds = median_seconds(lambda: np.copyto(dst, src), repeats)
    x = jnp.asarray(src.astype(np.float32))
    xla_copy = jax.jit(lambda a: a * 1.0000001)
    xla_seconds = median_seconds(lambda: xla_copy(x).block_until_ready(), repeats)
    return max(2 * src.nbytes / numpy_seconds, 2 * x.nbytes / xla_seconds)


def numpy_pipeline(lp, old, roll, mask, adv):
    """The same pipeline in plain NumPy (float32, vectorised): the same outputs and the same 34 metrics."""
    valid = mask > 0
    n = max(mask.sum(), 1)
    count_row = mask.sum(-1)
    rows = count_row > 0
    n_rows = max(rows.sum(), 1)
    lr = np.clip(np.where(valid, old - roll, 0), -20, 20)
    geo = np.exp(np.clip((lr * mask).sum(-1) / np.maximum(count_row, 1), -20, 20))
    rule_keep = ((geo >= 0.999) & (geo <= 1.001)) | ~rows
    keep = valid & rule_keep[:, None]
    rho = np.exp(lr)
    weights = np.where(valid, np.minimum(rho, 2.0), 0)
    log_ratio = np.clip(np.where(valid, lp - old, 0), -20, 20)
    ratio = np.exp(log_ratio)
    a = adv[:, None]
    unclipped, clipped = -a * ratio, -a * np.clip(ratio, 0.8, 1.2)
    loss = np.maximum(unclipped, clipped)
    lower = -3 * a
    clipped_lower = (loss > lower) & (a < 0)
    loss = np.where(a < 0, np.minimum(loss, lower), loss)
    per_token = np.where(keep, loss * weights, 0)
    kept = max(keep.sum(), 1)
    old_v, roll_v = np.where(valid, old, 0), np.where(valid, roll, 0)
    mt = old_v.sum(-1) / np.maximum(count_row, 1)
    mr = roll_v.sum(-1) / np.maximum(count_row, 1)
    diff = (mr - mt)[rows]
    abs_diff = np.abs(old_v - roll_v)
    old_c, roll_c = old_v - old_v.sum() / n, roll_v - roll_v.sum() / n
    w_mean = weights.sum() / n
    rejected = valid & ~keep
    metrics = {
        "loss": per_token.sum() / n,
        "kl": (roll_v - old_v).sum() / n,
        "k3_kl": (np.expm1(lr) - lr).sum() / n,
        "training_ppl": np.exp(-mt[rows]).mean(),
        "training_log_ppl": -mt[rows].mean(),
        "rollout_ppl": np.exp(-mr[rows]).mean(),
        "rollout_log_ppl": -mr[rows].mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": np.abs(diff).mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": np.exp(diff).mean(),
        "chi2_token": (rho**2 * mask).sum() / n - 1,
        "chi2_seq": np.exp(2 * np.clip(lr.sum(-1), -20, 20))[rows].mean() - 1,
        "abs_diff_mean": abs_diff.sum() / n,
        "abs_diff_max": abs_diff.max(),
        "pearson": (old_c * roll_c * mask).sum() / np.sqrt((old_c**2 * mask).sum() * (roll_c**2 * mask).sum()),
        "is_mean": w_mean,
        "is_std": np.sqrt((((weights - w_mean) ** 2) * mask).sum() / n),
        "is_max": weights[valid].max(),
        "is_min": weights[valid].min(),
        "is_fraction_high": ((rho > 2.0) & valid).sum() / n,
        "is_fraction_low": ((rho < 0.5) & valid).sum() / n,
        "ess": w_mean**2 / ((weights**2).sum() / n),
        "rule_masked_fraction": rejected.sum() / n,
        "rule_seq_masked_fraction": (~rule_keep & rows).sum() / n_rows,
        "rs_masked_fraction": rejected.sum() / n,
        "rs_seq_masked_fraction": (rejected.any(-1) & rows).sum() / n_rows,
        "clipfrac": ((clipped > unclipped) & keep).sum() / kept,
        "clipfrac_lower": (clipped_lower & keep).sum() / kept,
        "ppo_kl": (-log_ratio * keep).sum() / kept,
        "valid_tokens": mask.sum(),
        "kept_tokens": keep.sum(),
        "all_rejected": float(keep.sum() == 0 and mask.sum() > 0),
    }
    return weights, keep.astype(np.float32), per_token, metrics


def inputs(batch, length, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, batch)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
    old = rng.uniform(-4, -0.01, (batch, length)).astype(np.float32)
    roll = (old + rng.normal(0, 0.02, (batch, length))).astype(np.float32)
    lp = (old + rng.normal(0, 0.05, (batch, length))).astype(np.float32)
    adv = rng.normal(size=batch).astype(np.float32)
    return lp, old, roll, mask, adv


def main():
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.corrections",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["256x4096", "1024x1024"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    def correct(lp, old, roll, mask, adv, rows_per_chunk=None):
        return corrections.compute(lp, adv, mask, CONFIG, proximal_logprobs=old, rollout_logprobs=roll,
                                   rows_per_chunk=rows_per_chunk)

    pipeline = jax.jit(correct)
    # The same call returning only the [B, T] outputs: XLA drops every metric, leaving the per-token work and the
    # geometric mask's row mean. One vmap (no row loop): its faster form without metrics.
    outputs_only = jax.jit(lambda *arrays: correct(*arrays, rows_per_chunk=0)[:3])

    bandwidth = copy_bandwidth(args.repeats)
    print(f"devices: {jax.devices()}; cpu count: {os.cpu_count()}")
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.2f} GB/s")
    header = (f"{'shape':>10} {'jax ms':>8} {'GB/s':>7} {'copy/jax':>9} {'numpy ms':>9} {'numpy/jax':>10} "
              f"{'metrics':>8} {'outputs-only ms':>16} {'copy/outputs-only':>18}")
    print(header)
    for shape in args.shapes:
        batch, length = map(int, shape.split("x"))
        host = inputs(batch, length)
        device = [jnp.asarray(a) for a in host]
        out = pipeline(*device)
        jax_seconds = median_seconds(lambda: jax.block_until_ready(pipeline(*device)), args.repeats)  # noqa: B023
        outputs_seconds = median_seconds(lambda: jax.block_until_ready(outputs_only(*device)), args.repeats)  # noqa: B023
        numpy_seconds = median_seconds(lambda: numpy_pipeline(*host), max(3, args.repeats // 4))  # noqa: B023
        weights, mask, per_token, ref = numpy_pipeline(*host)
        np.testing.assert_allclose(np.asarray(out.weights), weights, rtol=1e-5, atol=1e-6)
        for ours, theirs in (("actor/pg_loss", "loss"), ("rollout_corr/chi2_token", "chi2_token"),
                             ("rollout_corr/logprob_pearson_corr", "pearson"), ("rollout_corr/rollout_is_std",
                                                                                "is_std"),
                             ("rollout_corr/rollout_rs_masked_fraction", "rs_masked_fraction")):
            np.testing.assert_allclose(float(out.metrics[ours]), ref[theirs], rtol=1e-3, atol=1e-6, err_msg=ours)
        assert len(ref) == len(out.metrics), (len(ref), len(out.metrics))
        moved = sum(a.nbytes for a in host) + 3 * batch * length * 4 + 4 * len(out.metrics)
        achieved = moved / jax_seconds
        print(
            f"{shape:>10} {jax_seconds * 1e3:8.2f} {achieved / 1e9:7.2f} {bandwidth / achieved:9.2f} "
            f"{numpy_seconds * 1e3:9.2f} {numpy_seconds / jax_seconds:10.2f} {len(out.metrics):8d} "
            f"{outputs_seconds * 1e3:16.2f} {bandwidth * outputs_seconds / moved:18.2f}"
        )


if __name__ == "__main__":
    main()
