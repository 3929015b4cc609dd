"""Chat templates: a tokenizer's Jinja ``chat_template`` rendered as ``transformers.apply_chat_template`` renders it,
with jinja2 alone.

The environment is transformers': a sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that does not escape HTML, and the globals ``raise_exception`` and ``strftime_now``.
The template sees ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None) and the tokenizer's
special tokens as text (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """A chat template refused the messages (its ``raise_exception``) or failed to render."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def select_template(chat_template: str | Mapping[str, str] | Sequence[Mapping[str, str]] | None) -> str | None:
    """The template text of a ``chat_template`` setting: a string, or named templates (a dict, or a list of
    ``{"name", "template"}`` as tokenizer_config.json stores them), of which the one named ``default``."""
    if chat_template is None or isinstance(chat_template, str):
        return chat_template
    if not isinstance(chat_template, Mapping):
        chat_template = {entry["name"]: entry["template"] for entry in chat_template}
    if "default" not in chat_template:
        raise ChatTemplateError(f"chat_template: several templates ({', '.join(sorted(chat_template))}) and none "
                                "named 'default'")
    return chat_template["default"]


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                special_tokens: Mapping[str, str] | None = None, **kwargs) -> str:
    """The text of ``messages`` under the Jinja chat ``template``, as transformers renders it.

    Args:
      template: the Jinja source (tokenizer_config.json's ``chat_template``).
      messages: ``[{"role": ..., "content": ...}, ...]``.
      add_generation_prompt: end with the assistant turn's opening, so that the model writes the reply.
      special_tokens: ``{"bos_token": "<s>", "eos_token": ...}``, visible to the template.
      **kwargs: further template variables (they override special tokens of the same name).

    Raises:
      ChatTemplateError: the template raised (``raise_exception``) or failed to render; the message says why.

    >>> template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    ...             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    >>> render_chat(template, [{"role": "user", "content": "2+2?"}], special_tokens={"eos_token": "</s>"})
    '<|user|>2+2?</s><|assistant|>'
    """
    variables = {**(special_tokens or {}), **kwargs}
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return _compile(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **variables)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"chat template: {err}") from err
