"""Multi-turn episodes (`learner.rl.episodes`): token-exact turns, masks, per-token versions, limits, environment
errors, interleaving; the batch they make; and the same over the wire against a real rollout.v1 server process."""

import asyncio
import concurrent.futures
import dataclasses
import threading
import time

import numpy as np
import pytest

from learner.rl.batch_assembly import PayloadSpec, assemble_payload
from learner.rl.episodes import EpisodeRequest, EpisodeRunner, episode_metrics
from learner.tasks import EnvironmentTask, EpisodeLimits, StepResult, load_task
from rollout_client import (
    ClientConfig,
    Engine,
    LogprobMode,
    RolloutBuffer,
    Sample,
    SamplingParams,
    TetherEngine,
    collate,
)
from rollout_client.sampling_params import FinishReason
from tests.rollout_client.conftest import SCRIPTED, start_server  # noqa: F401 - the fixture

EOS = 1


@dataclasses.dataclass(frozen=True)
class Tokens:
    """A tokenizer stub: ids only (the episodes never encode text here)."""

    vocab_size: int = 1000
    pad_id: int = 0
    eos_ids: tuple = (EOS,)

    def encode(self, text):
        return np.asarray([ord(c) for c in text], np.int32)

    def decode(self, ids):
        return "".join(map(chr, ids))


class Echo:
    """Observation ``[900 + turn] * (turn + 1)`` after each turn; done after ``done_after`` turns (reward = turns)."""

    def __init__(self, task):
        self.task, self.turn = task, 0

    def reset(self, record):
        return record["prompt_ids"]

    def step(self, generated):
        self.turn += 1
        self.task.seen.append(generated.tolist())
        if self.task.fail_at == self.turn:
            raise RuntimeError("tool crashed")
        if self.task.sleep_s:
            time.sleep(self.task.sleep_s)
        return StepResult(observation=[900 + self.turn] * (self.turn + 1), reward=1.0,
                          done=self.turn >= self.task.done_after, info={"tool_call": True})


class AsyncEcho(Echo):
    async def step(self, generated):
        await asyncio.sleep(self.task.sleep_s)
        return StepResult(observation=[7], reward=1.0, done=True)


class EchoTask:
    name = "echo"
    tokenizer = Tokens()
    max_prompt_tokens = 4

    def __init__(self, done_after=3, fail_at=None, sleep_s=0.0, environment=Echo, budget=64, **limits):
        self.done_after, self.fail_at, self.sleep_s, self._environment = done_after, fail_at, sleep_s, environment
        self.max_completion_tokens = budget
        self.limits = EpisodeLimits(**{"max_turns": 8, "max_turn_tokens": 3, "step_timeout_s": 5.0, **limits})
        self.seen = []

    def prompts(self):
        return [{"prompt_ids": np.asarray([10 + i, 20 + i], np.int32)} for i in range(8)]

    def environment(self):
        return self._environment(self)


class CountingEngine(Engine):
    """In-process engine: completion ``[100 + k, 101 + k, 102 + k]`` for the k-th request, logprob ``-(k + 1)``,
    stamped with its current version; records every request. ``delay_s`` makes requests overlap; with
    ``hold_until=n`` no request is answered before n have arrived (or 60 s passed)."""

    name = "counting"
    capabilities = None

    def __init__(self, delay_s=0.0, hold_until=0):
        self.requests, self.version, self.delay_s, self.hold_until = [], 0, delay_s, hold_until
        self.arrived = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(32)
        self.lock = threading.Lock()

    def info(self):
        raise NotImplementedError

    def submit(self, request):
        with self.lock:
            k = len(self.requests)
            self.requests.append(request)
            version = self.version
            if len(self.requests) >= self.hold_until:
                self.arrived.set()

        def run():
            self.arrived.wait(timeout=60)
            time.sleep(self.delay_s)
            n = min(3, request.sampling.max_new_tokens)
            ids = np.arange(100 + k, 100 + k + n, dtype=np.int32)
            return [Sample(request_id=request.request_id, sample_index=0, prompt_token_ids=request.prompt_token_ids,
                           completion_token_ids=ids, logprobs=np.full(n, -(k + 1.0), np.float32),
                           policy_versions=np.full(n, version, np.int64), finish_reason=FinishReason.LENGTH,
                           sampling=request.sampling, logprob_mode=request.logprob_mode)]

        return self.pool.submit(run)

    def publish(self, policy_version, weights):
        self.version = policy_version
        return policy_version

    def close(self):
        self.pool.shutdown()


