#!/usr/bin/env bash
# Build the vLLM 0.26.0 bundle for the lent GPU machine (no vLLM there, nothing can be downloaded there) as parts
# small enough to carry, one part per device call:
#
#   bash scripts/vllm_parts.sh [OUT_DIR]    # here; default OUT_DIR .vllm-parts (ignored via .git/info/exclude)
#
# Why: the GPU image has torch 2.11.0+cu130 and no vLLM; vLLM 0.26.0 is built for exactly that torch (CUDA 13).
# Its wheel (304 MB) plus the 24 pure-Python/abi3 packages the image lacks are installed into one site folder
# here, FlashAttention-2's kernel (Hopper uses FA3), the Rust front-end binary and DeepGEMM's extensions for other
# Pythons are dropped, and the folder is packed with xz (122 MB) and split into 47 MiB parts:
# OUT_DIR/p0/part.0, p1/part.1, p2/part.2, each with the same unpack.sh.
#
# The three-call carry (a device call carries at most 64 MiB, the working tree included; the machine stays warm
# only about 30 s after a call, so make the three calls back to back, best as three calls of one message, since
# a pause between replies can outlast the 30 s; what lands in /tmp is gone once it
# goes back):
#   call 1: carry [".vllm-parts/p0"]   command: mkdir -p /tmp/stash && cp .vllm-parts/p0/* /tmp/stash/
#   call 2: carry [".vllm-parts/p1"]   command: cp .vllm-parts/p1/* /tmp/stash/
#   call 3: carry [".vllm-parts/p2", ".whl", ".trl-wheels"]
#           command: cp .vllm-parts/p2/* /tmp/stash/ && bash scripts/gpu_checks.sh rl ...
# gpu_checks.sh rl|trl then runs `eval "$(bash /tmp/stash/unpack.sh)"` (checks the sha256, unpacks into
# /tmp/vsite once, prints the PYTHONPATH export); later calls on the same warm machine need no parts.
# FlashInfer is not in the bundle: VLLM_USE_FLASHINFER_SAMPLER=0 (part of the export) samples with PyTorch ops.
set -euo pipefail
OUT=${1:-.vllm-parts}
PY=${PY312:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python}
[ -x "$PY" ] || PY=python3.12
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 24 26 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
DEPS=(annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.165.0
      gguf==0.19.0 httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 llguidance==1.9.1 msgspec==0.23.0
      openai==3.57.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7
      pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0
      truststore==0.10.5 typing-inspection==0.4.5 xgrammar==0.2.9)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" vllm==${VLLM_VERSION:-0.26.0} "${DEPS[@]}"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WORK"/whl/*.whl
rm -f "$WORK/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$WORK/site/vllm/vllm-rs"
rm -f "$WORK"/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]*
tar -C "$WORK/site" -cf - . | xz -9 -T2 > "$WORK/vsite.tar.xz"
rm -rf "$OUT"; mkdir -p "$OUT"
split -b 47M -d -a 1 "$WORK/vsite.tar.xz" "$WORK/part."
sha=$(sha256sum "$WORK/vsite.tar.xz" | cut -c1-64)
i=0
for p in "$WORK"/part.*; do
  mkdir -p "$OUT/p$i"; mv "$p" "$OUT/p$i/"
  cat > "$OUT/p$i/unpack.sh" <<UNPACK
#!/usr/bin/env bash
# Reassemble /tmp/stash/part.* into /tmp/vsite (once) and print the exports that make vLLM importable.
set -euo pipefail
if [ ! -d /tmp/vsite/vllm ]; then
  cat /tmp/stash/part.* > /tmp/vsite.tar.xz
  got=\$(sha256sum /tmp/vsite.tar.xz | cut -c1-64)
  [ "\$got" = "$sha" ] || { echo "vllm bundle: sha256 \$got, expected $sha (a part is missing?)" >&2; exit 1; }
  mkdir -p /tmp/vsite && tar -xJf /tmp/vsite.tar.xz -C /tmp/vsite
fi
echo "export PYTHONPATH=/tmp/vsite:\${PYTHONPATH:-} VLLM_USE_FLASHINFER_SAMPLER=0"
UNPACK
  i=$((i+1))
done
echo "vllm bundle: $i parts in $OUT (sha256 $sha)"; du -sh "$OUT"/p*
