"""Token-exact episodes (`learner.rl.episodes`) on real engines: the ids trained on are byte for byte the ids each
engine was given and returned, with chat-template observations of four families (Llama-3, Qwen2.5, Qwen3,
Mistral) on tiny tokenizers built here.

- MLX (real, on CPU): one engine serves a tiny model whose vocabulary covers the four tokenizers; besides the ids,
  its RAW logprobs of every policy token equal the learner's logprobs of the trained sequence at that position: the
  engine conditioned on exactly the ids trained on, no re-tokenized history, no added bos.
- SGLang and vLLM: protocol conformance only (`tests.support.conformance_servers`: real gRPC servers,
fake model):
  the ``input_ids`` each Generate call carried are the trained prefix, and its streamed ids are the trained tokens.
"""

import functools
import types

import numpy as np
import pytest
from flax import nnx

from learner.checkpoints.hf_checkpoint import write_hf_checkpoint
from learner.logprobs.chunked import token_logprobs
from learner.model.transformer import Transformer, model_config
from learner.rl.episodes import EpisodeRequest, EpisodeRunner
from learner.tasks import EpisodeLimits, HFTokenizer, StepResult, message_segment_ids
from rollout_client import ClientConfig, LogprobMode, MlxEngine, SamplingParams, ValidationConfig
from rollout_client.engines.sglang import SGLangEngine
from rollout_client.engines.vllm import VllmEngine
from tests.learner.rl.test_episodes import Recording
from tests.rollout_client.engines.conftest import host_weights
from tests.support.conformance_servers import (
    VOCAB,
    sglang_servers,
    token,
    vllm_servers,
    write_fake_checkpoint,
)
from tests.support.hf_files import ALTERNATING_TEMPLATE, QWEN25_TEMPLATE, write_tokenizer