def run_group(task, engine=None, num_samples=1):
    engine = engine or CountingEngine()
    episodes = EpisodeRunner(engine, task)
    request = EpisodeRequest(task.prompts()[0], SamplingParams(temperature=1.0), num_samples=num_samples)
    return episodes.submit(request).result(timeout=60), episodes, engine


def test_each_turn_continues_from_exactly_the_previous_ids_and_only_policy_tokens_are_masked_in():
    task = EchoTask(done_after=3)
    (episode,), episodes, engine = run_group(task)
    prompt = [10, 20]
    expected_ids, expected_mask = [], []
    for k, request in enumerate(engine.requests):
        np.testing.assert_array_equal(request.prompt_token_ids, prompt + expected_ids)  # the history, untouched
        generated = list(range(100 + k, 103 + k))
        assert task.seen[k] == generated
        expected_ids += generated
        expected_mask += [1] * 3
        if k < 2:  # the last observation (done) is dropped
            expected_ids += [901 + k] * (k + 2)
            expected_mask += [0] * (k + 2)
    assert len(engine.requests) == 3 and episode.turns == 3 and episode.reward == 3.0
    np.testing.assert_array_equal(episode.prompt_token_ids, prompt)
    np.testing.assert_array_equal(episode.completion_token_ids, expected_ids)
    np.testing.assert_array_equal(episode.completion_mask, expected_mask)
    policy = episode.completion_mask == 1
    np.testing.assert_array_equal(episode.logprobs[policy], np.repeat([-1.0, -2.0, -3.0], 3))
    assert (episode.logprobs[~policy] == 0).all()
    assert all(r.sampling.stop_token_ids == (EOS,) and r.sampling.max_new_tokens == 3 for r in engine.requests)
    assert episode_metrics([episode]) == {"multiturn/turns_mean": 3.0, "multiturn/tool_calls_mean": 3.0,
                                          "multiturn/tool_errors": 0.0, "multiturn/env_tokens_fraction": 5 / 14}


def test_a_publish_between_turns_stamps_version_v_on_turn_one_and_v_plus_one_on_turn_two():
    engine = CountingEngine()

    class Publishing(Echo):
        def step(self, generated):
            if self.turn == 0:
                engine.publish(engine.version + 1, {})
            return super().step(generated)

    task = EchoTask(done_after=2, environment=Publishing)
    engine.publish(5, {})
    (episode,), *_ = run_group(task, engine)
    policy = episode.completion_mask == 1
    assert episode.policy_versions[policy].tolist() == [5, 5, 5, 6, 6, 6]
    assert episode.policy_versions[~policy].tolist() == [5, 5]  # an observation carries its turn's version
    assert episode.oldest_version == 5
    batch = collate([episode], pad_to_multiple=16)
    assert batch.policy_versions[0, :16].tolist() == [-1, -1, 5, 5, 5, -1, -1, 6, 6, 6] + [-1] * 6
    assert batch.loss_mask[0, :10].tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("limits, ended_by, turns, metric", [
    ({"max_turns": 2}, "max_turns", 2, "multiturn/ended_by/max_turns"),
    ({"max_observation_tokens": 2}, "done", 3, "multiturn/observations_cut"),
    ({"budget": 8}, "max_tokens", 2, "multiturn/ended_by/max_tokens"),
])
def test_limits_end_or_cut_episodes_and_are_counted(limits, ended_by, turns, metric):
    (episode,), episodes, engine = run_group(EchoTask(done_after=3, **limits))
    assert (episode.ended_by, episode.turns) == (ended_by, turns)
    assert episodes.metrics()[metric] >= 1
    assert episode.completion_token_ids.size <= episodes.task.max_completion_tokens
    if "max_observation_tokens" in limits:
        assert (episode.completion_mask == 0).sum() == 4  # two observations of 2 and 3 tokens, cut to 2 each
    if "budget" in limits:  # 3 + 2 + 3 = 8: the second observation does not fit with a policy token after it
        assert episode.completion_token_ids.size == 8
        assert [r.sampling.max_new_tokens for r in engine.requests] == [3, 3]


