"""Benchmark: the same RL update through Tether and through google-tunix's own GRPO loss and train step, alternated.

Each framework runs in its own worker process: Tether in this interpreter's environment, tunix in a virtual
environment the script creates under ``--cache-dir`` (``google-tunix`` pinned to ``TUNIX_VERSION`` with the same jax
and flax as Tether). Both build a model of the same shape (tunix's Llama3 for a model without q/k/v bias, its Qwen2
for one with; the parameter counts are checked equal), the same optimizer (global-norm clip 1.0, then AdamW on a
warmup + cosine schedule) and the same batch (``B`` rows of ``T`` tokens: a prompt half and a trained completion
half). One timed call is one whole update of the batch:

* Tether: one `learner.update.make_update_fn` call (the non-finite guard included).
  With recompute: corrections preset ``decoupled_token_is`` (PPO dual-clip 3.0 against proximal logprobs recomputed
  inside the call, token TIS capped at 2). Without: ``bypass_ppo_clip`` (the rollout logprobs are the proximal ones).
  Its logprob passes score the completion only (``UpdateConfig.scored_window`` = the completion's length, as an RL
  run's ``update.scored_window = "auto"``); ``--scored-window off`` scores every token, as tunix does.
* tunix: ``tunix.rl.common.compute_per_token_logps`` (the old-policy pass, plus the TIS weights) when recomputing,
  then ``PeftTrainer``'s jitted train step (``nnx.value_and_grad`` of ``tunix.rl.algo_core.grpo_loss_fn`` with
  ``loss_agg_mode="token-mean"``, ``epsilon_c=3.0``, ``beta=0``; global norm; ``nnx.Optimizer.update``) once per
  mini-batch and epoch. Without recompute the rollout logprobs are passed as ``old_per_token_logps``.

Both workers build and compile (the first call) one after the other, then the parent alternates them, ``--calls``
updates per turn, which side goes first swapping every round, so that load from other processes on a shared machine
hits both alike; the table gives the median seconds per update, tokens per second and the ratio. First calls (trace,
compile and run, JAX's persistent compilation cache off in both) are timed the same way, once everything a worker's
build dispatched (parameter and optimizer init, the batch) has finished: the first one and ``--compiles`` more after
`jax.clear_caches`, alternated; the median. "Warm" is Tether's first call in a new process
whose persistent cache (on by default in ``python -m learner.train``) an earlier process filled. With
``--cost-analysis`` each worker also compiles its programs through ``lower().compile()`` and reports XLA's FLOP and
byte counts (summed over the programs of one update).

    python -m scripts.bench.peers [--cases tiny:16:128 100m:4:128] [--recompute on off] [--rounds 5] [--calls 2]
    python -m scripts.bench.peers --cases 100m:4:128 --recompute on --epochs 2 --minibatches 2   # default RL update
    python -m scripts.bench.peers --cases 100m:4:128 --scored-window off   # Tether's logprobs at every token

The module imports nothing beyond the standard library and `scripts.bench.common` (standard library alone) at the
top: the tunix worker runs this same module in the tunix environment, which has no Tether.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from scripts.bench.common import REPO_ROOT, checkout_env, write_json

TUNIX_VERSION = "0.1.7"
PINS = ("jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8")  # Tether's (pyproject.toml)
LEARNING_RATE = 1e-5
TOTAL_STEPS = 1000
MAX_GRAD_NORM = 1.0
PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked update: model config name, rows B, tokens T, recompute on/off, epochs x mini-batches."""

    model: str
    rows: int
    length: int
    recompute: bool
    epochs: int = 1
    minibatches: int = 1
    scored_window: bool = True  # Tether's logprobs over the completion only (tunix computes every position)
    dtype: str = "float32"  # compute dtype (parameters stay float32)
    # Tether's kernel choices (issue 38's studies; the tunix worker ignores them): ModelConfig.attention and .remat,
    # make_update_fn's donate, UpdateConfig.logprob_chunk_size and .fuse_proximal.
    attention: str = "auto"
    remat: str = "none"
    donate: str = "state"
    logprob_chunk_size: int = 512
    fuse_proximal: bool = True

    @property
    def label(self) -> str:
        loop = f", {self.epochs}x{self.minibatches}" if self.epochs * self.minibatches > 1 else ""
        window = "" if self.scored_window else ", Tether window off"
        compute = "" if self.dtype == "float32" else f", {self.dtype} compute"
        knobs = "".join(f", {name} {getattr(self, name)}" for name in KNOB_DEFAULTS
                        if getattr(self, name) != KNOB_DEFAULTS[name])
        return (f"{self.model} {self.rows}x{self.length}{loop}, recompute {'on' if self.recompute else 'off'}{window}"
                f"{compute}{knobs}")


