"""Model-FLOPs utilisation as the field reports it: model FLOPs per second over the card's spec dense-bf16 peak.

`SPEC_PEAK_TFLOPS` holds the vendors' dense (no 2:4 sparsity) bfloat16 peaks per chip; `spec_peak_tflops` finds a
JAX ``device_kind`` in it. MaxText, torchtitan and prime-rl divide by these same figures. `model_flops` counts
PaLM's model FLOPs (appendix B of arXiv:2204.02311): per token 6N for the training pass (forward + backward) plus
12·L·H·Dh·T for attention, N the matmul parameters with the output head; a proximal recompute pass that runs adds
a forward, 2N + 4·L·H·Dh·T. Rematerialisation is not counted (that would be hardware FLOPs).
"""

from __future__ import annotations

# (lower-case substring of jax's device_kind, spec dense bf16 TFLOP/s per chip, source); the first match wins, so
# the more specific names come first.
SPEC_PEAK_TFLOPS = (
    # nvidia.com/en-us/data-center/h100 (datasheet: BF16 Tensor Core 1,979 / 1,671 / 1,513 TFLOPS with sparsity)
    ("h100 nvl", 835.0, "NVIDIA H100 NVL datasheet"),
    ("h100 pcie", 756.0, "NVIDIA H100 PCIe datasheet"),
    ("h100", 989.0, "NVIDIA H100 SXM datasheet"),  # jax: "NVIDIA H100 80GB HBM3"
    # nvidia.com/en-us/data-center/h200 (1,979 / 1,671 TFLOPS with sparsity)
    ("h200 nvl", 835.0, "NVIDIA H200 NVL datasheet"),
    ("h200", 989.0, "NVIDIA H200 SXM datasheet"),
    ("a100", 312.0, "NVIDIA A100 datasheet (624 with sparsity)"),  # SXM4 and PCIe alike
    # cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}: "Peak compute per chip (bf16)"
    ("tpu v6 lite", 918.0, "Cloud TPU v6e docs"),
    ("tpu v5 lite", 197.0, "Cloud TPU v5e docs"),
    ("tpu v5", 459.0, "Cloud TPU v5p docs"),  # jax: "TPU v5" (v5p)
    ("tpu v4", 275.0, "Cloud TPU v4 docs"),
)


def spec_peak_tflops(device_kind: str) -> float | None:
    """The spec dense-bf16 peak of a JAX ``device_kind`` in TFLOP/s, or None for a card not in the table.

    Example:
        >>> spec_peak_tflops("NVIDIA H100 80GB HBM3"), spec_peak_tflops("TPU v5 lite"), spec_peak_tflops("cpu")
        (989.0, 197.0, None)
    """
    kind = device_kind.lower()
    return next((peak for name, peak, _ in SPEC_PEAK_TFLOPS if name in kind), None)


def model_flops(config, rows: int, length: int, recompute_pass: bool) -> float:
    """PaLM's model FLOPs of one update of ``rows`` x ``length`` tokens of a `learner.model.ModelConfig`: the
    training pass, plus a forward when the proximal logprobs are recomputed by a pass of their own.

    Example:
        >>> from learner.model import model_config
        >>> model_flops(model_config("tiny"), 2, 64, recompute_pass=False) / (2 * 64)  # per token
        589824.0
    """
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    per_layer = d * config.num_heads * config.head_dim * 2 + d * config.num_kv_heads * config.head_dim * 2 + 3 * d * f
    n = config.num_layers * per_layer + d * v  # matmul parameters, the output head included
    attention = config.num_layers * config.num_heads * config.head_dim * length
    tokens = rows * length
    training = tokens * (6 * n + 12 * attention)
    return training + (tokens * (2 * n + 4 * attention) if recompute_pass else 0)
