"""A checkpoint's own tokenizer, from its files: ``tokenizer.json`` through `tokenizers` (no transformers).

Read from the checkpoint directory:

- ``tokenizer.json``: the tokenizer itself (vocabulary, pre-tokenizer, added tokens, post-processor, decoder).
- ``tokenizer_config.json`` (and ``special_tokens_map.json``): the special tokens (``bos_token``, ``eos_token``,
  ``pad_token``, ...) and the ``chat_template``; ``chat_template.jinja`` or ``chat_template.json`` take precedence
  for the template, as in transformers.
- ``generation_config.json`` and ``config.json``: their ``eos_token_id`` (an id or a list) add stop ids.
  Qwen2.5-Instruct stops on ``<|im_end|>`` (the tokenizer's eos) and on ``<|endoftext|>`` (generation_config.json).

Without a pad token, the pad id is the first eos id (the usual Hugging Face setup): the loop never tells padding from
tokens by id, so pad == eos is safe everywhere.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from learner.tasks._chat_template import render_chat, select_template

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


class HFTokenizer:
    """The `Tokenizer` of a Hugging Face checkpoint directory (see the module docstring for the files read).

    ``encode`` adds no special tokens unless asked (``add_special_tokens=True`` applies the tokenizer's
    post-processor, e.g. Llama's bos); ``decode`` keeps them unless ``skip_special_tokens``.

    Attributes:
      vocab_size: ids are in ``[0, vocab_size)`` (added tokens included).
      pad_id: the pad token's id; the first eos id when there is no pad token.
      eos_ids: stop ids: the tokenizer's eos, then generation_config.json's and config.json's ``eos_token_id``.
      bos_id: the bos token's id, or None.
      special_tokens: ``{"bos_token": text, ...}`` as the chat template sees them.
      chat_template: the Jinja source, or None.
    """

    def __init__(self, tokenizer, special_tokens: Mapping[str, str], extra_eos_ids: Sequence[int] = (),
                 chat_template: str | None = None, source: str = "tokenizer"):
        self._tokenizer = tokenizer
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = {name: self._token_id(name) for name in ("bos_token", "eos_token", "pad_token")
               if name in self.special_tokens}  # the others only reach the chat template, as text
        self.bos_id = ids.get("bos_token")
        self.eos_ids = tuple(dict.fromkeys(
            [i for i in [ids.get("eos_token"), *extra_eos_ids] if i is not None]))
        if not self.eos_ids:
            raise ValueError(f"{source}: no eos token: set eos_token in tokenizer_config.json or eos_token_id in "
                             "generation_config.json")
        self.pad_id = ids.get("pad_token")
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0]

    def _token_id(self, name: str) -> int:
        token = self.special_tokens[name]
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.source}: {name} {token!r} is not in tokenizer.json's vocabulary")
        return token_id

    @classmethod
    def from_directory(cls, directory) -> HFTokenizer:
        """The tokenizer of a checkpoint directory holding ``tokenizer.json`` (see the module docstring)."""
        from tokenizers import Tokenizer

        directory = pathlib.Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{directory}: no tokenizer.json (a Hugging Face 'fast' tokenizer file) there")
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        special_tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name, special_map.get(name)))
            if text is not None:
                special_tokens[name] = text
        template = None
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        else:
            template = select_template(_read_json(directory / "chat_template.json").get("chat_template")
                                       or config.get("chat_template"))
        extra_eos = [*_ids(_read_json(directory / "generation_config.json").get("eos_token_id")),
                     *_ids(_read_json(directory / "config.json").get("eos_token_id"))]
        return cls(Tokenizer.from_file(str(directory / "tokenizer.json")), special_tokens, extra_eos, template,
                   source=str(directory))

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """int32 ids of ``text``; special tokens written in the text become their ids."""
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, np.int32)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[np.ndarray]:
        """`encode` of many texts (in parallel, in the tokenizers library)."""
        return [np.asarray(e.ids, np.int32)
                for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``."""
        return self._tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text of ``messages`` under the tokenizer's chat template (as transformers renders it)."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: the tokenizer has no chat_template (tokenizer_config.json or "
                             "chat_template.jinja)")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, **kwargs)