def test_the_turn_budget_shrinks_to_what_the_episode_has_left():
    (episode,), _, engine = run_group(EchoTask(done_after=3, budget=7, max_observation_tokens=0))
    assert [r.sampling.max_new_tokens for r in engine.requests] == [3, 3, 1]
    assert episode.completion_token_ids.size == 7


def test_a_stop_string_cuts_the_turn_after_the_token_completing_it_and_the_episode_continues_from_there():
    task = EchoTask(done_after=2, stop_strings=("de",))
    task.tokenizer = Tokens()  # decode: chr of each id, so the first turn's 100, 101, 102 is "def"
    (episode,), episodes, engine = run_group(task)
    assert task.seen == [[100, 101], [101, 102, 103]]  # "de" | "efg": the second turn has no stop string
    np.testing.assert_array_equal(engine.requests[1].prompt_token_ids, [10, 20, 100, 101, 901, 901])
    np.testing.assert_array_equal(episode.completion_token_ids, [100, 101, 901, 901, 101, 102, 103])
    np.testing.assert_array_equal(episode.logprobs, [-1, -1, 0, 0, -2, -2, -2])
    assert episodes.metrics()["multiturn/stop_string_cuts"] == 1


def test_stop_ids_of_the_task_end_every_turn_besides_eos():
    _, _, engine = run_group(EchoTask(done_after=1, stop_ids=(61, EOS)))
    assert engine.requests[0].sampling.stop_token_ids == (EOS, 61)


@pytest.mark.parametrize("task", [EchoTask(fail_at=2), EchoTask(sleep_s=3.0, step_timeout_s=0.2),
                                  EchoTask(sleep_s=3.0, step_timeout_s=0.2, environment=AsyncEcho)],
                         ids=["raises", "sync_timeout", "async_timeout"])
def test_an_environment_error_ends_its_episode_with_a_nan_reward_and_is_counted(task):
    episodes, episode_runner, _ = run_group(task, num_samples=2)
    assert len(episodes) == 2 and all(np.isnan(e.reward) and e.ended_by == "env_error" for e in episodes)
    assert episode_runner.metrics()["multiturn/env_errors"] == 2
    assert "tool crashed" in episode_runner.last_environment_error or "step_timeout_s" in (
        episode_runner.last_environment_error)


def test_an_async_environment_steps_within_its_timeout():
    (episode,), *_ = run_group(EchoTask(sleep_s=0.01, environment=AsyncEcho))
    assert episode.reward == 1.0 and episode.turns == 1


def test_a_failed_reset_gives_an_episode_without_policy_tokens_that_the_buffer_and_batch_leave_out():
    class BadReset(Echo):
        def reset(self, record):
            raise KeyError("no such record")

    task = EchoTask(environment=BadReset)
    engine = CountingEngine()
    episode_runner = EpisodeRunner(engine, task)
    episode_runner.publish(3, {})
    buffer = RolloutBuffer(episode_runner, iter([EpisodeRequest(task.prompts()[i], SamplingParams(), num_samples=2)
                                                 for i in range(2)]), max_in_flight=2, max_staleness=0)
    groups = [buffer.get(3), buffer.get(3)]
    assert [len(g) for g in groups] == [2, 2] and engine.requests == []
    assert all(np.isnan(e.reward) for g in groups for e in g)
    with pytest.raises(RuntimeError, match="no group of this rollout batch had 2 scored samples"):
        assemble_payload(groups, [{}, {}], task, PayloadSpec(rows=4, length=16, sampling=False, raw=False), 2,
                         "processed")


