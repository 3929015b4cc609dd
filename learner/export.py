"""Export a run's policy as a Hugging Face checkpoint: ``python -m learner.export RUN_DIR [--step N] OUT_DIR``.

Reads the parameters of one checkpoint of ``RUN_DIR/checkpoints`` (default: the newest whose manifest verifies; the
optimizer state is not read) and the run's model section from that checkpoint's metadata, and writes ``OUT_DIR``
with `learner.checkpoints.hf_checkpoint.write_hf_checkpoint`: safetensors (float32 or bfloat16), config.json with
``architectures`` and bos/eos ids, generation_config.json, and, when the run started from ``model.hf_path``, that
checkpoint's tokenizer files, generation config, architecture and bos/eos ids; otherwise the tokenizer of the run's task
(rebuilt from the checkpoint's ``task`` section: the synthetic tasks' character tokenizer, a ``dataset`` task's
``task.args.tokenizer`` directory) and its bos/eos ids, or a one-line refusal saying why it cannot be written.
transformers, vLLM, SGLang and mlx-lm load the result. Nothing in the run directory is modified.

A LoRA run (``model.lora.rank > 0``; its checkpoints hold the adapters, not the base) is exported as a PEFT adapter
(`learner.checkpoints.peft_export`: ``adapter_config.json`` + ``adapter_model.safetensors``, its
``base_model_name_or_path`` the run's ``model.hf_path`` as an absolute path, or ``--base-model NAME_OR_PATH``), or
with ``--merged`` as the Hugging Face checkpoint of the base with the adapters merged into it (the base read from
``model.hf_path``, or rebuilt from ``model.name`` and ``loop.seed``). A run of several adapters on one base
(``model.lora.adapters``) is exported as one PEFT adapter directory per adapter, ``OUT_DIR/<name>/``, each in the
single-adapter layout (``--adapter NAME``: that one alone); ``--merged`` then needs
``--adapter NAME``, the adapter to merge.

Example::

    python -m learner.export runs/gsm8k_qwen2.5 exports/gsm8k_step500 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import pathlib
import warnings
from collections.abc import Sequence

import numpy as np
from flax import nnx

from learner.checkpoints.checkpointer import read_step
from learner.checkpoints.hf_checkpoint import TOKENIZER_FILES, model_config_from_checkpoint, write_hf_checkpoint
from learner.checkpoints.peft_export import write_peft_adapter
from learner.checkpoints.reading import choose_checkpoint, read_checkpoint_params
from learner.checkpoints.safetensors_io import load_safetensors
from learner.model.lora import LoraConfig, base_identity, merge_adapters, same_base, split_adapters
from learner.model.param_paths import named_leaves
from learner.model.transformer import ModelConfig, Transformer, model_config
from learner.rl.error_lines import errors_as_lines

__all__ = ["export_run"]


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _id_list(value) -> tuple[int, ...]:
    return () if value is None else (value,) if isinstance(value, int) else tuple(value)


def _base_weights(config: ModelConfig, hf_path: str | None, seed: int) -> dict[str, np.ndarray]:
    """The frozen base of a LoRA run: the Hugging Face checkpoint's weights, or the model initialised from the seed."""
    if hf_path:
        model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
        load_safetensors(model, hf_path)
    else:
        model = Transformer(config, rngs=nnx.Rngs(seed))
    return {name: np.asarray(array) for name, array in named_leaves(nnx.state(model)).items()}


