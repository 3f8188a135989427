#!/usr/bin/env bash
# Download the Megatron wheels the GPU machine lacks into .whl/ (ignored by git), for Python 3.12 x86-64.
# Pure-python or cp312 manylinux wheels only, no dependencies (the GPU image already has torch, transformers,
# safetensors, einops, pyyaml...). Run from anywhere; pass extra NAME==VERSION specs to fetch more.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.whl"
mkdir -p "$dest"
python="${PYTHON:-python3}"
specs=(
  "megatron-core==0.19.2"
  "megatron-bridge==0.6.2"
  "megatron-fsdp==0.6.1"
  "omegaconf==2.4.0"
  "mbridge==0.15.1"  # engine.vanilla_mbridge=true (deprecated); pure python
  # Megatron-Bridge's save_hf_weights (the hf_model checkpoint content) imports modelopt, which imports pulp and
  # pynvml; Bridge gets them through megatron-core[dev]; the GPU image lacks modelopt, so all three travel
  "nvidia-modelopt==0.47.0" "pulp==3.3.2" "nvidia-ml-py==13.615.71"
  "$@"
)
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dest" "${specs[@]}"
ls -la "$dest"