def test_turns_of_many_episodes_interleave_on_the_engine():
    # No first turn is answered before all 16 have arrived (a loaded machine cannot reorder them); episodes run one
    # after another would wait out the 60 s hold and alternate turns.
    engine = CountingEngine(hold_until=16)
    task = EchoTask(done_after=2)
    episode_runner = EpisodeRunner(engine, task)
    futures = [episode_runner.submit(EpisodeRequest(task.prompts()[i], SamplingParams(), num_samples=4))
               for i in range(4)]
    groups = [f.result(timeout=120) for f in futures]
    assert [len(g) for g in groups] == [4] * 4
    turn_of = [int(r.request_id.rsplit("-", 1)[1]) for r in engine.requests]
    # Sequential episodes would alternate 0, 1, 0, 1, ...; in flight together, the first turns all come first.
    assert turn_of[:16] == [0] * 16 and turn_of[16:] == [1] * 16
    # GRPO groups per first prompt: every episode of a group started from its record's prompt.
    for i, group in enumerate(groups):
        assert all(e.prompt_token_ids.tolist() == [10 + i, 20 + i] for e in group)


def test_episodes_make_a_fixed_shape_payload_with_env_tokens_masked_and_the_environments_rewards():
    task = EchoTask(done_after=2)
    engine = CountingEngine()
    episode_runner = EpisodeRunner(engine, task)
    groups = [episode_runner.submit(EpisodeRequest(task.prompts()[i], SamplingParams(temperature=1.0),
                                                   num_samples=2)).result(60) for i in range(2)]
    spec = PayloadSpec(rows=6, length=32, sampling=False, raw=False)
    payload, _ = assemble_payload(groups, task.prompts()[:2], task, spec, 2, "processed")
    batch = payload.batch
    assert batch.tokens.shape == (6, 32) and int(payload.real_rows) == 4
    np.testing.assert_array_equal(payload.rewards[:4], 2.0)
    for row, episode in enumerate(e for g in groups for e in g):
        mask = np.zeros(32)
        mask[2:2 + episode.completion_mask.size] = episode.completion_mask
        np.testing.assert_array_equal(batch.loss_mask[row], mask)
        assert (batch.advantages[row][mask == 0] == 0).all() and (batch.rollout_logprobs[row][mask == 0] == 0).all()
        collated = np.arange(32) < 2 + episode.completion_mask.size  # the bucket padding after it is the pad's
        assert (batch.policy_version[row][(mask == 0) & collated] == -1).all()
    assert (batch.loss_mask[4:] == 0).all()


def test_an_environment_task_missing_a_member_is_refused_naming_it():
    with pytest.raises(ValueError, match="is not an EnvironmentTask: it lacks limits"):
        load_task("tests.learner.rl.test_episodes:NoLimitsTask")


class NoLimitsTask:  # an environment task without its limits (the test above)
    name, tokenizer, max_prompt_tokens, max_completion_tokens = "no_limits", Tokens(), 4, 8

    def prompts(self):
        return []

    def environment(self):
        return Echo(self)


def test_the_calculator_is_an_environment_task_and_its_episode_scores_the_copied_result():
    task = load_task("tool_calculator", {"num_prompts": 4})
    assert isinstance(task, EnvironmentTask)
    tok, record = task.tokenizer, task.prompts()[1]
    env = task.environment()
    first = env.reset(record)
    question = tok.decode(first[1:-1])
    a, b = map(int, question.split("*"))
    call = env.step(tok.encode(question + "="))
    assert call.info == {"tool_call": True, "tool_error": False} and not call.done
    assert tok.decode(call.observation[:-1]) == str(a * b) and call.observation[-1] == tok.sep_id
    assert env.step(np.append(tok.encode(str(a * b)), tok.eos_id)) == StepResult(reward=1.0, done=True)
    assert env.step(np.append(tok.encode(str(a * b + 1)), tok.eos_id)).reward == 0.0
    bad = env.step(tok.encode("1**2="))
    assert bad.info["tool_error"] and tok.decode(bad.observation[:-1]) == "?"
    ids, mask = task.noisy_demonstration(first, np.random.default_rng(0), noise=0.0)
    assert tok.decode(ids[mask == 1][:-1]) == f"{question}={a * b}" and ids[-1] == tok.eos_id