KNOB_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Case)
                 if field.name in ("attention", "remat", "donate", "logprob_chunk_size", "fuse_proximal")}


# --------------------------------------------------------------------------------------------------------------------
# Shared by both workers (NumPy only).

def completion_length(length: int) -> int:
    """Trained tokens per row: the second half."""
    return length // 2


def synthetic_rollouts(vocab_size: int, rows: int, length: int) -> dict:
    """The batch both frameworks train on: token ids in ``[1, V)`` (0 is the pad id), a prompt half and a completion
    half; advantages per row; rollout logprobs on the completion."""
    import numpy as np

    rng = np.random.default_rng(0)
    completion = completion_length(length)
    return dict(tokens=rng.integers(1, vocab_size, (rows, length)).astype(np.int32),
                prompt_len=length - completion,
                advantages=rng.normal(size=rows).astype(np.float32),
                rollout_logprobs=-rng.uniform(5, 12, (rows, completion)).astype(np.float32))


def cost_totals(compiled_programs) -> dict:
    """XLA's FLOPs and bytes accessed, summed over compiled programs."""
    flops = sum(c.cost_analysis().get("flops", 0.0) for c in compiled_programs)
    accessed = sum(c.cost_analysis().get("bytes accessed", 0.0) for c in compiled_programs)
    return {"gflop": flops / 1e9, "gbytes": accessed / 1e9}


def serve(build) -> None:
    """Worker loop: build (``build()`` returns the update, a dict of facts for the ready reply (``params``: the
    parameter count), the cost analysis and the arrays it made, which are waited for), time the first call (the
    ready reply also names the ``device_kind``), then answer lines on stdin: ``time N`` (N calls), ``first`` (one
    call after `jax.clear_caches`: trace and compile again), ``cost``, ``memory`` (the device's peak bytes in use,
    None where the backend does not say), ``peak N`` (TFLOP/s of an N x N bfloat16 matmul, best of 10) and
    ``quit``."""
    import jax

    def timed_calls(count):
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            jax.block_until_ready(run())
            seconds.append(time.perf_counter() - start)
        return seconds

    run, facts, cost, built = build()
    jax.block_until_ready(built)  # parameter and optimizer init is dispatched asynchronously: not the first call's
    _reply({"first_call_s": timed_calls(1)[0], "device_kind": jax.devices()[0].device_kind, **facts})
    for line in sys.stdin:
        command = line.split()
        if command[0] == "time":
            _reply({"seconds": timed_calls(int(command[1]))})
        elif command[0] == "first":
            jax.clear_caches()
            _reply({"seconds": timed_calls(1)})
        elif command[0] == "cost":
            _reply(cost())
        elif command[0] == "memory":
            stats = jax.devices()[0].memory_stats() or {}
            _reply({"peak_bytes": stats.get("peak_bytes_in_use")})
        elif command[0] == "peak":
            _reply({"tflops": matmul_tflops(int(command[1]))})
        else:
            return


