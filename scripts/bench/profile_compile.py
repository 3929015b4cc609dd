"""Where the learner update's cold first call goes: trace, lower, XLA compile and first run, timed separately.

Builds the update exactly as ``scripts/bench/peers.py``'s Tether worker does (`learner.update.make_update_fn`,
AdamW
+ clip + non-finite guard, B x T tokens of which the last half are trained) and times, in a fresh process per
measurement with JAX's persistent compilation cache off:

* ``trace``: ``update.trace(state, batch, None)`` (Python tracing to a jaxpr),
* ``lower``: ``traced.lower()`` (jaxpr -> StableHLO),
* ``compile``: ``lowered.compile()`` (XLA),
* ``run``: the compiled program's first call,
* ``call``: in another fresh process, the plain first call ``jitted(state, batch, None)`` (what scripts.bench.peers
  times), with the number of programs JAX compiles during it (``jax_log_compiles``).

and counts the jaxpr equations (nested ones included), the StableHLO text size and op count, and the ops of the
optimised HLO. Variants attribute the cost to the corrections:

* ``full``: the update as it is;
* ``row_stats``: `corrections.compute` as it is, but the row statistics leave the program instead of the metrics
  combined from them;
* ``no_metrics``: `corrections.compute` as it is, but no metric leaves the program (XLA removes the statistics;
  tracing them remains);
* ``trivial``: `corrections.compute` replaced by a token-mean policy gradient (no weights, no statistics).

``--revs`` compares the corrections package at several git revisions (``worktree`` is the working tree's): each
revision's ``corrections/`` is extracted into a temporary directory that goes first on the worker's ``PYTHONPATH``.
Measurements alternate over revisions, variants and repeats, so load from other processes hits all alike; the
table gives medians.

    python -m scripts.bench.profile_compile --cases tiny:16:128 100m:4:128 --presets bypass_ppo_clip decoupled_token_is
    python -m scripts.bench.profile_compile --cases tiny:16:128 --revs HEAD~1 worktree --variants full --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

from scripts.bench.common import REPO_ROOT, checkout_env, write_json

PHASES = ("trace", "lower", "compile", "run")


# --------------------------------------------------------------------------------------------------------------------
# Worker: one measurement in a fresh process.

def _trivial_corrections(corrections):
    """A stand-in for the ``corrections`` module as `learner.update.step` uses it: a token-mean policy gradient, no
    weights, no row statistics, no metrics."""
    import types

    import jax
    import jax.extend
    import jax.numpy as jnp

    def compute(logprobs, advantages, mask, config, **unused):
        del config, unused
        mask = mask.astype(jnp.float32)
        numerator = -jnp.sum(advantages * logprobs * mask)
        denominator = jax.lax.stop_gradient(jnp.sum(mask))
        return corrections.Corrected(None, mask, None, numerator / jnp.maximum(denominator, 1.0), numerator,
                                     denominator, {}, {}, jnp.float32(1.0))

    return types.SimpleNamespace(compute=compute, metrics_from_row_stats=lambda row_stats, config: {},
                                 CorrectionConfig=corrections.CorrectionConfig)


def _no_metrics_corrections(corrections):
    """``corrections`` as it is, but with no metric leaving the update (the statistics are traced, then dead)."""
    import types

    return types.SimpleNamespace(compute=corrections.compute, metrics_from_row_stats=lambda row_stats, config: {},
                                 CorrectionConfig=corrections.CorrectionConfig)


def _row_stats_corrections(corrections):
    """``corrections`` as it is, but the update returns the row statistics instead of the metrics combined from
    them (the per-sequence reductions stay, the batch combination goes)."""
    import types

    return types.SimpleNamespace(compute=corrections.compute,
                                 metrics_from_row_stats=lambda row_stats, config: row_stats,
                                 CorrectionConfig=corrections.CorrectionConfig)


def _count_eqns(jaxpr) -> int:
    """Equations of a (closed) jaxpr, those of nested jaxprs (scan, cond, pjit, custom_vjp bodies) included."""
    import jax
    import jax.extend

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    total += _count_eqns(sub)
    return total


def _hlo_counts(text: str, pattern: str) -> int:
    return len(re.findall(pattern, text, flags=re.MULTILINE))


@contextlib.contextmanager
def timed(out: dict, name: str):
    """Stores the wall seconds of the block as ``out[name]`` and the process's CPU seconds (every thread) as
    ``out[name + "_cpu"]``: on a machine shared with other sessions, CPU seconds vary less than wall ones."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    out[name], out[name + "_cpu"] = time.perf_counter() - wall, time.process_time() - cpu


