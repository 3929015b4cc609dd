"""``loop.deterministic``: seeded requests (per request, per episode turn), what it asks of the engine, and two real
runs that give the same metrics."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from learner.rl import Run, load_config
from learner.rl.episodes import EpisodeRequest, EpisodeRunner
from learner.rl.prompt_stream import PromptStream
from learner.rl.rollout_engines import reference_server_args, requirements
from rollout_client import EngineCapabilityError, LogprobMode, SamplingParams, TetherEngine, check_capabilities
from rollout_client.sampling_params import derived_seed
from tests.learner.rl.test_episodes import CountingEngine, EchoTask
from tests.learner.rl.test_rollout_engines import MLX_LIKE

RECORDS = [{"prompt_ids": np.asarray([5, 6 + i], np.int32)} for i in range(12)]


def stream_seeds(sampling_seed, state=None, batches=4, batch_size=3):
    """The seeds of the first ``batches`` batches' requests (from ``state``), and the stream."""
    stream = PromptStream(RECORDS, batch_size, seed=1, sampling=SamplingParams(max_new_tokens=4), num_samples=2,
                          logprob_mode=LogprobMode.PROCESSED, sampling_seed=sampling_seed)
    if state is not None:
        stream.set_state(state)
    requests = stream.requests()
    return [next(requests).sampling.seed for _ in range(batches * batch_size)], stream


def test_seeded_requests_differ_from_each_other_and_repeat_after_a_resume():
    seeds, stream = stream_seeds(sampling_seed=7, batches=6)  # 6 batches of 3: two epochs of 12 records
    assert len(set(seeds)) == len(seeds) and all(0 <= seed < 2**63 for seed in seeds)
    assert seeds[:3] == [derived_seed(7, 0, place) for place in range(3)]  # (loop.seed, batch, place in batch)
    resumed, _ = stream_seeds(sampling_seed=7, state=stream.position(2), batches=4)  # as a checkpoint saves it
    assert resumed == seeds[2 * 3:]
    assert stream_seeds(sampling_seed=8)[0][0] != seeds[0]
    assert stream_seeds(sampling_seed=None)[0] == [None] * 12  # unseeded: the client draws one per request


def test_every_turn_of_a_seeded_group_draws_with_its_own_seed():
    engine = CountingEngine()
    with EpisodeRunner(engine, EchoTask(done_after=2)) as episodes:
        for seed in (11, None):
            request = EpisodeRequest({"prompt_ids": np.asarray([10, 20], np.int32)},
                                     sampling=SamplingParams(seed=seed), num_samples=3)
            assert len(episodes.submit(request).result(timeout=60)) == 3
    seeded, unseeded = engine.requests[:6], engine.requests[6:]
    # Each turn is a one-sample request (sample index 0): one shared seed would give the 3 episodes the same draws.
    assert len({request.sampling.seed for request in seeded}) == 6  # 3 episodes x 2 turns
    for request in seeded:
        episode, turn = map(int, request.request_id.rsplit("-", 2)[1:])
        assert request.sampling.seed == derived_seed(11, episode, turn)
    assert {request.sampling.seed for request in unseeded} == {None}


def test_deterministic_runs_need_an_engine_that_honours_seeds_and_ask_the_embedded_server_for_batch_invariance():
    config = load_config(None, ["loop.deterministic=true"])
    with pytest.raises(EngineCapabilityError, match=r"- loop.deterministic=true: .* does not honour one"):
        check_capabilities("mlx", MLX_LIKE, requirements(config))
    check_capabilities("tether", TetherEngine.capabilities, requirements(config))
    trainer = type("Trainer", (), {"length": 64})
    assert "--batch-invariant" in reference_server_args(config, trainer, (2,))
    assert "--batch-invariant" not in reference_server_args(load_config(None), trainer, (2,))


def test_evaluation_requests_are_seeded_per_step_prompt_and_mode_when_deterministic(tmp_path):
    from learner.rl import EvalHook
    from learner.tasks import load_task
    from tests.learner.rl.test_hooks import _AnsweringEngine, _run

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"q": f"{a}+1=", "a": str(a + 1)}) + "\n"
                                                  for a in range(4)))
    task = load_task("dataset", {"path": str(tmp_path / "train.jsonl"), "prompt_column": "q", "answer_column": "a",
                                 "tokenizer": "char", "rewards": ["exact_match"], "max_completion_tokens": 2,
                                 "validation": {"path": str(tmp_path / "train.jsonl"), "every": 1}})
    seeds = {}
    for deterministic in (True, False):
        engine = _AnsweringEngine(task.tokenizer, lambda prompt, request: ["1"] * request.num_samples)
        config = load_config(None, ["loop.steps=2", "loop.seed=3", f"loop.deterministic={str(deterministic).lower()}"])
        run = dataclasses.replace(_run(tmp_path, steps=2), config=config, task=task, engine=engine, max_new_tokens=2)
        hook = EvalHook()
        hook.on_start(run)
        hook.evaluate(run, 2)
        seeds[deterministic] = [request.sampling.seed for request in engine.requests]
    # 4 prompts x (sampled, greedy): (loop.seed, step, prompt, mode), a stream apart from training's (batch, place)
    assert seeds[True] == [derived_seed(3, 2, index, mode) for mode in (0, 1) for index in range(4)]
    assert seeds[False] == [None] * 8


# Timings (perf/*, the start-up's phases), compiles (how many programs came from the shared persistent cache, and
# how long the rest took) and the client's retries (a Generate that missed its deadline on a busy machine, resent
# with the same seed) record the machine, not the training: every other metric must be equal.
MACHINE_METRICS = ("perf/", "startup/", "compile/", "server/compiled_programs", "generate/retries")


@pytest.mark.slow  # two whole runs (warm-up, compiles, engine process): 85 s at load ~4, 518 s at ~17
def test_two_deterministic_runs_give_the_same_metrics_one_of_them_on_a_busy_cpu(tmp_path):
    """Exact equality is right here: the same program, on the same machine, with the same inputs."""
    runs = []
    for name, busy in (("quiet", False), ("busy", True)):
        config = load_config("configs/tool_calculator.toml", [
            "warmup.steps=4", "warmup.batch_size=16", "rollout.prompts_per_step=2", "rollout.num_samples=4",
            "server.max_batch_size=16", "update.fast_compile=true", "loop.steps=3", "optimizer.warmup_steps=0",
            "loop.deterministic=true", f"run_dir={json.dumps(str(tmp_path / name))}"])
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            with Run(config, hooks=[]) as run:
                runs.append([record.metrics for record in run.steps()])
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    quiet, busy = ([{k: v for k, v in m.items() if not k.startswith(MACHINE_METRICS)} for m in rows] for rows in runs)
    assert len(quiet) == 3 and quiet[0]["multiturn/turns_mean"] >= 1
    assert quiet == busy