def matmul_tflops(size: int, repeats: int = 10) -> float:
    """The device's bfloat16 matmul rate: ``2 size^3`` FLOPs over the best of ``repeats`` timed calls, in TFLOP/s."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(matmul(a, a))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, a))
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e12


def _reply(message: dict) -> None:
    print("@@" + json.dumps(message), flush=True)


# --------------------------------------------------------------------------------------------------------------------
# Tether worker.

def tether_worker(case: Case) -> None:
    import jax
    import numpy as np

    import corrections
    from learner.model.attention import attention_kernel
    from learner.model.sharding import make_mesh
    from learner.model.transformer import count_params, model_config
    from learner.update.batch import TrainBatch
    from learner.update.optimizer import OptimizerConfig, make_optimizer
    from learner.update.step import UpdateConfig, make_update_fn, proximal_from_training_pass
    from learner.update.train_state import create_sharded_train_state

    def build():
        config = model_config(case.model, dtype=case.dtype, attention=case.attention, remat=case.remat)
        mesh = make_mesh(data=-1)
        optimizer = make_optimizer(OptimizerConfig(peak_learning_rate=LEARNING_RATE, total_steps=TOTAL_STEPS,
                                                   max_grad_norm=MAX_GRAD_NORM))
        preset = "decoupled_token_is" if case.recompute else "bypass_ppo_clip"
        update_config = UpdateConfig(corrections=corrections.preset(preset), num_minibatches=case.minibatches,
                                     ppo_epochs=case.epochs,
                                     scored_window=completion_length(case.length) if case.scored_window else None,
                                     logprob_chunk_size=case.logprob_chunk_size, fuse_proximal=case.fuse_proximal)
        graphdef, state, shardings = create_sharded_train_state(config, optimizer, mesh)
        update = make_update_fn(graphdef, optimizer, update_config, mesh, shardings, donate=case.donate)
        data = synthetic_rollouts(config.vocab_size, case.rows, case.length)
        shape = data["tokens"].shape
        trained = np.arange(case.length) >= data["prompt_len"]
        loss_mask = np.broadcast_to(trained, shape).astype(np.float32)
        rollout = np.zeros(shape, np.float32)
        rollout[:, trained] = data["rollout_logprobs"]
        batch = TrainBatch(tokens=data["tokens"], positions=np.broadcast_to(np.arange(case.length, dtype=np.int32),
                                                                            shape),
                           attention_mask=np.ones(shape, bool), loss_mask=loss_mask,
                           advantages=np.broadcast_to(data["advantages"][:, None], shape).astype(np.float32),
                           rollout_logprobs=rollout, policy_version=np.zeros(shape, np.int32))
        host_batch, batch = batch, jax.device_put(batch)
        holder = {"state": state}

        def run():  # a donated batch is put on the device again for each call
            on_device = jax.device_put(host_batch) if "batch" in case.donate else batch
            holder["state"], metrics, proximal = update(holder["state"], on_device, None)
            return holder["state"], metrics, proximal

        def cost():
            return cost_totals([update.lower(holder["state"], batch, None).compile()])

        facts = {"params": count_params(config),
                 "attention": attention_kernel(config.attention, config.dtype, config.head_dim),
                 "proximal_pass": preset == "decoupled_token_is" and not proximal_from_training_pass(update_config)}
        return run, facts, cost, (state, batch)

    serve(build)


# --------------------------------------------------------------------------------------------------------------------
# tunix worker (runs in the tunix environment).

# Tether's named model shapes, as tunix model configs (copied: the tunix environment cannot import Tether).
TUNIX_SHAPES = {
    "tiny": dict(vocab_size=128, embed_dim=64, hidden_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, qkv_bias=True, tied=False),
    "100m": dict(vocab_size=32_000, embed_dim=768, hidden_dim=2048, num_layers=12, num_heads=12, num_kv_heads=4,
                 head_dim=64, qkv_bias=False, tied=True),
    "qwen2-0.5b": dict(vocab_size=151_936, embed_dim=896, hidden_dim=4864, num_layers=24, num_heads=14,
                       num_kv_heads=2, head_dim=64, qkv_bias=True, tied=True, rope_theta=1_000_000, norm_eps=1e-6),
}


def tunix_worker(case: Case) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.rl import algo_core, common
    from tunix.rl.grpo import grpo_learner
    from tunix.sft import peft_trainer

    def make_model():
        shape = dict(TUNIX_SHAPES[case.model])
        qkv_bias, tied = shape.pop("qkv_bias"), shape.pop("tied")
        common_fields = dict(rope_theta=10_000, norm_eps=1e-6) | shape
        if qkv_bias:  # Qwen2 has q/k/v biases, Llama3 none
            from tunix.models.qwen2 import model as qwen2
            return qwen2.Qwen2(qwen2.ModelConfig(use_tied_embedding=tied, dtype=jnp.dtype(case.dtype),
                                                 param_dtype=jnp.float32, **common_fields), rngs=nnx.Rngs(0))
        if case.dtype != "float32":
            raise ValueError(f"{case.model}: tunix's Llama3 config has no compute dtype; use a Qwen2 shape")
        from tunix.models.llama3 import model as llama3
        return llama3.Llama3(llama3.ModelConfig(weight_tying=tied, **common_fields), rngs=nnx.Rngs(0))

    def build():
        model = make_model()
        params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        schedule = optax.warmup_cosine_decay_schedule(0.0, LEARNING_RATE, 0, TOTAL_STEPS)
        optimizer = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM), optax.adamw(schedule))
        algo = grpo_learner.GRPOConfig(num_generations=2, num_iterations=case.epochs, beta=0.0, epsilon=0.2,
                                       loss_agg_mode="token-mean")
        algo.temperature = 1.0  # set by GRPOLearner from the rollout config
        algo.epsilon_c = 3.0  # dual clip, as Tether's preset
        trainer = peft_trainer.PeftTrainer(model, optimizer, peft_trainer.TrainingConfig(eval_every_n_steps=10**9))
        trainer.with_loss_fn(lambda model, train_example, algo_config: algo_core.grpo_loss_fn(
            model, train_example, algo_config=algo, pad_id=PAD_ID, eos_id=-1), has_aux=True)
        trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
        train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)

        data = synthetic_rollouts(TUNIX_SHAPES[case.model]["vocab_size"], case.rows, case.length)
        prompt = jnp.asarray(data["tokens"][:, : data["prompt_len"]])
        completion = jnp.asarray(data["tokens"][:, data["prompt_len"]:])
        completion_mask = jnp.ones(completion.shape, jnp.int32)
        advantages = jnp.asarray(data["advantages"])
        rollout = jnp.asarray(data["rollout_logprobs"])

        @jax.jit
        def tis_weights(old, rollout):
            return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old - rollout), 2.0))

        def old_logprobs():
            graphdef, state = nnx.split(trainer.model)
            return common.compute_per_token_logps(graphdef, state, prompt_tokens=prompt, completion_tokens=completion,
                                                  pad_id=PAD_ID, eos_id=-1, stop_gradient=True,
                                                  return_logits=False, temperature=1.0)

        def examples():
            if case.recompute:
                old = old_logprobs()
                weights = tis_weights(old, rollout)
            else:
                old, weights = rollout, None
            example = grpo_learner.TrainExample(prompt_ids=prompt, prompt_mask=prompt != PAD_ID,
                                                completion_ids=completion, completion_mask=completion_mask,
                                                advantages=advantages, ref_per_token_logps=None,
                                                old_per_token_logps=old, sampler_is_weights=weights)
            # mini-batch i holds rows i, i + n, ... (as Tether splits them), unshuffled
            return [jax.tree.map(lambda x, i=i: x[i:: case.minibatches], example)
                    for i in range(case.minibatches)]

        def run():
            minibatches = examples()  # the old-policy pass runs once per rollout batch, before any update
            outputs = [train_step(minibatch) for _ in range(case.epochs) for minibatch in minibatches]
            return outputs, nnx.state(trainer.model)

        def cost():
            example = examples()[0]
            step = nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",))
            programs = [step.lower(trainer.model, trainer.optimizer, example).compile()]
            if case.recompute:
                graphdef, state = nnx.split(trainer.model)
                programs.append(common.compute_per_token_logps.lower(
                    graphdef, state, prompt_tokens=prompt, completion_tokens=completion, pad_id=PAD_ID, eos_id=-1,
                    stop_gradient=True, return_logits=False, temperature=1.0).compile())
            totals = cost_totals(programs)
            steps = case.epochs * case.minibatches
            train = cost_totals(programs[:1])
            return {"gflop": totals["gflop"] + (steps - 1) * train["gflop"],
                    "gbytes": totals["gbytes"] + (steps - 1) * train["gbytes"]}

        built = (nnx.state(trainer.model), nnx.state(trainer.optimizer), prompt, completion, advantages, rollout)
        return run, {"params": params}, cost, built

    serve(build)


# --------------------------------------------------------------------------------------------------------------------
# Parent: environments, workers, alternation, table.

def tunix_python(cache_dir: pathlib.Path) -> pathlib.Path:
    """The tunix environment's interpreter, creating the environment (pinned, checked) on first use."""
    venv = cache_dir / f"tunix-{TUNIX_VERSION}"
    python = venv / "bin" / "python"
    marker = venv / "tether-bench-ok"
    if not marker.exists():
        print(f"creating {venv} (google-tunix=={TUNIX_VERSION} with {' '.join(PINS)}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"google-tunix=={TUNIX_VERSION}", *PINS],
                       check=True)
        check = ("import importlib.metadata as m, jax, flax, tunix.rl.algo_core; "
                 "print(jax.__version__, flax.__version__, m.version('google-tunix'))")
        found = subprocess.run([str(python), "-c", check], check=True, capture_output=True, text=True).stdout.split()
        wanted = [PINS[0].split("==")[1], PINS[2].split("==")[1], TUNIX_VERSION]
        if found != wanted:
            sys.exit(f"error: {venv} resolved jax, flax, tunix = {found}, not {wanted}; delete it and retry")
        marker.write_text(" ".join(found))
    return python