LLAMA3_TEMPLATE = (  # Meta-Llama-3-Instruct's (tokenizer_config.json)
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN3_TEMPLATE = r"""{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and message.content is string and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query_index = index %}{%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# family: (template, special tokens, bos, eos, generation-config stop tokens, the observation's role)
FAMILIES = {
    "llama3": (LLAMA3_TEMPLATE, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
               "<|begin_of_text|>", "<|eot_id|>", ("<|eot_id|>",), "ipython"),
    "qwen2.5": (QWEN25_TEMPLATE, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
                ("<|im_end|>", "<|endoftext|>"), "tool"),
    "qwen3": (QWEN3_TEMPLATE, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"), None,
              "<|im_end|>", ("<|im_end|>", "<|endoftext|>"), "tool"),
    "mistral": (ALTERNATING_TEMPLATE, ("<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>", ("</s>",), "user"),
}
MODEL_CONFIG = model_config("tiny", vocab_size=320, max_seq_len=256)  # covers every family's ~300 ids


def family_tokenizer(directory, family: str) -> HFTokenizer:
    template, specials, bos, eos, stops, _ = FAMILIES[family]
    write_tokenizer(directory, pad_token=None, eos_token=eos, bos_token=bos, chat_template=template,
                    generation_eos=stops, specials=specials)
    tokenizer = HFTokenizer.from_directory(directory)
    assert tokenizer.vocab_size <= MODEL_CONFIG.vocab_size
    return tokenizer


class ChatEnvironment:
    """A user question first; after each turn a tool (or user) message; done after three turns."""

    def __init__(self, role):
        self.role, self.turn = role, 0

    def reset(self, record):
        return [{"role": "user", "content": "What is 12 * 3?"}]

    def step(self, generated):
        self.turn += 1
        return StepResult(observation=[{"role": self.role, "content": f"{12 * 3 + self.turn}"}], reward=1.0,
                          done=self.turn == 3)


class ChatTask:
    name, max_prompt_tokens, max_completion_tokens = "chat", 96, 144

    def __init__(self, tokenizer, role, max_turn_tokens=6):
        self.tokenizer, self.role = tokenizer, role
        self.limits = EpisodeLimits(max_turns=3, max_turn_tokens=max_turn_tokens, max_observation_tokens=64)

    def prompts(self):
        return [{}]

    def environment(self):
        return ChatEnvironment(self.role)


def run_episode(engine, task, mode=LogprobMode.RAW):
    recording = Recording(engine)
    (episode,) = EpisodeRunner(recording, task).submit(
        EpisodeRequest({}, SamplingParams(temperature=1.0), num_samples=1, logprob_mode=mode)).result(timeout=300)
    return episode, recording.calls


def assert_trained_ids_are_the_engines(episode, calls):
    """Each call's prompt is the trained prefix; its returned ids follow it, masked in; everything else is masked
    out (the first prompt and the observations). Returns the policy positions (in the trained sequence)."""
    trained = np.concatenate([episode.prompt_token_ids, episode.completion_token_ids])
    policy = np.concatenate([np.zeros(episode.prompt_token_ids.size), episode.completion_mask]) == 1
    sent_policy = np.zeros(trained.size, bool)
    for request, (sample,) in calls:
        given = np.asarray(request.prompt_token_ids)
        np.testing.assert_array_equal(trained[:given.size], given)
        returned = sample.completion_token_ids
        np.testing.assert_array_equal(trained[given.size:given.size + returned.size], returned)
        sent_policy[given.size:given.size + returned.size] = True
        np.testing.assert_array_equal(episode.logprobs[given.size - episode.prompt_token_ids.size:][:returned.size],
                                      sample.logprobs)
    np.testing.assert_array_equal(sent_policy, policy)
    return trained, policy


@pytest.fixture(scope="module")
def mlx(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mlx")
    tokenizer_dir = directory / "tokenizer"
    family_tokenizer(tokenizer_dir, "qwen2.5")
    model = Transformer(MODEL_CONFIG, rngs=nnx.Rngs(0))
    writer = functools.partial(write_hf_checkpoint, config=MODEL_CONFIG, tokenizer=tokenizer_dir,
                               eos_token_ids=(1,), overwrite=True)
    config = ClientConfig("127.0.0.1:0", ready_timeout_s=180.0,
                          validation=ValidationConfig(vocab_size=MODEL_CONFIG.vocab_size))
    engine = MlxEngine(config, writer, directory / "weights", 0, host_weights(model),
                       log_path=directory / "engine.log")
    yield engine, model
    engine.close()


@nnx.jit
def _learner_logprobs(model, tokens, mask):
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    return token_logprobs(model, tokens, positions, mask, temperature=1.0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mlx_episodes_with_chat_template_observations_are_token_exact(mlx, family, tmp_path):
    engine, model = mlx
    tokenizer = family_tokenizer(tmp_path / family, family)
    episode, calls = run_episode(engine, ChatTask(tokenizer, FAMILIES[family][5]))
    assert episode.turns == 3 and len(calls) == 3 and episode.observations_cut == 0
    trained, policy = assert_trained_ids_are_the_engines(episode, calls)
    np.testing.assert_array_equal(episode.prompt_token_ids, tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 * 3?"}])))
    # Each observation is the template's segment after the turn before it, in the template's own tokens.
    for k, (request, (sample,)) in enumerate(calls[:-1]):
        start = np.asarray(request.prompt_token_ids).size + sample.completion_token_ids.size
        end = np.asarray(calls[k + 1][0].prompt_token_ids).size
        expected = message_segment_ids(tokenizer, [{"role": FAMILIES[family][5], "content": f"{37 + k}"}],
                                       sample.completion_token_ids)
        np.testing.assert_array_equal(trained[start:end], expected)
        assert f"{37 + k}" in tokenizer.decode(trained[start:end])
    # The engine's RAW logprobs are the learner's on the trained sequence: it saw exactly these ids.
    padded = np.zeros((1, 256), np.int32)
    padded[0, :trained.size] = trained
    learner = np.asarray(_learner_logprobs(model, padded, (np.arange(256) < trained.size)[None]))[0, :trained.size]
    np.testing.assert_allclose(episode.logprobs[episode.completion_mask == 1], learner[policy], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_observation_segment_starts_with_the_templates_closing_less_the_stop_token_the_policy_wrote(
        family, tmp_path):
    tokenizer = family_tokenizer(tmp_path, family)
    role = FAMILIES[family][5]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"},
                {"role": role, "content": "37"}]
    full = tokenizer.apply_chat_template(messages)
    turn = tokenizer.encode("Yes")
    closing_and_rest = full[full.index("Yes") + 3:]
    stopped = np.append(turn, tokenizer.eos_ids[0])
    unstopped = message_segment_ids(tokenizer, messages[2:], turn)
    assert tokenizer.decode(unstopped) == closing_and_rest  # cut by length: the template closes the turn
    eos_text = tokenizer.decode([tokenizer.eos_ids[0]])
    if closing_and_rest.startswith(eos_text):  # the policy's own stop token is not repeated
        assert tokenizer.decode(message_segment_ids(tokenizer, messages[2:], stopped)) == closing_and_rest[
            len(eos_text):]
        np.testing.assert_array_equal(np.concatenate([stopped, message_segment_ids(tokenizer, messages[2:], stopped)]),
                                      np.concatenate([turn, unstopped]))


class IdsEnvironment:
    """Id observations within the conformance servers' 64-token vocabulary; done after three turns."""

    turn = 0

    def reset(self, record):
        return [3, 1, 4, 1, 5]

    def step(self, generated):
        self.turn += 1
        return StepResult(observation=[9, 2, 6][:self.turn + 1], done=self.turn == 3)


class IdsTask:
    name, max_prompt_tokens, max_completion_tokens = "ids", 8, 48
    tokenizer = types.SimpleNamespace(eos_ids=(VOCAB - 1,), pad_id=0, vocab_size=VOCAB, decode=lambda ids: " ".join(map(str, ids)))
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=5, max_observation_tokens=8, stop_strings=("</call>",))

    def prompts(self):
        return [{}]

    def environment(self):
        return IdsEnvironment()


@pytest.mark.parametrize("backend, servers", [(SGLangEngine, sglang_servers), (VllmEngine, vllm_servers)],
                         ids=["sglang", "vllm"])
def test_sglang_and_vllm_receive_the_trained_prefix_and_return_the_trained_ids_protocol_conformance(
        backend, servers, tmp_path):
    servers = servers()
    try:
        engine = backend(ClientConfig(servers.target, ready_timeout_s=30.0, validation=ValidationConfig(
            vocab_size=VOCAB)), servers.http.url, write_fake_checkpoint, tmp_path / "weights")
        try:
            engine.publish(1, {"offset": np.array(0)})
            mode = next(iter(engine.capabilities.logprob_modes))  # the one this server setting returns
            episode, calls = run_episode(engine, IdsTask(), mode=mode)
        finally:
            engine.close()
        trained, _ = assert_trained_ids_are_the_engines(episode, calls)
        received = [list(request.tokenized.input_ids) for request in servers.engine.generate_requests]
        assert received == [trained[:np.asarray(request.prompt_token_ids).size].tolist() for request, _ in calls]
        # The task's stop strings reach the engine's own `stop` (the learner's cut stays the guarantee).
        assert [list(request.sampling_params.stop) for request in servers.engine.generate_requests] == [
            ["</call>"]] * 3
        for prompt in received:  # the fake model's ids are a function of the prompt it was given
            start = len(prompt)
            assert trained[start:start + 5].tolist() == [token(sum(prompt), step, 0, 0) for step in range(5)]
    finally:
        servers.stop()