# --- Over the wire: a real rollout.v1 server process (the scripted engine: tokens from a fixed stream) ----------


@pytest.fixture
def tether(start_server, tmp_path):  # noqa: F811 - the imported fixture
    server = start_server(*SCRIPTED, "--step-delay-s", "0.001", "--weights-dir", str(tmp_path))
    engine = TetherEngine(ClientConfig(target=server.target, ready_timeout_s=30))
    yield engine
    engine.close()


class Recording(Engine):
    """Passes requests through to ``engine`` and records each request with the samples it returned."""

    name, capabilities = "recording", None

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def info(self):
        return self.engine.info()

    def submit(self, request):  # synchronous: the call is recorded before the episode sees its samples
        samples = self.engine.submit(request).result(timeout=120)
        self.calls.append((request, samples))
        future = concurrent.futures.Future()
        future.set_result(samples)
        return future

    def publish(self, policy_version, weights):
        return self.engine.publish(policy_version, weights)

    def close(self):
        pass


def test_over_the_wire_the_trained_ids_are_the_ids_the_server_was_given_and_returned_and_versions_follow_publishes(
        tether):
    recording = Recording(tether)

    class PublishOnce(Echo):
        def step(self, generated):
            if self.turn == 0 and self.task.published.acquire(blocking=False):
                recording.publish(1, {"logprob_scale": np.asarray(2.0, np.float32)})
            return super().step(generated)

    # A stop string that never matches: sent on the wire (rollout.v1 stop_strings), which Tether's server ignores.
    task = EchoTask(done_after=3, environment=PublishOnce, max_turn_tokens=5, stop_strings=("</never>",))
    task.published = threading.Semaphore(1)
    episode_runner = EpisodeRunner(recording, task)
    request = EpisodeRequest(task.prompts()[0], SamplingParams(stop_token_ids=()), num_samples=1,
                             logprob_mode=LogprobMode.PROCESSED)
    (episode,) = episode_runner.submit(request).result(timeout=60)
    calls = sorted(recording.calls, key=lambda call: len(call[0].prompt_token_ids))
    assert len(calls) == 3 and all(sent.sampling.to_proto().stop_strings == ["</never>"] for sent, _ in calls)
    trained = np.concatenate([episode.prompt_token_ids, episode.completion_token_ids])
    policy = np.concatenate([np.zeros(episode.prompt_token_ids.size), episode.completion_mask]) == 1
    position = 0
    for k, (sent, (returned,)) in enumerate(calls):
        given = np.asarray(sent.prompt_token_ids)
        np.testing.assert_array_equal(trained[:given.size], given)  # what the server was given, byte for byte
        returned_ids = returned.completion_token_ids
        np.testing.assert_array_equal(trained[given.size:given.size + returned_ids.size], returned_ids)
        assert policy[given.size:given.size + returned_ids.size].all()
        np.testing.assert_array_equal(episode.logprobs[given.size - 2:given.size - 2 + returned_ids.size],
                                      returned.logprobs)
        assert set(returned.policy_versions.tolist()) == {0 if k == 0 else 1}  # the publish fell between turns
        position = given.size + returned_ids.size
    assert position == trained.size - 0 and policy.sum() == 15
    assert episode.policy_versions[episode.completion_mask == 1].tolist() == [0] * 5 + [1] * 10


