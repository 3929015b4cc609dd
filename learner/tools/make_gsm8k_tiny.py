"""The files `configs/gsm8k_cpu.toml` trains on: a random ~17M-parameter Qwen2 checkpoint with its own small BPE
tokenizer and GSM8K-shaped jsonl (question, answer ending in ``#### <number>``), the inputs of the recipe's CPU check
(`scripts/bench_recipe.py --shape 17m`). Nothing is downloaded.

    python scripts/make_gsm8k_tiny.py [OUT_DIR]   # default runs/gsm8k_cpu_files, where the config looks

``OUT_DIR`` receives ``model/`` (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML
template, generation_config.json), ``train.jsonl`` (256 rows) and ``test.jsonl`` (16 rows). Random weights learn
nothing in 3 steps: the point is to try the recipe's whole path (chat template, gsm8k reward, engine, update,
checkpoints, export) on a laptop before renting an accelerator.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

DEFAULT_DIR = pathlib.Path("runs/gsm8k_cpu_files")


def main(argv=None) -> dict[str, pathlib.Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", type=pathlib.Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    from bench_recipe import write_inputs

    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = write_inputs(args.out_dir, "17m", max_seq_len=2048)
    for name, path in files.items():
        print(f"{name}: {path}")
    return files


if __name__ == "__main__":
    main()
