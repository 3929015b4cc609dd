"""Client-side guards: what a request and the engine's model must satisfy before anything reaches an engine."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_client import (
    ModelIdentity,
    ModelMismatchError,
    PromptLimits,
    RequestRefusedError,
    RolloutRequest,
    SamplingParams,
)
from rollout_client.request_guards import check_model_identity, check_request

LIMITS = PromptLimits(vocab_size=100, max_seq_len=64)


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=63), data=st.data())
def test_prompts_inside_vocabulary_and_context_pass(prompt, data):
    max_new_tokens = data.draw(st.one_of(st.none(), st.integers(1, 64 - len(prompt))))
    check_request(RolloutRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens)), LIMITS)


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=40), position=st.integers(0, 39),
       bad=st.one_of(st.integers(100, 2**31 - 1), st.integers(-2**31, -1)))
def test_the_first_id_outside_the_vocabulary_is_named(prompt, position, bad):
    position = min(position, len(prompt) - 1)
    prompt[position] = bad
    with pytest.raises(RequestRefusedError, match=rf"prompt_token_ids\[{position}\]={bad} is outside the vocabulary "
                                                  r"\[0, 100\)"):
        check_request(RolloutRequest(prompt, SamplingParams(max_new_tokens=1), request_id="r"), LIMITS)


@given(prompt_length=st.integers(1, 80), max_new_tokens=st.integers(1, 80))
def test_prompt_plus_max_new_tokens_must_fit_the_context(prompt_length, max_new_tokens):
    request = RolloutRequest(np.ones(prompt_length, np.int32), SamplingParams(max_new_tokens=max_new_tokens))
    if prompt_length + max_new_tokens <= 64:
        check_request(request, LIMITS)
    else:
        with pytest.raises(RequestRefusedError, match=f"{prompt_length} prompt tokens \\+ max_new_tokens="
                                                      f"{max_new_tokens} exceed the engine's context of 64"):
            check_request(request, LIMITS)


def test_no_room_left_for_a_completion_is_refused():
    # max_new_tokens unset resolves to what the context leaves: nothing, for a prompt that fills it
    with pytest.raises(RequestRefusedError, match="64 prompt tokens \\+ max_new_tokens=0 exceed"):
        check_request(RolloutRequest(np.ones(64, np.int32)), LIMITS)


@pytest.mark.parametrize("prompt, message", [
    ([], r"prompt_token_ids has shape \(0,\): it must hold at least one token id"),
    ([[1, 2]], r"prompt_token_ids has shape \(1, 2\)"),
    ([1.0, 2.0], "prompt_token_ids has dtype float64: token ids are integers"),
])
def test_empty_or_malformed_prompts_are_refused(prompt, message):
    with pytest.raises(RequestRefusedError, match=message):
        check_request(RolloutRequest(prompt), LIMITS)


LEARNER = ModelIdentity(vocab_size=128, model_type="qwen2", architectures=("Qwen2ForCausalLM",),
                        shapes={"hidden_size": 64, "num_hidden_layers": 2})


def test_the_same_model_passes_and_unreported_fields_are_not_checked():
    check_model_identity(LEARNER, LEARNER, "127.0.0.1:1")
    check_model_identity(ModelIdentity(vocab_size=128), LEARNER, "127.0.0.1:1")  # the engine reports only its vocab


def test_every_differing_field_is_named_with_both_values():
    engine = ModelIdentity(vocab_size=151_936, model_type="llama", architectures=("LlamaForCausalLM",),
                           shapes={"hidden_size": 896, "num_hidden_layers": 2})
    with pytest.raises(ModelMismatchError) as caught:
        check_model_identity(engine, LEARNER, "127.0.0.1:7")
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("the engine at 127.0.0.1:7 serves another model than the learner trains")
    assert lines[1:5] == ["- vocab_size: engine 151936, learner 128", "- model_type: engine 'llama', learner 'qwen2'",
                          "- architectures: engine ['LlamaForCausalLM'], learner ['Qwen2ForCausalLM']",
                          "- hidden_size: engine 896, learner 64"]
    assert "model.hf_path" in lines[5]


def test_identity_from_a_hugging_face_config():
    identity = ModelIdentity.from_hf_config({"vocab_size": 64, "model_type": "llama", "hidden_size": 32,
                                             "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0})
    assert identity == ModelIdentity(64, "llama", ("LlamaForCausalLM",), {"hidden_size": 32})