def test_the_rollout_log_keeps_episode_masks_and_per_token_versions_and_recompute_diagnostics_reads_episodes(
        tmp_path):
    from learner.reporting.rollout_log import LoggedBatch, RolloutLogReader, RolloutLogWriter
    from learner.tools.recompute_diagnostics import episode_statistics, recompute

    engine = CountingEngine()

    class PublishAfterFirstTurn(Echo):
        def step(self, generated):
            if self.turn == 0 and self.task.publish_once.acquire(blocking=False):
                engine.publish(engine.version + 1, {})
            return super().step(generated)

    task = EchoTask(done_after=3, environment=PublishAfterFirstTurn)
    task.publish_once = threading.Semaphore(1)
    episodes = EpisodeRunner(engine, task).submit(EpisodeRequest(task.prompts()[0], SamplingParams(temperature=1.0),
                                                                 num_samples=2)).result(60)
    spec = PayloadSpec(rows=2, length=32, sampling=False, raw=False)
    batch = assemble_payload([episodes], task.prompts()[:1], task, spec, 2, "processed")[0].batch
    logged = LoggedBatch(step=1, tokens=batch.tokens, loss_mask=batch.loss_mask,
                         rollout_logprobs=batch.rollout_logprobs, proximal_logprobs=batch.rollout_logprobs,
                         rewards=np.full(2, 3.0, np.float32), advantages=batch.advantages,
                         policy_version=batch.policy_version)
    with RolloutLogWriter(tmp_path / "rollout_log", max_length=32) as writer:
        writer.append(logged)
    (read,) = RolloutLogReader(tmp_path / "rollout_log").batches()
    np.testing.assert_array_equal(read.loss_mask, batch.loss_mask)
    np.testing.assert_array_equal(read.policy_version, batch.policy_version)
    (record,) = recompute(tmp_path)
    expected = episode_metrics(episodes)
    assert record["multiturn/turns_mean"] == expected["multiturn/turns_mean"] == 3
    assert record["multiturn/env_tokens_fraction"] == pytest.approx(expected["multiturn/env_tokens_fraction"])
    assert record["multiturn/versions_per_episode_max"] == 2  # the publish fell between turns of an episode
    assert episode_statistics(dataclasses.replace(read, loss_mask=(read.loss_mask.cumsum(1) > 0) * 1.0)) == {}


