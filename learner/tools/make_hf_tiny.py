"""The files `configs/hf_tiny.toml` trains on: a tiny random Qwen2 checkpoint, its own BPE tokenizer, a jsonl dataset.

Nothing is downloaded. ``OUT_DIR`` (default ``runs/hf_tiny_files``, where the config looks) receives:

- ``model/``: a Hugging Face Qwen2 checkpoint as transformers, mlx-lm and Tether load it (``config.json`` with
  ``architectures``, q/k/v biases and tied embeddings; ``model.safetensors`` with random weights, biases included;
  ``generation_config.json``), written by `learner.checkpoints.hf_checkpoint.write_hf_checkpoint`; and its tokenizer:
  ``tokenizer.json``, a byte-level BPE trained with `tokenizers` on the dataset's text (pre-tokenized as Qwen2's:
  digits one by one), and ``tokenizer_config.json`` with a ChatML chat template. As in Qwen2.5 (base), eos and pad
  are both ``<|endoftext|>``; the turn end ``<|im_end|>`` is a second stop id (generation_config.json). The
  embedding has a few more rows than the tokenizer has tokens, as real checkpoints do.
- ``train.jsonl`` and ``test.jsonl``: three digits to reverse, ``{"question": "reverse 472", "answer": "274"}``;
  ``test.jsonl`` holds the 50 of the 1000 questions left out of training (the validation split: a model that learnt
  to reverse, rather than memorised answers, solves them too).

With ``--tool-calculator`` (``tool_calculator=True``) the tokenizer also learns the text of the multi-turn calculator
episodes (`learner.tasks.Calculator` with ``chat = true``: ``37*84=``, the ``tool`` message of the result, ``?``),
so that ``configs/tool_calculator_hf.toml`` can train on this checkpoint (default directory
``runs/hf_tiny_calculator_files``).

Usage::

    python -m learner.tools.make_hf_tiny [OUT_DIR] [--overwrite] [--tool-calculator]

or from Python, ``learner.tools.make_hf_tiny.make_hf_tiny(out_dir)``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
from typing import NamedTuple

import numpy as np

__all__ = [
    "CALCULATOR_DIR",
    "CHAT_TEMPLATE",
    "DEFAULT_DIR",
    "HfTinyFiles",
    "calculator_texts",
    "make_hf_tiny",
    "model_config",
    "reversal_rows",
    "write_checkpoint",
]

DEFAULT_DIR = pathlib.Path("runs/hf_tiny_files")
CALCULATOR_DIR = pathlib.Path("runs/hf_tiny_calculator_files")  # --tool-calculator's default
# ChatML as Qwen2.5 writes it, without the default system message (short prompts).
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2's, in its order
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2.5): letters, single digits, punctuation, new lines, spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
HELD_OUT = 50  # questions in test.jsonl


class HfTinyFiles(NamedTuple):
    """The paths written."""

    model: pathlib.Path  # the checkpoint directory, tokenizer included
    train: pathlib.Path  # train.jsonl
    test: pathlib.Path  # test.jsonl: the validation split


def reversal_rows() -> list[dict]:
    """Every three-digit string and its reverse as a row: ``{"question": "reverse 472", "answer": "274"}``."""
    return [{"question": f"reverse {n:03d}", "answer": f"{n:03d}"[::-1]} for n in range(1000)]


def model_config(vocab_size: int):
    """The tiny Qwen2's `learner.model.ModelConfig`: q/k/v biases, tied embeddings, Qwen2's rope base; ``vocab_size``
    embedding rows. Two heads of 32 (hidden 64): vLLM's CPU attention has no head size 16, and vLLM's Qwen2 takes
    the head size as hidden_size // num_heads whatever config.json says."""
    from learner.model.transformer import ModelConfig

    return ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                       num_kv_heads=2, head_dim=32, rope_theta=1_000_000.0, tie_embeddings=True, qkv_bias=True,
                       max_seq_len=128)


def _train_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=64, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _render(message: str) -> str:
    from learner.tasks import render_chat

    return render_chat(CHAT_TEMPLATE, [{"role": "user", "content": message}], add_generation_prompt=True)


def _random_weights(config, seed: int) -> dict[str, np.ndarray]:
    """Random parameters in the learner's naming, drawn with NumPy (no compiles): norms 1, biases N(0, 0.1^2) (so
    that a lost bias shows), every other matrix N(0, 1 / fan_in)."""
    from flax import nnx

    from learner.model.param_paths import named_leaves
    from learner.model.transformer import Transformer

    shapes = named_leaves(nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param))
    fan_in = {"o_proj/kernel": config.num_heads * config.head_dim, "down_proj/kernel": config.intermediate_size}
    rng = np.random.default_rng(seed)
    weights = {}
    for path, leaf in shapes.items():
        if path.endswith("/scale"):
            weights[path] = np.ones(leaf.shape, np.float32)
        else:
            fan = next((n for suffix, n in fan_in.items() if path.endswith(suffix)), config.hidden_size)
            std = 0.1 if path.endswith("/bias") else fan ** -0.5
            weights[path] = rng.normal(0.0, std, leaf.shape).astype(np.float32)
    return weights


