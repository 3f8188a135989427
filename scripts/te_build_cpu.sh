#!/usr/bin/env bash
# Build Transformer Engine 2.20.2's PyTorch extension (transformer-engine-torch, source only) HERE, on a CPU
# machine, against exactly the lent GPU machine's torch (2.11.0+cu130), so that the GPU machine only installs it:
#
#   bash scripts/te_build_cpu.sh [OUT_DIR]   # default OUT_DIR .te-parts/prebuilt (ignored by git); needs PyPI; run it
#                                            # after scripts/te_parts.sh, which empties .te-parts/
#
# then on the GPU machine, after the six core-wheel parts of scripts/te_parts.sh went to /tmp/stash (carry
# ".te-parts/prebuilt" with the last one): bash scripts/te_build_gpu.sh install .te-parts/prebuilt
#
# The extension is one CppExtension (33 C++ files, the host compiler, no nvcc kernels: those are in the prebuilt
# core library transformer_engine_cu13), so no GPU is needed to build it, only torch and the CUDA 13.0 headers.
# In a scratch venv outside the repository (WORK, default /tmp/te-cpu; kept, so a rerun reuses it):
# - torch==2.11.0 from PyPI (CUDA 13.0, checked: its own nvidia-* requirements bring cuda_runtime.h, cublasLt.h,
#   nvrtc.h, nvtx3, cudnn.h 9.19.0.56 and nccl.h 2.28.9), setuptools and wheel (the sdist's build requirements);
# - cuda-toolkit[nvcc,crt,cccl]==13.0.2 (torch 2.11.0's own pin of cuda-toolkit): nvcc 13.0.88 (TE finds the
#   CUDA version and CUDA_HOME through it), crt/host_config.h and nv/target (CCCL 13.0.85), which the CUDA headers
#   include; nvidia-nvvm pinned to 13.0.88 too (nvcc's requirement of it, and of crt, is unpinned);
# - transformer_engine_cu13==2.20.2 and transformer_engine==2.20.2 (not needed to compile; for the import check);
# - the transformer-engine-torch 2.20.2 sdist, built with te_build_gpu.sh's variables (NVTE_PYTORCH_FORCE_BUILD,
#   NVTE_NO_LOCAL_VERSION: version 2.20.2 exactly, NVTE_FRAMEWORK=pytorch, NVTE_CUDA_ARCHS=90: NCCL EP on),
#   CUDA_HOME=nvidia/cu13 of the venv, CPATH = every nvidia/*/include, MAX_JOBS (default 2), log WORK/build.log.
# The wheel (transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl) goes to OUT_DIR with wheel.sha256; over
# 47 MiB it would be split into 47 MiB parts (*.whl.part.N, cat them back in order). OUT_DIR/deps gets the wheels
# that `import transformer_engine.pytorch` needs besides torch and te_parts.sh's small ones: packaging, pydantic (TE's
# recipes) and onnxscript + onnx (imported unconditionally by transformer_engine/pytorch/export.py), with their own
# dependencies; te_build_gpu.sh install puts in those whose module the image lacks (--no-deps: pydantic 2.14 needs
# typing_extensions >= 4.16, ml_dtypes numpy >= 2, onnx protobuf >= 6.31).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
OUT=${1:-$root/.te-parts/prebuilt}
WORK=${TE_CPU_WORK:-/tmp/te-cpu}
TE=2.20.2
TORCH=2.11.0
PY=${PY312:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python}
[ -x "$PY" ] || PY=python3.12
mkdir -p "$WORK/dl"
V="$WORK/venv"
[ -x "$V/bin/python" ] || uv venv -q --no-config --seed --python "$PY" "$V"
uv pip install -q --no-config --python "$V/bin/python" "torch==$TORCH" setuptools wheel \
  "cuda-toolkit[nvcc,crt,cccl]==13.0.2" "nvidia-nvvm==13.0.88.*"
uv pip install -q --no-config --no-deps --python "$V/bin/python" "transformer_engine_cu13==$TE" "transformer_engine==$TE"
"$V/bin/python" - <<EOF
import torch
assert torch.__version__ == "$TORCH+cu130" and torch.version.cuda == "13.0", (torch.__version__, torch.version.cuda)
EOF
sdist="$WORK/dl/transformer_engine_torch-$TE.tar.gz"
[ -f "$sdist" ] || "$V/bin/python" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation \
  -d "$WORK/dl" "transformer-engine-torch==$TE"
SP=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$WORK/dist"; mkdir -p "$WORK/dist"
inc=$(ls -d "$SP"/nvidia/*/include | paste -sd:)
echo "CPATH=$inc" > "$WORK/build.log"
CUDA_HOME="$SP/nvidia/cu13" PATH="$SP/nvidia/cu13/bin:$V/bin:$PATH" CPATH="$inc" \
  NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 \
  MAX_JOBS="${MAX_JOBS:-2}" NVTE_BUILD_MAX_JOBS="${MAX_JOBS:-2}" \
  "$V/bin/python" -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$WORK/dist" "$sdist" \
  >> "$WORK/build.log" 2>&1 || { tail -n 30 "$WORK/build.log"; echo "te cpu build: FAILED, log $WORK/build.log" >&2; exit 1; }
w="$WORK/dist/transformer_engine_torch-$TE-cp312-cp312-linux_x86_64.whl"
[ -f "$w" ] || { ls -la "$WORK/dist"; echo "te cpu build: no $w (a local version suffix?)" >&2; exit 1; }
rm -rf "$OUT"; mkdir -p "$OUT/deps"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 24 27 28; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform any)
"$V/bin/python" -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT/deps" pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 ml-dtypes==0.7.0 \
  protobuf==7.36.2 packaging==26.4
(cd "$OUT/deps" && sha256sum -- *.whl > SHA256SUMS)
(cd "$WORK/dist" && sha256sum "$(basename "$w")") > "$OUT/wheel.sha256"
if [ "$(stat -c %s "$w")" -gt $((47 * 1024 * 1024)) ]; then
  split -b 47M -d -a 1 "$w" "$OUT/$(basename "$w").part."
else
  cp "$w" "$OUT/"
fi
echo "te cpu build: $(basename "$w") $(stat -c %s "$w") bytes"; ls -la "$OUT" "$OUT/deps"; du -sh "$OUT"