def worker(spec: dict) -> dict:
    import logging

    import jax
    import jax.extend
    import numpy as np

    import corrections
    import learner.update.step
    from learner.model.sharding import make_mesh
    from learner.model.transformer import model_config
    from learner.update.batch import TrainBatch
    from learner.update.optimizer import OptimizerConfig, make_optimizer
    from learner.update.step import UpdateConfig, make_update_fn
    from learner.update.train_state import create_sharded_train_state

    if spec["variant"] == "trivial":
        learner.update.step.corrections = _trivial_corrections(corrections)
    elif spec["variant"] == "no_metrics":
        learner.update.step.corrections = _no_metrics_corrections(corrections)
    elif spec["variant"] == "row_stats":
        learner.update.step.corrections = _row_stats_corrections(corrections)
    config = model_config(spec["model"])
    rows, length = spec["rows"], spec["length"]
    mesh = make_mesh(data=-1)
    optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=1e-5, total_steps=1000, max_grad_norm=1.0))
    update_config = UpdateConfig(corrections=corrections.preset(spec["preset"]))
    graphdef, state, shardings = create_sharded_train_state(config, optimizer, mesh)
    update = make_update_fn(graphdef, optimizer, update_config, mesh, shardings)
    rng = np.random.default_rng(0)
    shape = (rows, length)
    trained = np.arange(length) >= length - length // 2
    loss_mask = np.broadcast_to(trained, shape).astype(np.float32)
    rollout = np.where(trained, -rng.uniform(5, 12, shape), 0.0).astype(np.float32)
    batch = TrainBatch(tokens=rng.integers(1, config.vocab_size, shape).astype(np.int32),
                       positions=np.broadcast_to(np.arange(length, dtype=np.int32), shape),
                       attention_mask=np.ones(shape, bool), loss_mask=loss_mask,
                       advantages=np.broadcast_to(rng.normal(size=rows)[:, None], shape).astype(np.float32),
                       rollout_logprobs=rollout, policy_version=np.zeros(shape, np.int32))
    batch = jax.device_put(batch)
    jax.block_until_ready((state, batch))
    out = {"corrections_file": corrections.__file__}

    if spec["mode"] == "call":
        compiled_programs = []

        class Count(logging.Handler):
            def emit(self, record):
                message = record.getMessage()
                if "Finished XLA compilation of" in message:
                    compiled_programs.append(message.split("Finished XLA compilation of ")[1].split(" in ")[0])

        handler = Count()
        logging.getLogger("jax").addHandler(handler)
        jax.config.update("jax_log_compiles", True)
        with timed(out, "call"):
            jax.block_until_ready(update(state, batch, None))
        out["programs"] = compiled_programs
        return out

    with timed(out, "trace"):
        traced = update.trace(state, batch, None)
    with timed(out, "lower"):
        lowered = traced.lower()
    with timed(out, "compile"):
        compiled = lowered.compile()
    with timed(out, "run"):
        jax.block_until_ready(compiled(state, batch, None, None))
    text = lowered.as_text()
    optimized = compiled.as_text()
    out.update(jaxpr_eqns=_count_eqns(traced.jaxpr), stablehlo_kb=len(text) / 1024,
               stablehlo_ops=_hlo_counts(text, r"^\s*(?:%\S+(?:, %\S+)* = )?\"?(?:stablehlo|chlo|sdy)\."),
               hlo_ops=_hlo_counts(optimized, r"^\s*(?:ROOT )?%\S+ = "),
               fusions=_hlo_counts(optimized, r" fusion\("))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Parent: revisions, alternation, table.