def docs_environment_source() -> str:
    """The Python block under docs/multiturn.md's "A 30-line environment"."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "multiturn.md").read_text()
    (source,) = re.findall(r"## A 30-line environment.*?```python\n(.*?)```", text, re.S)
    return source


def Guess(**args):  # the docs' task as an import path, for load_task
    namespace = {}
    exec(compile(docs_environment_source(), "docs/multiturn.md", "exec"), namespace)
    return namespace["Guess"](**args)


def test_the_30_line_environment_of_docs_multiturn_runs():
    assert len([line for line in docs_environment_source().splitlines() if line.strip()]) <= 32
    task = load_task("tests.learner.rl.test_episodes:Guess", {"num_prompts": 3})
    assert isinstance(task, EnvironmentTask)
    env, record = task.environment(), task.prompts()[0]
    tok = task.tokenizer
    np.testing.assert_array_equal(env.reset(record), [tok.bos_id, tok.sep_id])
    low = env.step(tok.encode(f"{record['secret'] + 1};"))
    assert low.observation == "<" and low.reward == -0.1 and not low.done
    assert env.step(tok.encode(f"{record['secret']};")) == StepResult(reward=1.0, done=True)


@pytest.mark.slow  # a whole run (compiles, warm-up, engine process): ~1-2.5 min on 2 loaded cores
def test_a_short_calculator_run_trains_on_episodes_and_logs_their_masks_and_metrics(tmp_path):
    import json

    from learner.reporting.rollout_log import RolloutLogReader
    from learner.rl import Run, load_config

    config = load_config("configs/tool_calculator.toml", [
        "warmup.steps=2", "warmup.batch_size=8", "rollout.prompts_per_step=2", "rollout.num_samples=2",
        "server.max_batch_size=8", "update.fast_compile=true", "loop.steps=2", "update.num_minibatches=1",
        "update.ppo_epochs=1", "optimizer.warmup_steps=0", f"run_dir={json.dumps(str(tmp_path))}"])
    with Run(config) as run:
        records = list(run.steps())
    assert [r.step for r in records] == [1, 2]
    for record in records:
        metrics = record.metrics
        assert 1 <= metrics["multiturn/turns_mean"] <= 3 and metrics["multiturn/env_errors"] == 0
        assert 0 <= metrics["multiturn/env_tokens_fraction"] < 1
        assert record.batch.tokens.shape == records[0].batch.tokens.shape  # one shape, one compile
    logged = list(RolloutLogReader(tmp_path / "rollout_log").batches())
    assert [b.step for b in logged] == [1, 2]
    for batch, record in zip(logged, records):
        np.testing.assert_array_equal(batch.loss_mask, record.batch.loss_mask[:record.samples])
        trained = batch.loss_mask == 1
        assert (batch.policy_version[trained] >= 0).all()
    with pytest.raises(ValueError, match="rollout.max_new_tokens=4: task 'tool_calculator' is multi-turn"):
        with Run(load_config("configs/tool_calculator.toml", ["rollout.max_new_tokens=4",
                                                              f"run_dir={json.dumps(str(tmp_path / 'b'))}"])):
            pass


@pytest.fixture(scope="module")
def hf_calculator_files(tmp_path_factory):
    from learner.tools.make_hf_tiny import make_hf_tiny

    return make_hf_tiny(tmp_path_factory.mktemp("hf_calc") / "files", tool_calculator=True)


def test_the_chat_calculator_renders_tool_messages_with_the_checkpoints_template(hf_calculator_files):
    task = load_task("tool_calculator", {"num_prompts": 2, "chat": True}, model_path=str(hf_calculator_files.model))
    tok, record = task.tokenizer, task.prompts()[0]
    env = task.environment()
    question = tok.decode(env.reset(record)).split("\n")[1].removesuffix("<|im_end|>")
    assert tok.decode(record["prompt_ids"]) == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    call = env.step(tok.encode(question + "="))
    assert call.observation == [{"role": "tool", "content": record["answer"]}] and task.limits.stop_ids == (
        tok.encode("=")[0],)
    ids, mask = task.noisy_demonstration(record["prompt_ids"], np.random.default_rng(0), noise=0.0)
    assert tok.decode(ids) == (f"{question}=<|im_end|>\n<|im_start|>tool\n{record['answer']}<|im_end|>\n"
                               f"<|im_start|>assistant\n{record['answer']}<|im_end|>")
    assert tok.decode(ids[mask == 1]) == f"{question}={record['answer']}<|im_end|>"
    assert env.step(ids[mask == 1][-(len(record["answer"]) + 1):]) == StepResult(reward=1.0, done=True)
    full = len(record["prompt_ids"]) + len(ids)
    assert full <= task.max_prompt_tokens + task.max_completion_tokens
    with pytest.raises(ValueError, match="task.args: chat = true"):
        load_task("tool_calculator", {"chat": True})


@pytest.mark.slow  # a whole run against the MLX engine (warm-up compile, engine restarts): minutes on 2 cores
def test_the_chat_calculator_runs_against_the_mlx_engine(hf_calculator_files, tmp_path):
    import json

    from learner.rl import Run, load_config

    config = load_config("configs/tool_calculator_hf.toml", [
        f"model.hf_path={json.dumps(str(hf_calculator_files.model))}", "warmup.steps=20", "warmup.batch_size=16",
        "rollout.prompts_per_step=2", "rollout.num_samples=2", "update.fast_compile=true", "loop.steps=2",
        "update.num_minibatches=1", "update.ppo_epochs=1", f"run_dir={json.dumps(str(tmp_path))}"])
    with Run(config) as run:
        records = list(run.steps())
    assert [r.step for r in records] == [1, 2] and all(r.metrics["multiturn/env_errors"] == 0 for r in records)
    assert all(r.metrics["multiturn/turns_mean"] >= 1 for r in records)