class Worker:
    """One framework's worker process for one case."""

    def __init__(self, name: str, python: pathlib.Path, case: Case, env: dict):
        self.name = name
        command = [str(python), "-m", "scripts.bench.peers", "--worker", name, "--case",
                   json.dumps(dataclasses.asdict(case))]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                        cwd=REPO_ROOT)
        self.ready = self.read()

    def read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"{self.name} worker exited with status {self.process.wait()} (its stderr is above)")

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait()


def worker_env(cache_dir: pathlib.Path | None = None, memory_fraction: float | None = None) -> dict:
    """The workers' environment: the same threads; JAX's persistent compilation cache in ``cache_dir``, or off
    (first calls compile from scratch); ``memory_fraction``: each worker's share of an accelerator's memory (two
    workers share one GPU)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX_COMPILATION_CACHE")}
    if memory_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory_fraction:g}"
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false" if cache_dir is None else "true"
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    return checkout_env(env=env)


def alternate(workers: dict, command: str, rounds: int) -> dict:
    """``command``'s seconds from every worker, ``rounds`` turns each, the first to go swapping every round."""
    seconds = {name: [] for name in workers}
    for round_index in range(rounds):
        names = list(workers) if round_index % 2 == 0 else list(reversed(workers))
        for name in names:
            seconds[name] += workers[name].ask(command)["seconds"]
    return seconds


