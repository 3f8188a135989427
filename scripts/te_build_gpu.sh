#!/usr/bin/env bash
# Install Transformer Engine 2.20.2 on the lent GPU machine from the parts of scripts/te_parts.sh and build its
# PyTorch extension (transformer-engine-torch, source only) against the image's torch 2.11.0+cu130:
#
#   bash scripts/te_build_gpu.sh start    # check + reassemble the parts in /tmp/stash, install the core library
#                                         # and the small wheels into /tmp/site, start the build in the
#                                         # background (setsid, log /tmp/te_build/build.log) and return
#   bash scripts/te_build_gpu.sh status   # the build's state and log tail; once built: install the wheel, run
#                                         # the import + te.Linear check, copy the wheel to $OUT (split in 15 MiB
#                                         # parts when over 16 MiB) with its sha256
#   eval "$(bash scripts/te_build_gpu.sh env)"   # PYTHONPATH export that makes transformer_engine importable
#   bash scripts/te_build_gpu.sh install WHEEL_DIR   # on a fresh machine: install a wheel built earlier instead
#                                         # of building: WHEEL_DIR holds the wheel or its parts (*.whl.part.N), and
#                                         # optionally wheel.sha256 and deps/ (scripts/te_build_cpu.sh's
#                                         # .te-parts/prebuilt: pydantic, onnx, ... for the modules the image lacks)
#
# The build: the sdist's setup.py makes one CppExtension (33 C++ files, host compiler, no nvcc kernels) and
#   NVTE_PYTORCH_FORCE_BUILD=TRUE  skips its attempt to download a prebuilt wheel from GitHub (no network there)
#   NVTE_NO_LOCAL_VERSION=1        version 2.20.2 exactly: TE refuses to load when the torch extension's version
#                                  differs from transformer-engine's and the core library's
#   NVTE_FRAMEWORK=pytorch         do not probe for JAX
#   MAX_JOBS=16                    ninja's parallel jobs (torch.utils.cpp_extension; NVTE_BUILD_MAX_JOBS too)
#   NVTE_CUDA_ARCHS=90             read by this build only to decide NVTE_WITH_NCCL_EP (on for any arch >= 90,
#                                  matching the core wheel, which ships libnccl_ep.so); the CUDA kernels are in the
#                                  prebuilt core library, built for 75;80;89;90;100;120
# pip wheel --no-build-isolation uses the image's torch (build isolation would fetch one: no network). CUDA headers
# come from the toolkit (nvcc 13.0, CUDA_HOME); cudnn.h, nccl.h and the other library headers from the nvidia-*
# wheels next to torch, through CPATH.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
STASH=${STASH:-/tmp/stash}
SITE=${TE_SITE:-/tmp/site}  # the site folder of install_megatron_wheels.sh, which gpu_checks.sh puts on PYTHONPATH
BUILD=${TE_BUILD:-/tmp/te_build}
TE=2.20.2
PY=${PYTHON:-python3}

site_env() { echo "export PYTHONPATH=${SITE}:\${PYTHONPATH:-}"; }

