"""A character-level tokenizer over printable ASCII, small enough for the tiny model's 128-token vocabulary.

Every task shares it, so one model and one inference server serve all tasks. Ids 0-3 are special (pad, bos, eos,
and a separator between question and answer); printable ASCII ``' '..'~'`` follows, one id per character.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3
_FIRST_CHAR = ord(" ")
_LAST_CHAR = ord("~")
_CHAR_OFFSET = SEP_ID + 1 - _FIRST_CHAR


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

    def decode(self, ids) -> str:
        """The text of character ids; raises ValueError on special or out-of-vocabulary ids."""
        codes = np.asarray(ids, np.int64) - _CHAR_OFFSET
        if np.any((codes < _FIRST_CHAR) | (codes > _LAST_CHAR)):
            raise ValueError(f"ids are not characters: {np.asarray(ids).tolist()}")
        return codes.astype(np.uint8).tobytes().decode("ascii")


TOKENIZER = CharTokenizer()
