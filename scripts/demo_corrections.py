"""Demo: what the corrections do to a batch with a real train/inference mismatch.

Builds a synthetic batch whose rollout logprobs come from a perturbed, bfloat16-rounded copy of the trainer's
distribution (as a bf16 inference server against a float32 learner gives), with a few badly-off sequences, then
prints, per preset, the loss and the main diagnostics.

    python scripts/demo_corrections.py [--batch 64] [--length 256]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import corrections

PRESETS = (
    "disabled",
    "decoupled_token_is",
    "decoupled_seq_is",
    "decoupled_geo_rs",
    "decoupled_geo_rs_token_tis",
    "decoupled_token_icepop",
    "bypass_pg_is",
    "skyrl_outlier_mask",
    "areal_decoupled_ppo",
    "slime_opsm",
)
COLUMNS = (
    ("loss", "actor/pg_loss"),
    ("is_mean", "rollout_corr/rollout_is_mean"),
    ("ess", "rollout_corr/rollout_is_eff_sample_size"),
    ("rejected", "rollout_corr/rollout_rs_masked_fraction"),
    ("clipfrac", "actor/pg_clipfrac"),
)


def mismatched_batch(batch, length, seed=0):
    """Trainer logprobs, proximal logprobs, bf16-rounded rollout logprobs, mask and GRPO advantages."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 4, length + 1, batch)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
    old = np.log(rng.beta(2.0, 0.6, (batch, length)) + 1e-6).astype(np.float32)
    noise = rng.normal(0.0, 0.03, (batch, length))
    noise[: batch // 16] *= 20  # a few sequences are far off-policy
    roll = np.asarray(jnp.asarray(old + noise, jnp.bfloat16).astype(jnp.float32))
    lp = (old + rng.normal(0.0, 0.02, (batch, length))).astype(np.float32)
    rewards = rng.integers(0, 2, batch).astype(np.float32)
    return lp, old, np.minimum(roll, 0.0), mask, corrections.grpo_advantages(rewards, group_size=8)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    lp, old, roll, mask, adv = mismatched_batch(args.batch, args.length)
    first = corrections.compute(lp, adv, mask, corrections.preset("disabled"),
                                proximal_logprobs=old, rollout_logprobs=roll)
    print(f"batch [{args.batch}, {args.length}]: kl {float(first.metrics['rollout_corr/kl']):.4f}, "
          f"chi2_token {float(first.metrics['rollout_corr/chi2_token']):.4f}, "
          f"log_ppl_abs_diff {float(first.metrics['rollout_corr/log_ppl_abs_diff']):.4f}\n")
    print(f"{'preset':<28}" + "".join(f"{name:>10}" for name, _ in COLUMNS))
    for name in PRESETS:
        config = corrections.preset(name)
        run = jax.jit(lambda *a, config=config: corrections.compute(
            a[0], a[1], a[2], config, proximal_logprobs=a[3], rollout_logprobs=a[4]))
        metrics = run(lp, adv, mask, old, roll).metrics
        print(f"{name:<28}" + "".join(f"{float(metrics.get(key, np.nan)):>10.4f}" for _, key in COLUMNS))


if __name__ == "__main__":
    main()