install_missing() {
  # DIR MOD:STEM...: install DIR/STEM-*.whl for each module the image lacks (pip --no-deps --target SITE)
  local dir=$1 pair; shift
  for pair in "$@"; do
    local mod=${pair%%:*} stem=${pair##*:}
    if ! PYTHONPATH="$SITE" "$PY" -c "import $mod" 2>/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$dir"/"$stem"-*.whl
      echo "installed $stem (the image lacks it)"
    fi
  done
}

install_small() {
  # the carried pure-Python wheels, only those whose module the image lacks
  install_missing "$STASH" setuptools:setuptools wheel:wheel einops:einops nvdlfw_inspect:nvdlfw_inspect \
    importlib_metadata:importlib_metadata zipp:zipp
}

install_runtime_deps() {
  # te_build_cpu.sh's OUT_DIR/deps: what `import transformer_engine.pytorch` needs besides torch (packaging, pydantic,
  # onnxscript, onnx), only those the image lacks; dependencies before dependents
  [ -d "$1/deps" ] || return 0
  (cd "$1/deps" && sha256sum --quiet -c SHA256SUMS)
  install_missing "$1/deps" packaging:packaging typing_inspection:typing_inspection annotated_types:annotated_types \
    pydantic_core:pydantic_core pydantic:pydantic google.protobuf:protobuf ml_dtypes:ml_dtypes onnx:onnx \
    onnx_ir:onnx_ir onnxscript:onnxscript
}

install_core() {
  cd "$STASH"
  ls SHA256SUMS.p* >/dev/null 2>&1 || { echo "no $STASH/SHA256SUMS.p*: carry the parts first" >&2; exit 1; }
  for s in SHA256SUMS.p*; do sha256sum --quiet -c "$s"; done
  local core="transformer_engine_cu13-$TE-py3-none-manylinux_2_28_x86_64.whl"
  if [ ! -f "$SITE/transformer_engine/wheel_lib/libtransformer_engine.so" ]; then
    cat te.part.* > "$core"
    sha256sum -c core.sha256 || { echo "core wheel: sha256 mismatch (a part is missing?): ls $STASH" >&2; exit 1; }
    mkdir -p "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$core" \
      "transformer_engine-$TE-py3-none-any.whl"
    rm -f "$core"
  fi
  install_small
}

start() {
  install_core
  rm -rf "$BUILD"; mkdir -p "$BUILD/dist"
  tar -xzf "$STASH/transformer_engine_torch-$TE.tar.gz" -C "$BUILD"
  local inc
  inc=$("$PY" -c 'import glob, nvidia; print(":".join(sorted(d for p in nvidia.__path__ for d in glob.glob(p + "/*/include"))))')
  echo "CPATH from the nvidia wheels: $inc" > "$BUILD/build.log"
  cd "$BUILD/transformer_engine_torch-$TE"
  # setsid -f forks and returns at once; the build's output goes to the log, so no pipe of the caller stays open
  PYTHONPATH="$SITE:${PYTHONPATH:-}" CPATH="$inc${CPATH:+:$CPATH}" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" \
    NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 \
    MAX_JOBS="${MAX_JOBS:-16}" NVTE_BUILD_MAX_JOBS="${MAX_JOBS:-16}" \
    setsid -f bash -c "time $PY -m pip wheel -v --no-deps --no-build-isolation --no-index -w $BUILD/dist . ; echo EXIT \$?" \
    >> "$BUILD/build.log" 2>&1 < /dev/null
  echo "build started: tail $BUILD/build.log (bash scripts/te_build_gpu.sh status)"
}

check() {
  PYTHONPATH="$SITE:${PYTHONPATH:-}" "$PY" - <<'EOF'
import torch
import transformer_engine
import transformer_engine.pytorch as te
from importlib.metadata import version

print("transformer_engine", version("transformer-engine"), "torch ext", version("transformer_engine_torch"),
      "torch", torch.__version__)
layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
ref = x.float() @ layer.weight.float().t() + layer.bias.float()
err = (layer(x).float() - ref).abs().max().item()
bound = 4 * 2**-8 * ref.abs().max().item()  # bf16 output rounding (half an ulp is 2**-9 relative), with margin
print(f"te.Linear bf16 against the fp32 matmul of the same bf16 inputs: max abs err {err:.3g} (bound {bound:.3g})")
assert err <= bound, (err, bound)
EOF
}

install_wheel() {
  # The wheel holds transformer_engine/wheel_lib/transformer_engine_torch*.so: `pip install --target SITE --upgrade`
  # would replace SITE/transformer_engine (the core library and the Python package) by that one folder, so install
  # it into a scratch target and merge. A wheel split in parts (te_build_cpu.sh, over 47 MiB) is joined first.
  local d="$1" tmp; tmp=$(mktemp -d)
  if ! ls "$d"/transformer_engine_torch-*.whl >/dev/null 2>&1 && ls "$d"/*.whl.part.0 >/dev/null 2>&1; then
    local p0; p0=$(ls "$d"/*.whl.part.0); cat "${p0%.0}".? > "$tmp/$(basename "${p0%.part.0}")"; d="$tmp"
  fi
  if [ -f "$1/wheel.sha256" ]; then (cd "$d" && sha256sum -c "$(cd "$1" && pwd)/wheel.sha256"); fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$tmp/t" "$d"/transformer_engine_torch-*.whl
  rm -rf "$SITE"/transformer_engine_torch-*.dist-info
  cp -a "$tmp/t/." "$SITE/"; rm -rf "$tmp"
}

status() {
  tail -n 25 "$BUILD/build.log"
  grep -q '^EXIT ' "$BUILD/build.log" || { echo "build: still running"; exit 0; }
  grep -q '^EXIT 0' "$BUILD/build.log" || { echo "build: FAILED (log above, full log $BUILD/build.log)"; exit 1; }
  install_wheel "$BUILD/dist"
  check
  if [ -n "${OUT:-}" ]; then
    local w; w=$(ls "$BUILD"/dist/transformer_engine_torch-*.whl)
    (cd "$(dirname "$w")" && sha256sum "$(basename "$w")") > "$OUT/wheel.sha256"
    if [ "$(stat -c %s "$w")" -gt $((16 * 1024 * 1024)) ]; then
      split -b 15M -d -a 1 "$w" "$OUT/$(basename "$w").part."
    else
      cp "$w" "$OUT/"
    fi
    cp "$BUILD/build.log" "$OUT/"
    ls -la "$OUT"
  fi
}

case "${1:-}" in
  start) start ;;
  status) status ;;
  env) site_env ;;
  install) w=$(cd "${2:?wheel dir}" && pwd)  # absolute: install_core changes directory
    install_core; install_runtime_deps "$w"; install_wheel "$w"; check ;;
  *) echo "usage: $0 start|status|env|install WHEEL_DIR (see the header)" >&2; exit 2 ;;
esac
