"""The GSM8K recipe's RL update at the run's full length against its batch's bucket (`Trainer.fit`): seconds per update
on this machine, and the tokens each processes (what estimates the gain on another machine).

The model and data are `scripts.bench.recipe`'s (a random Qwen2 checkpoint of the ``--shape``, GSM8K-shaped prompts
through the recipe's prompt format); the batch holds ``--prompts`` x ``--samples`` rows, each a real prompt of the task
and ``--new-tokens`` random completion tokens (random weights never stop early: every completion is at the limit),
rollout logprobs near a random model's (so that the recipe's rejection keeps the tokens). Each update is timed
after one untimed call of the same shape (its compile), on the same starting state.

    python -m scripts.bench.update_buckets --out runs/bench_buckets --shape 17m --prompts 4 --samples 4 \\
        --new-tokens 64 --set 'model.compute_dtype="float32"'
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from learner.tools.make_gsm8k_tiny import write_inputs
from scripts.bench.common import REPO_ROOT
from scripts.bench.recipe import recipe_command


def host_batch(trainer, task, spec, rows: int, samples: int, new_tokens: int, seed: int = 0):
    """A full-length host batch: ``rows`` real prompts (each ``samples`` times) with random completions."""
    import numpy as np

    rng = np.random.default_rng(seed)
    batch = spec.zeros().batch
    tokens, loss_mask = batch.tokens.copy(), batch.loss_mask.copy()
    lengths = np.zeros(len(tokens), np.int64)
    records = task.prompts()
    for row in range(rows):
        prompt = np.asarray(records[row // samples]["prompt_ids"])
        tokens[row, :len(prompt)] = prompt
        tokens[row, len(prompt):len(prompt) + new_tokens] = rng.integers(1, 1000, new_tokens)
        loss_mask[row, len(prompt):len(prompt) + new_tokens] = 1
        lengths[row] = len(prompt) + new_tokens
    attention = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    uniform = -np.log(trainer.model_config.vocab_size)  # near a random model's logprobs
    advantages = np.where(loss_mask > 0, rng.normal(size=(len(tokens), 1)), 0).astype(np.float32)
    return batch.replace(tokens=tokens, attention_mask=attention, loss_mask=loss_mask, advantages=advantages,
                         positions=np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape),
                         rollout_logprobs=np.where(loss_mask > 0, uniform + rng.normal(0, 0.01, tokens.shape),
                                                   0).astype(np.float32),
                         policy_version=np.full(tokens.shape, trainer.policy_version, np.int32))


def timed_update(trainer, batch, state) -> tuple[float, float]:
    """Seconds and loss of one update from ``state`` (after one untimed call of the same shape)."""
    import jax

    times = []
    for _ in range(2):
        trainer.state = jax.tree.map(lambda x: x.copy(), state)
        started = time.perf_counter()
        metrics, _ = trainer.train(batch)
        times.append(time.perf_counter() - started)
    return times[-1], metrics["actor/pg_loss"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.update_buckets",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="17m", choices=("qwen2-0.5b", "17m"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_buckets"))
    parser.add_argument("--set", action="append", default=[], help="more run overrides (key=value)")
    args = parser.parse_args(argv)

    from learner.rl import load_config
    from learner.rl.batch_assembly import PayloadSpec
    from learner.rl.rollout_engines import sampler_order
    from learner.rl.trainer import Trainer, model_context
    from learner.tasks import load_task

    args.out.mkdir(parents=True, exist_ok=True)
    files = write_inputs(args.out, args.shape, max_seq_len=2048)
    command = recipe_command(files, args.out / "run", args)
    overrides = [value for flag, value in zip(command, command[1:]) if flag == "--set"]
    config = load_config(REPO_ROOT / "configs" / "gsm8k_qwen2.5.toml", overrides)
    task = load_task(config.task.name, config.task.args, model_path=config.model.hf_path,
                     model_context=model_context(config))
    trainer = Trainer(config, task)
    trainer.start_fresh()  # the checkpoint's weights and the KL reference
    spec = PayloadSpec.of_run(config.rollout, trainer.rows, trainer.length, sampler_order(config),
                              scored_window=trainer.update_config.scored_window)
    full = host_batch(trainer, task, spec, args.prompts * args.samples, args.samples, args.new_tokens)
    bucketed = trainer.fit(full)
    state = trainer.state
    full_s, full_loss = timed_update(trainer, full, state)
    bucketed_s, bucketed_loss = timed_update(trainer, bucketed, state)
    longest = int(full.attention_mask.sum(axis=1).max())
    result = {"rows": int(full.tokens.shape[0]), "longest_row": longest, "full_length": int(full.tokens.shape[1]),
              "bucket_length": int(bucketed.tokens.shape[1]), "buckets": trainer.bucket_lengths,
              "full_update_s": round(full_s, 3), "bucketed_update_s": round(bucketed_s, 3),
              "speedup": round(full_s / bucketed_s, 2), "loss_full": full_loss, "loss_bucketed": bucketed_loss}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
