"""CharTokenizer.save_pretrained: the saved Hugging Face files give CharTokenizer's ids, through transformers'
AutoTokenizer (as mlx-lm loads them) and through tokenizers alone."""

import importlib

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from learner.tasks import BOS_ID, EOS_ID, PAD_ID, SEP_ID, TOKENIZER, load_task, task_names

transformers = importlib.import_module("transformers")
tokenizers = importlib.import_module("tokenizers")

PRINTABLE = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("char_tokenizer")
    paths = TOKENIZER.save_pretrained(directory)
    assert sorted(path.name for path in paths) == ["tokenizer.json", "tokenizer_config.json"]
    return directory


@pytest.fixture(scope="module")
def auto(saved):
    return transformers.AutoTokenizer.from_pretrained(saved)


def test_special_ids_are_the_char_tokenizers(auto):
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert auto.convert_tokens_to_ids("<sep>") == SEP_ID
    assert len(auto) == TOKENIZER.vocab_size


@settings(max_examples=200, deadline=None)
@given(text=PRINTABLE)
def test_text_encodes_and_decodes_alike(auto, text):
    # A special token's spelling inside the text is that token for tokenizers (as in every HF tokenizer) but
    # characters for CharTokenizer; task texts never contain them.
    assume(not any(token in text for token in ("<pad>", "<bos>", "<eos>", "<sep>")))
    ids = TOKENIZER.encode(text)
    assert auto.encode(text) == ids.tolist()  # no bos added: as CharTokenizer.encode
    assert auto.decode(ids.tolist()) == text


@pytest.mark.parametrize("name", [n for n in task_names() if n not in ("dataset", "tool_calculator")])
def test_every_prompt_and_completion_of_the_digit_tasks_round_trips(auto, name):
    task = load_task(name, {"num_prompts": 300})
    rng = np.random.default_rng(0)
    for row in task.prompts():
        prompt = row["prompt_ids"]
        for ids in (prompt, task.noisy_demonstration(prompt, rng, noise=0.5)):
            text = auto.decode(ids.tolist())
            assert auto.encode(text, add_special_tokens=False) == ids.tolist()
        question = TOKENIZER.decode(prompt[1:-1])
        assert auto.decode(prompt.tolist()) == f"<bos>{question}<sep>"
        assert auto.encode(question) == TOKENIZER.encode(question).tolist()


def test_tokenizers_alone_reads_the_file_and_refuses_unknown_characters(saved):
    tokenizer = tokenizers.Tokenizer.from_file(str(saved / "tokenizer.json"))
    assert tokenizer.encode("12+79").ids == TOKENIZER.encode("12+79").tolist()
    assert tokenizer.decode([BOS_ID, *TOKENIZER.encode("9"), EOS_ID], skip_special_tokens=True) == "9"
    with pytest.raises(Exception, match="UNK"):
        tokenizer.encode("tab\t")  # CharTokenizer.encode raises too
