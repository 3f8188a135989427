#!/usr/bin/env bash
# Install the wheels in .whl/ (see fetch_megatron_wheels.sh) into a scratch site dir on the GPU machine and
# print the PYTHONPATH export that makes them (and the posttrain sources of this checkout) importable:
#   eval "$(bash scripts/install_megatron_wheels.sh)"
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
site="${SITE_DIR:-/tmp/site}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  "$root"/.whl/*.whl >&2
srcs=$(ls -d "$root"/packages/*/src | tr '\n' ':')
echo "export PYTHONPATH=${site}:${srcs}\${PYTHONPATH:-}"
