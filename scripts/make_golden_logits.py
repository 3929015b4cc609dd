"""Golden logits: tiny random Hugging Face checkpoints and the logits transformers computes for them.

For each case below this writes ``tests/fixtures/hf_golden/<case>/``: the ``config.json`` as given here (each case
spells its config the way some transformers version writes it: top-level ``rope_theta``, legacy ``rope_scaling``,
transformers 5's ``rope_parameters``), ``model.safetensors`` with random weights (scaled so that every part of the
network moves the logits), and ``golden.npz`` with the input ids ``[T]`` and transformers' float32 logits ``[T, V]``
of that one sequence. tests/learner/checkpoints/test_hf_models.py checks Tether's logits (and mlx-lm's) against
them without torch.

Regenerate (torch is not a dependency of the project; use a separate venv)::

    python3 -m venv .venv-torch
    .venv-torch/bin/pip install torch==2.13.0 transformers==5.12.1 safetensors numpy
    .venv-torch/bin/python scripts/make_golden_logits.py [--out tests/fixtures/hf_golden]
"""

import argparse
import json
import pathlib
import shutil
import tempfile

import numpy as np
import torch
import transformers

SEQUENCE_LENGTH = 24
_COMMON = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "hidden_act": "silu", "max_position_embeddings": 256}

# case -> (config.json as written, with model_type and architectures).
CASES = {
    # Llama, multi-head attention, untied head, top-level rope_theta (transformers 4 style).
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_COMMON, "num_key_value_heads": 4,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False},
    # Grouped-query attention (8 query heads share 2 key/value heads), tied embeddings.
    "llama_gqa": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_COMMON, "hidden_size": 64,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
                  "tie_word_embeddings": True},
    # head_dim 16 != hidden_size / num_attention_heads = 8.
    "llama_head_dim": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_COMMON,
                       "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                       "tie_word_embeddings": False},
    # Llama 3.1 RoPE scaling, legacy spelling; original context 64 so that the 24 positions see all three bands
    # (unscaled, smoothed, divided by factor) of the remapped frequencies.
    "llama3_rope_scaling": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_COMMON,
                            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                            "tie_word_embeddings": True},
    # The same remapping in transformers 5's spelling: rope_parameters, no top-level rope_theta.
    "llama3_rope_parameters": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_COMMON,
                               "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
                               "rope_parameters": {"rope_type": "llama3", "rope_theta": 200000.0, "factor": 16.0,
                                                   "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                                   "original_max_position_embeddings": 128},
                               "tie_word_embeddings": False},
    # Qwen2: q/k/v biases, tied embeddings, top-level rope_theta.
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_COMMON, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2},
    # Qwen2 written by transformers 5: rope_parameters with the default type, rope_theta only in there.
    "qwen2_rope_parameters": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_COMMON,
                              "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                              "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None},
    # Qwen3: per-head RMSNorm of queries and keys, head_dim 16 != 32 / 4, untied.
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_COMMON, "num_key_value_heads": 2,
              "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
              "attention_bias": False, "use_sliding_window": False, "sliding_window": None},
    # Mistral without a sliding window (as Mistral-7B-v0.3 and later write it).
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **_COMMON,
                "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
                "tie_word_embeddings": False},
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Replaces every parameter: matrices ~ N(0, 1 / fan_in), norms ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                parameter.copy_(0.1 * noise)
            else:
                parameter.copy_(noise / parameter.shape[-1] ** 0.5)


def make_case(name: str, hf_config: dict, out: pathlib.Path, seed: int) -> None:
    directory = out / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    config = transformers.AutoConfig.from_pretrained(directory)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed)
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)  # drops the tied lm_head.weight, as real checkpoints do
        shutil.copy(pathlib.Path(saved) / "model.safetensors", directory / "model.safetensors")
    input_ids = np.random.default_rng(seed).integers(0, hf_config["vocab_size"], SEQUENCE_LENGTH)
    with torch.no_grad():
        logits = model(torch.from_numpy(input_ids)[None]).logits[0].float().numpy()
    np.savez(directory / "golden.npz", input_ids=input_ids.astype(np.int32), logits=logits.astype(np.float32))
    size = sum(file.stat().st_size for file in directory.iterdir())
    print(f"{name}: {type(model).__name__}, {size / 1024:.0f} KiB, logits std {logits.std():.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_golden")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for seed, (name, hf_config) in enumerate(CASES.items()):
        make_case(name, hf_config, args.out, seed)


if __name__ == "__main__":
    main()
