"""A character-level tokenizer over printable ASCII, small enough for the tiny model's 128-token vocabulary.

Every task shares it, so one model and one inference server serve all tasks. Ids 0-3 are special (pad, bos, eos,
and a separator between question and answer); printable ASCII ``' '..'~'`` follows, one id per character.
`CharTokenizer.save_pretrained` writes it as Hugging Face tokenizer files, for engines that load a tokenizer from a
checkpoint directory (mlx-lm, vLLM, SGLang through ``transformers.AutoTokenizer``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3
_FIRST_CHAR = ord(" ")
_LAST_CHAR = ord("~")
_CHAR_OFFSET = SEP_ID + 1 - _FIRST_CHAR
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>")  # the text of ids 0-3 in the saved Hugging Face files


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Maps printable ASCII characters to ids ``4..98`` and back; ids 0-3 are pad, bos, eos, separator.

    >>> tokenizer = CharTokenizer()
    >>> tokenizer.encode("12+7").tolist()
    [21, 22, 15, 27]
    >>> tokenizer.decode(tokenizer.encode("12+7"))
    '12+7'
    >>> tokenizer.eos_ids
    (2,)
    """

    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    sep_id: int = SEP_ID
    vocab_size: int = _LAST_CHAR + _CHAR_OFFSET + 1

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The stop ids (the `Tokenizer` protocol's): eos alone."""
        return (self.eos_id,)

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of ``text``; raises ValueError on characters outside printable ASCII."""
        codes = np.frombuffer(text.encode("ascii"), np.uint8).astype(np.int32)
        if np.any((codes < _FIRST_CHAR) | (codes > _LAST_CHAR)):
            raise ValueError(f"not printable ASCII: {text!r}")
        return codes + _CHAR_OFFSET

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of character ids; raises ValueError on special ids (unless ``skip_special_tokens``: then they
        are dropped) and out-of-vocabulary ids."""
        ids = np.asarray(ids, np.int64)
        if skip_special_tokens:
            ids = ids[ids >= _FIRST_CHAR + _CHAR_OFFSET]
        codes = ids - _CHAR_OFFSET
        if np.any((codes < _FIRST_CHAR) | (codes > _LAST_CHAR)):
            raise ValueError(f"ids are not characters: {np.asarray(ids).tolist()}")
        return codes.astype(np.uint8).tobytes().decode("ascii")

    def save_pretrained(self, directory) -> list[pathlib.Path]:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` to ``directory``; returns their paths.

        ``tokenizer.json`` is a `tokenizers` WordLevel model over single characters (a Split pre-tokenizer isolates
        every character, a Fuse decoder joins them), so ``transformers.AutoTokenizer.from_pretrained(directory)``
        (or ``tokenizers.Tokenizer.from_file``) gives the same ids as `encode` for every printable ASCII text, and
        errors like it on other characters. Ids 0-3 are the special tokens `SPECIAL_TOKENS`: they decode to
        ``"<pad>"``, ``"<bos>"``, ``"<eos>"``, ``"<sep>"`` and those strings encode back to them, so a decoded
        prompt or completion re-encodes to its ids. No bos is added when encoding, as in `encode`.
        """
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        specials = dict(zip(SPECIAL_TOKENS, (self.pad_id, self.bos_id, self.eos_id, self.sep_id)))
        vocab = specials | {chr(code): code + _CHAR_OFFSET for code in range(_FIRST_CHAR, _LAST_CHAR + 1)}
        tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))  # not in vocab: unknown text raises
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
        tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in specials])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                  "pad_token": "<pad>", "sep_token": "<sep>", "clean_up_tokenization_spaces": False,
                  "add_bos_token": False, "add_eos_token": False, "model_max_length": 1 << 20}
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = [directory / "tokenizer.json", directory / "tokenizer_config.json"]
        tokenizer.save(str(paths[0]))
        paths[1].write_text(json.dumps(config, indent=2) + "\n")
        return paths


TOKENIZER = CharTokenizer()