@contextlib.contextmanager
def revision_paths(revs: list[str]):
    """``{rev: directory to put first on PYTHONPATH}``; ``worktree`` is the working tree itself."""
    with tempfile.TemporaryDirectory(prefix="profile-compile-") as tmp:
        paths = {}
        for rev in revs:
            if rev == "worktree":
                paths[rev] = str(REPO_ROOT)
                continue
            target = pathlib.Path(tmp) / re.sub(r"\W", "_", rev)
            target.mkdir()
            archive = subprocess.run(["git", "archive", rev, "corrections"], cwd=REPO_ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
            paths[rev] = str(target)
        yield paths


def run_worker(spec: dict, path: str) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX_COMPILATION_CACHE")}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    # -P: the working directory (the checkout) does not go first on the path, so the revision's copy does
    done = subprocess.run([sys.executable, "-P", "-m", "scripts.bench.profile_compile", "--worker", json.dumps(spec)],
                          env=checkout_env(path, env=env), cwd=REPO_ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
    if done.returncode or not lines:
        raise RuntimeError(f"worker {spec} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(lines[-1][2:])
    if path != str(REPO_ROOT) and not result["corrections_file"].startswith(path):
        raise RuntimeError(f"worker imported {result['corrections_file']}, not the revision's copy under {path}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.profile_compile",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["tiny:16:128", "100m:4:128"], help="model:rows:length")
    parser.add_argument("--presets", nargs="+", default=["bypass_ppo_clip", "decoupled_token_is"])
    parser.add_argument("--variants", nargs="+", default=["full", "no_metrics", "trivial"],
                        choices=["full", "row_stats", "no_metrics", "trivial"])
    parser.add_argument("--revs", nargs="+", default=["worktree"], help="git revisions of corrections/")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-call", action="store_true", help="skip the plain first-call measurement")
    parser.add_argument("--json", type=pathlib.Path, help="write every measurement here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("@@" + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    modes = ["phases"] + ([] if args.no_call else ["call"])
    results = []
    with revision_paths(args.revs) as paths:
        for case, preset in itertools.product(args.cases, args.presets):
            model, rows, length = case.split(":")
            combos = [(rev, variant) for variant in args.variants for rev in args.revs
                      if variant == "full" or rev == args.revs[-1]]  # corrections-free variants: one revision
            for repeat in range(args.repeats):
                order = combos if repeat % 2 == 0 else combos[::-1]
                for (rev, variant), mode in itertools.product(order, modes):
                    spec = dict(model=model, rows=int(rows), length=int(length), preset=preset, variant=variant,
                                mode=mode)
                    result = dict(spec, rev=rev, repeat=repeat, **run_worker(spec, paths[rev]))
                    results.append(result)
                    print(json.dumps(result), file=sys.stderr, flush=True)
    write_json(args.json, results)
    print_table(results)


def print_table(results: list[dict]) -> None:
    """Medians per (case, preset, revision, variant): wall seconds, CPU seconds in parentheses, then counts."""
    def key(r):
        return r["model"], r["rows"], r["length"], r["preset"], r["rev"], r["variant"]

    timed_columns = [*PHASES, "sum", "call"]
    count_columns = ["programs", "jaxpr_eqns", "stablehlo_kb", "stablehlo_ops", "hlo_ops", "fusions"]
    print("| case | preset | corrections rev | variant | " + " | ".join(timed_columns + count_columns) + " |")
    print("|---" * (4 + len(timed_columns) + len(count_columns)) + "|")
    for group in sorted({key(r) for r in results}, key=lambda k: [str(x) for x in k]):
        mine = [r for r in results if key(r) == group]
        phases = [r for r in mine if r["mode"] == "phases"]
        calls = [r for r in mine if r["mode"] == "call"]
        cells = []
        for column in timed_columns:
            source = calls if column == "call" else phases
            names = PHASES if column == "sum" else (column,)
            wall = [sum(r[n] for n in names) for r in source]
            cpu = [sum(r[n + "_cpu"] for n in names) for r in source]
            cells.append(f"{statistics.median(wall):.2f} ({statistics.median(cpu):.2f})" if source else "-")
        for column in count_columns:
            values = [len(r["programs"]) for r in calls] if column == "programs" else [r[column] for r in phases]
            cells.append(f"{statistics.median(values):.0f}" if values else "-")
        model, rows, length, preset, rev, variant = group
        print(f"| {model} {rows}x{length} | {preset} | {rev} | {variant} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