def warm_first_call(case: Case, repeats: int = 2) -> float:
    """Tether's first call with a warm persistent compilation cache: one process fills a fresh cache, a second
    process's first call (and calls after `jax.clear_caches`) load from it; the median."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tether-bench-cache-") as cache_dir:
        env = worker_env(pathlib.Path(cache_dir))
        Worker("tether", pathlib.Path(sys.executable), case, env).close()
        worker = Worker("tether", pathlib.Path(sys.executable), case, env)
        try:
            seconds = [worker.ready["first_call_s"]] + [worker.ask("first")["seconds"][0] for _ in range(repeats)]
        finally:
            worker.close()
    return statistics.median(seconds)


def bench_case(case: Case, tunix: pathlib.Path, rounds: int, calls: int, compiles: int, cost: bool) -> dict:
    """Both workers for one case: build and compile one after the other, then alternate timed turns (updates, then
    compiles again after `jax.clear_caches`); then Tether's first call with a warm persistent cache."""
    env = worker_env()
    workers = {}
    try:
        for name, python in (("tether", pathlib.Path(sys.executable)), ("tunix", tunix)):
            workers[name] = Worker(name, python, case, env)
        if workers["tether"].ready["params"] != workers["tunix"].ready["params"]:
            raise RuntimeError(f"parameter counts differ: tether {workers['tether'].ready['params']}, "
                               f"tunix {workers['tunix'].ready['params']}")
        seconds = alternate(workers, f"time {calls}", rounds)
        first_calls = alternate(workers, "first", compiles)
        costs = {name: worker.ask("cost") for name, worker in workers.items()} if cost else {}
    finally:
        for worker in workers.values():
            worker.close()
    tokens = case.rows * case.length
    row = {"case": case.label, "params": workers["tether"].ready["params"]}
    for name in workers:
        first = [workers[name].ready["first_call_s"]] + first_calls[name]
        row[name] = {"first_call_s": statistics.median(first), "first_calls": first,
                     "median_s": statistics.median(seconds[name]),
                     "tokens_per_s": tokens / statistics.median(seconds[name]), "seconds": seconds[name],
                     **costs.get(name, {})}
    row["ratio"] = row["tether"]["tokens_per_s"] / row["tunix"]["tokens_per_s"]
    row["first_call_ratio"] = row["tether"]["first_call_s"] / row["tunix"]["first_call_s"]
    row["tether"]["warm_first_call_s"] = warm_first_call(case)
    return row


