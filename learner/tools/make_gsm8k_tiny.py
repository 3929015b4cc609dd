"""The files `configs/gsm8k_cpu.toml` trains on: a random ~17M-parameter Qwen2 checkpoint with its own small BPE
tokenizer and GSM8K-shaped jsonl (question, answer ending in ``#### <number>``), the inputs of the recipe's CPU check
(``python -m scripts.bench.recipe --shape 17m``). Nothing is downloaded.

    python -m learner.tools.make_gsm8k_tiny [OUT_DIR]   # default runs/gsm8k_cpu_files, where the config looks

``OUT_DIR`` receives ``model/`` (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML
template, generation_config.json), ``train.jsonl`` (256 rows) and ``test.jsonl`` (16 rows). Random weights learn
nothing in 3 steps: the point is to try the recipe's whole path (chat template, gsm8k reward, engine, update,
checkpoints, export) on a laptop before renting an accelerator.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from learner.model import model_config
from learner.tools.make_hf_tiny import write_checkpoint

DEFAULT_DIR = pathlib.Path("runs/gsm8k_cpu_files")


def shape_config(shape: str, max_seq_len: int):
    """The `ModelConfig` of ``shape``: ``qwen2-0.5b`` (Qwen2.5-0.5B's) or ``17m`` (a small Qwen2)."""
    if shape == "17m":  # 50k x 256 tied embedding + 4 layers: ~17M parameters
        return model_config("qwen2-0.5b", vocab_size=50_000, hidden_size=256, intermediate_size=1024, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=64, max_seq_len=max_seq_len)
    return model_config(shape, max_seq_len=max_seq_len)


def gsm8k_rows(count: int, seed: int) -> list[dict]:
    """GSM8K-shaped rows: a word problem and a worked answer ending in ``#### <number>``."""
    rng = np.random.default_rng(seed)
    rows = []
    for a, b in rng.integers(2, 99, (count, 2)):
        rows.append({"question": f"Natalia sold clips to {a} of her friends in April, and then she sold {b} clips "
                                 "in May. How many clips did Natalia sell altogether in April and May?",
                     "answer": f"Natalia sold {a} + {b} = {a + b} clips altogether.\n#### {a + b}"})
    return rows


def write_inputs(out_dir: pathlib.Path, shape: str, max_seq_len: int) -> dict[str, pathlib.Path]:
    """The checkpoint of ``shape`` (`shape_config`) and the train / test jsonl files under ``out_dir``."""
    files = {"model": out_dir / "model", "train": out_dir / "train.jsonl", "test": out_dir / "test.jsonl"}
    for name, count in (("train", 256), ("test", 16)):
        rows = gsm8k_rows(count, seed=len(name))
        files[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    texts = [row["question"] + " " + row["answer"] for row in gsm8k_rows(256, seed=0)]
    write_checkpoint(files["model"], texts, shape_config(shape, max_seq_len), overwrite=True)
    return files


def main(argv=None) -> dict[str, pathlib.Path]:
    parser = argparse.ArgumentParser(prog="python -m learner.tools.make_gsm8k_tiny",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", type=pathlib.Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = write_inputs(args.out_dir, "17m", max_seq_len=2048)
    for name, path in files.items():
        print(f"{name}: {path}")
    return files


if __name__ == "__main__":
    main()
