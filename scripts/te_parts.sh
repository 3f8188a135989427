#!/usr/bin/env bash
# Pack Transformer Engine 2.20.2 for the lent GPU machine (no TE there, nothing can be downloaded there) as parts
# small enough to carry, one part per device call:
#
#   bash scripts/te_parts.sh [OUT_DIR]    # here; default OUT_DIR .te-parts (add it to .git/info/exclude)
#
# What travels:
# - transformer_engine_cu13-2.20.2 (the prebuilt core library, libtransformer_engine.so for CUDA 13 plus the
#   Python package; a 276.5 MB wheel), split into 47 MiB parts: OUT_DIR/p0/te.part.0 ... p5/te.part.5;
# - in the last part's folder: transformer_engine-2.20.2 (the 1.2 MB pure-Python wheel), the
#   transformer-engine-torch 2.20.2 sdist (498 kB: 33 C++ files, a CppExtension compiled with the host compiler
#   against torch and the CUDA, cuDNN and NCCL headers; no nvcc kernels, those are in the core library), the
#   build requirements setuptools and wheel, and the small pure-Python runtime requirements of TE/PyTorch that the
#   GPU image may lack (einops, nvdlfw-inspect, importlib-metadata, zipp); te_build_gpu.sh installs only the
#   missing ones;
# - SHA256SUMS.pN (that part's files) and core.sha256 (the whole core wheel) in every part folder.
# scripts/te_build_gpu.sh (run there) checks the sums, installs, builds and tests; docs/megatron-engine.md
# ("Installing Transformer Engine") has the device call sequence.
#
# Downloading the sdist makes pip prepare its metadata, and TE's setup.py imports torch to do that: it runs with
# --no-build-isolation in a scratch venv that holds torch (from uv's cache), setuptools and wheel.
set -euo pipefail
OUT=${1:-.te-parts}
TE=${TE_VERSION:-2.20.2}
PY=${PY312:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python}
[ -x "$PY" ] || PY=python3.12
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 24 27 28; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform any)
SMALL=(setuptools==84.2.1 wheel==0.48.0 einops==0.8.2 nvdlfw-inspect==0.2.2 importlib-metadata==8.7.0 zipp==3.23.0)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" "transformer_engine_cu13==$TE" "transformer_engine==$TE" \
  "${SMALL[@]}"
uv venv -q --no-config --seed --python "$PY" "$WORK/venv"
uv pip install -q --no-config --python "$WORK/venv/bin/python" torch==2.14.0 setuptools wheel
"$WORK/venv/bin/python" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$WORK/whl" \
  "transformer-engine-torch==$TE"
core="$WORK/whl/transformer_engine_cu13-$TE-py3-none-manylinux_2_28_x86_64.whl"
[ -f "$core" ] || { echo "te parts: $core was not downloaded" >&2; exit 1; }
rm -rf "$OUT"; mkdir -p "$OUT"
split -b 47M -d -a 1 "$core" "$WORK/te.part."
n=$(ls "$WORK"/te.part.* | wc -l)
i=0
for p in "$WORK"/te.part.*; do
  mkdir -p "$OUT/p$i"; mv "$p" "$OUT/p$i/"
  i=$((i+1))
done
last="$OUT/p$((n-1))"
find "$WORK/whl" -maxdepth 1 -type f ! -name "$(basename "$core")" -exec cp {} "$last/" \;
(cd "$WORK/whl" && sha256sum "$(basename "$core")") > "$WORK/core.sha256"
for d in "$OUT"/p*; do
  cp "$WORK/core.sha256" "$d/core.sha256"
  (cd "$d" && sha256sum -- * > "SHA256SUMS.${d##*/}")
done
echo "te parts: $n parts in $OUT (core wheel $(stat -c %s "$core") bytes)"; du -sh "$OUT"/p*; ls -la "$last"
