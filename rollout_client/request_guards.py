"""Client-side checks for what inference engines do not check themselves.

Engines trust their input: the MLX engine embeds a prompt token id beyond its embedding rows as garbage or dies with
a segfault, hangs on an empty prompt until the deadline, and accepts a prompt longer than its context. So every
request is checked here before it is sent (`check_request`), against `PromptLimits` taken from the learner's
vocabulary and the engine's context; and at start the engine's model is checked against the learner's
(`check_model_identity`): a different vocabulary, architecture or shape means the engine's logprobs are not of the
policy being trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

__all__ = [
    "ModelIdentity",
    "ModelMismatchError",
    "PromptLimits",
    "RequestRefusedError",
    "check_model_identity",
    "check_request",
    "resolved_max_new_tokens",
]

# config.json keys that fix the parameter shapes of a Llama / Qwen2 model (engines report shapes through them).
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "tie_word_embeddings")


class RequestRefusedError(ValueError):
    """A request was refused before it reached the engine; the message names the field and the fix."""


class ModelMismatchError(ValueError):
    """The engine serves a different model than the learner trains; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class PromptLimits:
    """What a prompt sent to one engine must respect.

    Attributes:
      vocab_size: prompt token ids must lie in [0, vocab_size): the smaller of the learner's and the engine's.
      max_seq_len: prompt tokens + max_new_tokens must not exceed it (the engine's context).
    """

    vocab_size: int
    max_seq_len: int

    @classmethod
    def of(cls, learner_vocab: int | None, engine_vocab: int, max_seq_len: int) -> PromptLimits:
        """The limits of an engine serving ``engine_vocab`` ids and ``max_seq_len`` tokens to a learner embedding
        ``learner_vocab`` ids (None: the engine's)."""
        return cls(vocab_size=min(learner_vocab or engine_vocab, engine_vocab), max_seq_len=max_seq_len)


def resolved_max_new_tokens(max_new_tokens: int | None, prompt_tokens: int, limits: PromptLimits) -> int:
    """The completion limit sent to the engine: the request's, or (None) what the context leaves after the prompt."""
    return limits.max_seq_len - prompt_tokens if max_new_tokens is None else max_new_tokens


def check_request(request, limits: PromptLimits) -> None:
    """Refuses a `rollout_client.RolloutRequest` the engine would mishandle.

    >>> from rollout_client import RolloutRequest, SamplingParams
    >>> check_request(RolloutRequest([1, 140], SamplingParams(max_new_tokens=8), request_id="r1"),
    ...               PromptLimits(vocab_size=128, max_seq_len=64))
    Traceback (most recent call last):
    ...
    rollout_client.request_guards.RequestRefusedError: request r1: prompt_token_ids[1]=140 is outside the vocabulary [0,
    128) (the learner's and the engine's): the engine would embed garbage or crash; fix the task's tokenizer or the
    model's vocab_size

    Raises:
      RequestRefusedError: an empty prompt, a token id outside [0, vocab_size), or prompt + max_new_tokens beyond
        the context.
    """
    prompt = np.asarray(request.prompt_token_ids)
    name = f"request {request.request_id}"
    if prompt.ndim != 1 or prompt.size == 0:
        raise RequestRefusedError(f"{name}: prompt_token_ids has shape {prompt.shape}: it must hold at least one "
                                  "token id (an engine waits on an empty prompt until the deadline)")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise RequestRefusedError(f"{name}: prompt_token_ids has dtype {prompt.dtype}: token ids are integers")
    bad = np.flatnonzero((prompt < 0) | (prompt >= limits.vocab_size))
    if bad.size:
        raise RequestRefusedError(
            f"{name}: prompt_token_ids[{bad[0]}]={prompt[bad[0]]} is outside the vocabulary [0, {limits.vocab_size}) "
            "(the learner's and the engine's): the engine would embed garbage or crash; fix the task's tokenizer or "
            "the model's vocab_size")
    max_new_tokens = resolved_max_new_tokens(request.sampling.max_new_tokens, prompt.size, limits)
    if max_new_tokens < 1 or prompt.size + max_new_tokens > limits.max_seq_len:
        raise RequestRefusedError(
            f"{name}: {prompt.size} prompt tokens + max_new_tokens={max_new_tokens} exceed the engine's context of "
            f"{limits.max_seq_len} tokens; shorten the prompt or lower rollout.max_new_tokens")


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What identifies a model across learner and engine; None or empty: not reported (not checked).

    Attributes:
      vocab_size: embedding rows (the engine's logprobs are a softmax over them).
      model_type: config.json ``model_type`` (e.g. "qwen2").
      architectures: config.json ``architectures``.
      shapes: the config.json values in `SHAPE_KEYS` that fix the parameter shapes.
    """

    vocab_size: int
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    shapes: Mapping[str, object] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object]) -> ModelIdentity:
        """The identity a Hugging Face ``config.json`` dict declares."""
        return cls(vocab_size=int(config["vocab_size"]), model_type=config.get("model_type"),
                   architectures=tuple(config.get("architectures") or ()),
                   shapes={key: config[key] for key in SHAPE_KEYS if key in config})


def check_model_identity(engine: ModelIdentity, learner: ModelIdentity, address: str) -> None:
    """Refuses an engine whose model differs from the learner's in any field both report.

    Raises:
      ModelMismatchError: listing every field that differs, the engine's and the learner's value, and the fix.
    """
    differences = []
    if engine.vocab_size != learner.vocab_size:
        differences.append(("vocab_size", engine.vocab_size, learner.vocab_size))
    if engine.model_type and learner.model_type and engine.model_type != learner.model_type:
        differences.append(("model_type", engine.model_type, learner.model_type))
    if engine.architectures and learner.architectures and engine.architectures != learner.architectures:
        differences.append(("architectures", list(engine.architectures), list(learner.architectures)))
    for key in SHAPE_KEYS:
        if key in engine.shapes and key in learner.shapes and engine.shapes[key] != learner.shapes[key]:
            differences.append((key, engine.shapes[key], learner.shapes[key]))
    if differences:
        listed = "\n".join(f"- {field}: engine {theirs!r}, learner {ours!r}" for field, theirs, ours in differences)
        raise ModelMismatchError(f"the engine at {address} serves another model than the learner trains, so its "
                                 f"logprobs are not the policy's:\n{listed}\nServe the learner's model (model.name "
                                 "or model.hf_path), or point server.address at an engine that serves it")