def parse_case(text: str, recompute: bool, epochs: int, minibatches: int, scored_window: bool = True) -> Case:
    model, rows, length = text.split(":")
    if model not in TUNIX_SHAPES:
        raise argparse.ArgumentTypeError(f"--cases {text}: model must be one of {sorted(TUNIX_SHAPES)}")
    return Case(model, int(rows), int(length), recompute, epochs, minibatches, scored_window)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["tiny:16:128", "100m:4:128"], help="MODEL:ROWS:TOKENS")
    parser.add_argument("--recompute", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--scored-window", nargs="+", choices=["on", "off"], default=["on"],
                        help="Tether's logprobs over the completion only (on) or every token (off, as tunix)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated turns per framework")
    parser.add_argument("--calls", type=int, default=2, help="timed updates per turn")
    parser.add_argument("--compiles", type=int, default=2, help="alternated first calls after clearing caches")
    parser.add_argument("--cost-analysis", action="store_true", help="also report XLA's FLOPs and bytes")
    parser.add_argument("--cache-dir", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
                        / "tether" / "bench_peers", help="where the tunix environment is created")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    parser.add_argument("--worker", choices=["tether", "tunix"], help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        case = Case(**json.loads(args.case))
        return tether_worker(case) if args.worker == "tether" else tunix_worker(case)
    cases = [parse_case(text, flag == "on", args.epochs, args.minibatches, window == "on")
             for text in args.cases for flag in args.recompute for window in args.scored_window]
    tunix = tunix_python(args.cache_dir)
    print(f"alternated: {args.rounds} rounds x {args.calls} calls per framework, median seconds per update; first "
          f"call (trace + compile + run, no persistent cache): median of {1 + args.compiles}, alternated; warm: "
          "Tether's first call in a new process with its persistent compilation cache filled")
    header = ("case", "params", "Tether tokens/s", "tunix tokens/s", "ratio", "Tether first call s",
              "tunix first call s", "first-call ratio", "Tether warm first call s")
    if args.cost_analysis:
        header += ("Tether GFLOP", "tunix GFLOP", "Tether GB accessed", "tunix GB accessed")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    rows = []
    for case in cases:
        row = bench_case(case, tunix, args.rounds, args.calls, args.compiles, args.cost_analysis)
        rows.append(row)
        t, u = row["tether"], row["tunix"]
        cells = [row["case"], f"{row['params']:,}", f"{t['tokens_per_s']:,.0f}", f"{u['tokens_per_s']:,.0f}",
                 f"**{row['ratio']:.2f}x**", f"{t['first_call_s']:.1f}", f"{u['first_call_s']:.1f}",
                 f"{row['first_call_ratio']:.2f}", f"{t['warm_first_call_s']:.1f}"]
        if args.cost_analysis:
            cells += [f"{t['gflop']:.1f}", f"{u['gflop']:.1f}", f"{t['gbytes']:.2f}", f"{u['gbytes']:.2f}"]
        print("| " + " | ".join(cells) + " |", flush=True)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