def export_run(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *, step: int | None = None,
               dtype: str = "float32", eos_token_ids: Sequence[int] | None = None,
               overwrite: bool = False, merged: bool = False, adapter: str | None = None,
               base_model: str | None = None, allow_other_base: bool = False) -> pathlib.Path:
    """Writes checkpoint ``step`` (default: the newest verified) of the run in ``run_dir`` to ``out_dir``.

    Args:
        run_dir: the run's directory (``run_dir`` of its config): holds ``checkpoints/<step>/``.
        out_dir: the Hugging Face checkpoint directory to create.
        step: which checkpoint; None: the newest whose manifest verifies.
        dtype: "float32" or "bfloat16" (or "float16").
        eos_token_ids: stop ids to write; None: the source checkpoint's (``model.hf_path``), if any.
        overwrite: replace an existing ``out_dir``.
        merged: a LoRA run's adapters merged into its base as a Hugging Face checkpoint, instead of a PEFT adapter.
        adapter: with several adapters (``model.lora.adapters``), the one to export (required with ``merged``);
            None: every one, each to ``out_dir/<name>/``. A single adapter's run accepts its own name only.
        base_model: a PEFT adapter's ``base_model_name_or_path`` (a Hub name, or a path); None: the run's
            ``model.hf_path``, as an absolute path.
        allow_other_base: export although the base (``model.hf_path``, or ``base_model``) is not, or cannot be
            shown to be, the one the adapters were trained on (`check_export_base`).

    Returns:
        ``out_dir``.
    """
    step_dir = choose_checkpoint(pathlib.Path(run_dir) / "checkpoints", step)
    run_config = read_step(step_dir)[0].get("config") or {}
    model = run_config.get("model") or {}
    hf_path = model.get("hf_path")
    if hf_path:
        source = pathlib.Path(hf_path)
        config: ModelConfig = model_config_from_checkpoint(source)
        source_config = _read_json(source / "config.json")
        generation = _read_json(source / "generation_config.json")
        has_tokenizer = any((source / name).is_file() for name in TOKENIZER_FILES)
        tokenizer = source if has_tokenizer else None
        if not has_tokenizer:
            warnings.warn(f"{source} has no tokenizer files: the export has none", stacklevel=2)
        model_type = source_config.get("model_type")
        bos = source_config.get("bos_token_id", generation.get("bos_token_id"))
        eos = _id_list(generation.get("eos_token_id", source_config.get("eos_token_id")))
    else:
        config = model_config(model.get("name", "tiny"))
        model_type = None
        tokenizer, bos, eos = task_tokenizer(run_config)
    params = read_checkpoint_params(step_dir)
    lora = model.get("lora") or {}
    if lora.get("rank", 0) > 0:
        lora = LoraConfig(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]), dtype=lora["dtype"],
                          adapters=tuple(lora.get("adapters", ())))
        chosen = _chosen_adapters(lora.adapters, adapter, merged)
        if not allow_other_base:
            check_export_base(read_step(step_dir)[0].get("lora_base"), model, (run_config.get("loop") or {}).get(
                "seed", 0), None if merged else base_model)
        if lora.stacked:
            params = {name: weights for name, weights in split_adapters(params, lora.adapters).items()
                      if name in chosen}
        if not merged:
            if not lora.stacked:
                return write_peft_adapter(out_dir, params, lora, config,
                                          base_model_name_or_path=base_model or hf_path, overwrite=overwrite)
            for name in chosen:
                write_peft_adapter(pathlib.Path(out_dir) / name, params[name], lora, config,
                                   base_model_name_or_path=base_model or hf_path, overwrite=overwrite)
            return pathlib.Path(out_dir)
        seed = (run_config.get("loop") or {}).get("seed", 0)
        adapters = params[chosen[0]] if lora.stacked else params
        params = merge_adapters(_base_weights(config, hf_path, seed) | adapters, lora.scale)
    elif adapter is not None:
        raise ValueError(f"--adapter {adapter!r}: the run trains no LoRA adapters (model.lora.rank = 0)")
    return write_hf_checkpoint(out_dir, params, config, tokenizer=tokenizer,
                               eos_token_ids=eos if eos_token_ids is None else eos_token_ids, bos_token_id=bos,
                               dtype=dtype, model_type=model_type, overwrite=overwrite)


def task_tokenizer(run_config: dict) -> tuple[object, int | None, tuple[int, ...]]:
    """The tokenizer a run without ``model.hf_path`` used, its task's (`learner.tasks.run_tokenizer`), as
    `write_hf_checkpoint` takes it (an object with ``save_pretrained``, or the directory it was read from), with its
    bos and eos ids.

    Raises:
        ValueError: the task does not load here, or its tokenizer cannot be written as Hugging Face files.
    """
    from learner.tasks import run_tokenizer

    name = (run_config.get("task") or {}).get("name")
    tokenizer = run_tokenizer(run_config)
    if hasattr(tokenizer, "save_pretrained"):
        source = tokenizer
    elif (directory := pathlib.Path(getattr(tokenizer, "source", ""))).is_dir():
        source = directory
    else:
        raise ValueError(f"the run's task {name!r} uses a {type(tokenizer).__name__}, which has no Hugging Face "
                         "files to write (no save_pretrained, no source directory)")
    return source, getattr(tokenizer, "bos_id", None), tuple(tokenizer.eos_ids)


