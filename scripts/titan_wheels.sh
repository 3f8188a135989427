#!/usr/bin/env bash
# Download torchtitan 0.3.0 and the small packages the TorchTitan engine needs that the GPU image lacks into
# .titan-whl/ (ignored by git), for bench/titan_throughput.py and model_engine=torchtitan on the lent GPU machine
# (Python 3.12 x86-64, no network there). No dependencies are resolved (--no-deps); what is fetched and why:
#   torchtitan 0.3.0        the engine's models, sharding plans, FSDP/AC/compile helpers
#   spmd_types 0.2.3        torchtitan pins it (its sharding configs import it)
#   torch_checkpointing 0.1.1   imported by torchtitan.components.checkpoint
#   tyro 1.0.17, docstring_parser 0.18.0, typeguard 4.6.1   torchtitan.config imports tyro; tyro needs the other two
# The engine imports neither torchtitan.trainer (torchdata) nor its datasets/loggers (datasets, tensorboard, wandb),
# so those stay out. Extra specs given as arguments are fetched too. There:
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .titan-whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.titan-whl"
mkdir -p "$dest"
python="${PYTHON:-python3}"
specs=(
  "torchtitan==0.3.0"
  "spmd_types==0.2.3"
  "torch_checkpointing==0.1.1"
  "tyro==1.0.17"
  "docstring_parser==0.18.0"
  "typeguard==4.6.1"
  "$@"
)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$dest" "${specs[@]}"
ls -la "$dest"
du -sh "$dest"