def calculator_texts() -> list[str]:
    """Text of the chat calculator's episodes for the tokenizer: questions, calls, tool messages, answers."""
    from learner.tasks import render_chat

    texts = []
    for a in range(10, 100, 7):
        for b in range(10, 100, 11):
            question, result = f"{a}*{b}", str(a * b)
            texts.append(render_chat(CHAT_TEMPLATE, [{"role": "user", "content": question},
                                                     {"role": "assistant", "content": question + "="},
                                                     {"role": "tool", "content": result},
                                                     {"role": "assistant", "content": result},
                                                     {"role": "tool", "content": "?"}]))
    return texts


def write_checkpoint(directory: str | pathlib.Path, texts: list[str], config=None, *, seed: int = 0,
                     overwrite: bool = False) -> pathlib.Path:
    """A random Qwen2 checkpoint with its BPE tokenizer trained on ``texts`` (module docstring), at the tiny shape
    (`model_config`) or ``config``'s (a `learner.model.ModelConfig` whose vocabulary holds the tokenizer's, e.g.
    Qwen2.5-0.5B's for speed checks: random weights never emit EOS, so any tokenizer serves)."""
    from learner.checkpoints.hf_checkpoint import write_hf_checkpoint

    tokenizer = _train_tokenizer(texts)
    stop_ids = (tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>"))
    vocab_size = -(-tokenizer.get_vocab_size() // 16) * 16 + 16  # unused rows, as Qwen2.5's 151936 > 151665
    config = config or model_config(vocab_size)
    if config.vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"config.vocab_size={config.vocab_size}: below the tokenizer's {tokenizer.get_vocab_size()}")
    with tempfile.TemporaryDirectory() as tokenizer_dir:  # write_hf_checkpoint copies the tokenizer's files
        tokenizer.save(str(pathlib.Path(tokenizer_dir, "tokenizer.json")))
        pathlib.Path(tokenizer_dir, "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
            "model_max_length": config.max_seq_len, "chat_template": CHAT_TEMPLATE}, indent=2))
        return write_hf_checkpoint(directory, _random_weights(config, seed), config, tokenizer=tokenizer_dir,
                                   eos_token_ids=stop_ids, model_type="qwen2", overwrite=overwrite)


def make_hf_tiny(out_dir: str | pathlib.Path = DEFAULT_DIR, *, seed: int = 0, overwrite: bool = False,
                 tool_calculator: bool = False) -> HfTinyFiles:
    """Writes the checkpoint with its tokenizer and the two dataset files under ``out_dir`` (module docstring).

    Args:
        out_dir: the directory to write into (created if missing).
        seed: of the weights and of which questions are held out.
        overwrite: replace files of an earlier call; False refuses them.
        tool_calculator: the tokenizer also covers the chat calculator's text (`calculator_texts`).

    Returns:
        The paths written (`HfTinyFiles`).
    """
    out_dir = pathlib.Path(out_dir)
    files = HfTinyFiles(model=out_dir / "model", train=out_dir / "train.jsonl", test=out_dir / "test.jsonl")
    existing = [str(path) for path in files if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} exist; pass --overwrite (overwrite=True) to replace them")
    rows = reversal_rows()
    held_out = set(np.random.default_rng(seed).permutation(len(rows))[:HELD_OUT].tolist())
    out_dir.mkdir(parents=True, exist_ok=True)
    for path, keep in ((files.train, lambda i: i not in held_out), (files.test, lambda i: i in held_out)):
        path.write_text("".join(json.dumps(row) + "\n" for i, row in enumerate(rows) if keep(i)))

    write_checkpoint(files.model, [_render(row["question"]) + row["answer"] for row in rows]
                     + (calculator_texts() if tool_calculator else []), seed=seed, overwrite=overwrite)
    return files


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m learner.tools.make_hf_tiny", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", type=pathlib.Path,
                        help=f"directory to write into (default: {DEFAULT_DIR}, where configs/hf_tiny.toml looks; "
                             f"with --tool-calculator {CALCULATOR_DIR}, where configs/tool_calculator_hf.toml looks)")
    parser.add_argument("--seed", type=int, default=0, help="of the weights and of the held-out questions")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an earlier call")
    parser.add_argument("--tool-calculator", action="store_true",
                        help="the tokenizer also covers the chat calculator's text (configs/tool_calculator_hf.toml)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or (CALCULATOR_DIR if args.tool_calculator else DEFAULT_DIR)
    files = make_hf_tiny(out_dir, seed=args.seed, overwrite=args.overwrite, tool_calculator=args.tool_calculator)
    for name, path in files._asdict().items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