def check_export_base(saved: dict | None, model: dict, seed: int, base_model: str | None) -> None:
    """Refuses to export LoRA adapters for another base than they were trained on: the checkpoint's ``lora_base``
    (`learner.model.lora.base_identity`, the sha256 of the base's files) against the base the export reads or names
    (``model.hf_path``; a PEFT export's ``--base-model`` when given: a directory is hashed, a Hub name cannot be).

    Raises:
        ValueError: a changed base, an unverifiable ``--base-model``, or a checkpoint that records no base; each
            names ``--allow-other-base``, which exports anyway.
    """
    hf_path = model.get("hf_path")
    fix = "pass --allow-other-base to export anyway"
    named = pathlib.Path(base_model).resolve() if base_model is not None else None
    if named is not None and not (hf_path and named == pathlib.Path(hf_path).resolve()):
        if not (pathlib.Path(base_model) / "config.json").is_file():
            raise ValueError(f"--base-model {base_model!r} is not a local checkpoint, so it cannot be checked against "
                             f"the base the adapters were trained on ({saved}): {fix} if it is that base")
        hf_path, where = base_model, f"--base-model {base_model}"
    else:
        where = f"model.hf_path {hf_path}" if hf_path else f"model.name {model.get('name')!r}, loop.seed {seed}"
    if saved is None:
        raise ValueError(f"the checkpoint records no LoRA base (lora_base; saved by an older version), so {where} "
                         f"cannot be checked: {fix}")
    current = base_identity(hf_path, model.get("name", "tiny"), seed)
    if not same_base(saved, current):
        changed = f"sha256 {current['sha256']}, trained on {saved.get('sha256')}" if current["sha256"] else (
            f"trained on {saved}")
        raise ValueError(f"{where} is not the base the LoRA adapters were trained on ({changed}): restore that base, "
                         f"or {fix}")


def _chosen_adapters(names: tuple[str, ...], adapter: str | None, merged: bool) -> tuple[str, ...]:
    """The adapters to export of a run whose ``model.lora.adapters`` are ``names``; refuses an unknown name, and a
    merge that does not say which of several adapters to merge."""
    if adapter is None:
        if merged and len(names) > 1:
            raise ValueError(f"--merged with the adapters {list(names)} (model.lora.adapters): say which one to merge "
                             "with --adapter NAME")
        return names
    if adapter not in names:
        raise ValueError(f"--adapter {adapter!r}: the run's adapters are {list(names) or 'unnamed (one)'} "
                         "(model.lora.adapters)")
    return (adapter,)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m learner.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=pathlib.Path, help="the run directory (holds checkpoints/)")
    parser.add_argument("out_dir", type=pathlib.Path, help="the Hugging Face checkpoint directory to write")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest whose manifest verifies)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--eos-ids", type=int, nargs="*", help="stop ids (default: the source checkpoint's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    parser.add_argument("--merged", action="store_true",
                        help="LoRA runs: write the base with the adapters merged (default: a PEFT adapter)")
    parser.add_argument("--base-model", metavar="NAME_OR_PATH",
                        help="LoRA runs: the PEFT adapter's base_model_name_or_path, a Hub name or a path "
                             "(default: the run's model.hf_path, as an absolute path)")
    parser.add_argument("--allow-other-base", action="store_true",
                        help="LoRA runs: export although the base (model.hf_path, or --base-model) differs from, or "
                             "cannot be checked against, the one the adapters were trained on (its sha256)")
    parser.add_argument("--adapter", help="LoRA runs of several adapters (model.lora.adapters): the one to export "
                                          "(required with --merged; default: every one, to OUT_DIR/<name>/)")
    args = parser.parse_args(argv)
    with errors_as_lines(ValueError, FileNotFoundError, FileExistsError, run_dir=str(args.out_dir)):
        out = export_run(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype, eos_token_ids=args.eos_ids,
                         overwrite=args.overwrite, merged=args.merged, adapter=args.adapter,
                         base_model=args.base_model, allow_other_base=args.allow_other_base)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
