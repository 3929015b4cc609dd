"""HFTokenizer and chat templates against transformers (the reference implementation) on tiny tokenizers written by
the test: the same ids, the same rendered prompts, the same stop ids; template errors surface as ChatTemplateError."""

import importlib
import json

import jinja2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.tasks import ChatTemplateError, HFTokenizer, Tokenizer, decode_completion, render_chat
from tests.support.hf_files import ALTERNATING_TEMPLATE, write_tokenizer

transformers = importlib.import_module("transformers")

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer with #### and the number."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Use the tool"},
     {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
     {"role": "tool", "content": "2"}, {"role": "tool", "content": "3"}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds <a> & b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}}}]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def ours(qwen_dir):
    return HFTokenizer.from_directory(qwen_dir)


@pytest.fixture(scope="module")
def theirs(qwen_dir):
    return transformers.AutoTokenizer.from_pretrained(qwen_dir)


def test_special_ids_and_stop_ids_are_the_checkpoints(ours, theirs):
    im_end, endoftext = theirs.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert isinstance(ours, Tokenizer)
    assert ours.eos_ids == (im_end, endoftext)  # tokenizer eos, then generation_config.json's list
    assert (ours.pad_id, ours.bos_id, ours.vocab_size) == (theirs.pad_token_id, None, len(theirs))


@settings(max_examples=100, deadline=None)
@given(text=TEXT)
def test_text_encodes_and_decodes_as_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids.tolist()) == text


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_template_renders_as_transformers(ours, theirs, conversation, add_generation_prompt):
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(conversation, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    expected_ids = theirs.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt,
                                              return_dict=True)["input_ids"]
    assert ours.encode(text).tolist() == list(expected_ids)


def test_qwen_template_with_tools_renders_as_transformers(ours, theirs):
    conversation = CONVERSATIONS[0]
    text = ours.apply_chat_template(conversation, tools=TOOLS)
    assert text == theirs.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"description": "adds <a> & b"' in text  # tojson does not escape HTML, as transformers'


def test_bos_eos_and_raise_exception_as_transformers(tmp_path):
    directory = write_tokenizer(tmp_path, bos_token="<s>", eos_token="</s>", pad_token=None,
                                chat_template=ALTERNATING_TEMPLATE, generation_eos=(),
                                specials=("<s>", "</s>"))
    ours, theirs = HFTokenizer.from_directory(directory), transformers.AutoTokenizer.from_pretrained(directory)
    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert ours.apply_chat_template(good) == theirs.apply_chat_template(good, tokenize=False,
                                                                          add_generation_prompt=True)
    assert ours.apply_chat_template(good) == "<s>[INST] a [/INST]b</s>[INST] c [/INST]"
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="must alternate"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="chat template: Conversation roles must alternate"):
        ours.apply_chat_template(bad)
    assert ours.pad_id == ours.eos_ids[0] == theirs.convert_tokens_to_ids("</s>")  # no pad token: pad is eos


def test_template_files_take_precedence_as_in_transformers(tmp_path):
    directory = write_tokenizer(tmp_path)
    (directory / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    conversation = CONVERSATIONS[0]
    assert HFTokenizer.from_directory(directory).apply_chat_template(conversation) == "[What is 2+2?]"
    assert transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
        conversation, tokenize=False) == "[What is 2+2?]"


def test_named_templates_use_the_default_one(tmp_path):
    directory = write_tokenizer(tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert HFTokenizer.from_directory(directory).apply_chat_template(CONVERSATIONS[0]) == "plain"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        HFTokenizer.from_directory(directory)


def test_render_chat_needs_no_tokenizer():
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}assistant:{% endif %}"
    assert render_chat(template, CONVERSATIONS[0], special_tokens={"bos_token": "<s>"}) == \
        "<s>user: What is 2+2?\nassistant:"
    with pytest.raises(ChatTemplateError, match="chat template"):
        render_chat("{{ messages[0]['content'] | no_such_filter }}", CONVERSATIONS[0])


def test_decoded_completion_ends_at_the_first_of_several_stop_ids(ours):
    im_end, endoftext = ours.eos_ids
    answer = ours.encode("#### 72")
    for stop in (im_end, endoftext):
        ids = np.concatenate([answer, [stop], ours.encode(" junk"), [ours.pad_id] * 3])
        assert decode_completion(ours, ids) == "#### 72"
    assert decode_completion(ours, answer) == "#### 72"  # truncated at the length limit: no stop id
    assert decode_completion(ours, np.concatenate([answer[:2], [ours.encode("<|im_start|>")[0]], answer[2:]])) == \
        "#### 72"  # other special tokens are dropped
    beyond = ours.vocab_size + 5  # a model's embedding table is often larger than its tokenizer's vocabulary
    assert decode_completion(ours, np.concatenate([answer[:1], [beyond], answer[1:], [im_end]])) == \
        ours.decode(answer[:1]) + "\ufffd" + ours.decode(answer[1:])


def test_missing_files_and_tokens_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer.from_directory(tmp_path)
    directory = write_tokenizer(tmp_path / "t", eos_token="<|nope|>")
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not in tokenizer.json's vocabulary"):
        HFTokenizer.from_directory(directory)
