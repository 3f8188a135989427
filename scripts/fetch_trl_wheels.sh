#!/usr/bin/env bash
# Download TRL and the packages it needs that the GPU image lacks into .trl-wheels/ (ignored by git), for
# bench/trl_grpo.py and bench/trl_agent.py (TRL's environment_factory, `gpu_checks.sh agents`) on the lent GPU
# machine (Python 3.12 x86-64). No dependencies are resolved: the image already has accelerate, transformers,
# huggingface-hub, pyarrow, pandas, numpy, fsspec, aiohttp, xxhash, requests, httpx, tqdm, psutil, jinja2 and
# pyyaml (/work/.library/device/KINDS.md lists them). What is fetched and why:
#   trl 1.16.0          its vLLM check accepts 0.22-0.31 (trl/import_utils.py), so the carried vLLM 0.26 works;
#                       colocate mode needs only vllm.LLM, SamplingParams and StructuredOutputsParams
#   datasets 4.8.5      trl needs >= 4.7; 5.x asks for pyarrow >= 24 and huggingface-hub >= 1.31, 4.8.5 for
#                       pyarrow >= 21 and huggingface-hub < 2 (what transformers 5.17 pins)
#   dill 0.4.1, multiprocess 0.70.19   datasets' two missing needs (datasets wants dill < 0.4.2)
# About 1.7 MB in all. There: python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
#   --target /tmp/site .trl-wheels/*.whl   (scripts/gpu_checks.sh trl and agents do this). The multi-turn arm
#   needs nothing more: transformers >= 5.13 parses tool calls without jmespath (the image has 5.17).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.trl-wheels"
mkdir -p "$dest"
python="${PYTHON:-python3}"
specs=(
  "trl==1.16.0"
  "datasets==4.8.5"
  "dill==0.4.1"
  "multiprocess==0.70.19"
  "$@"
)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$dest" "${specs[@]}"
ls -la "$dest"
du -sh "$dest"
