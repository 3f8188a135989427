#!/usr/bin/env bash
# Build the verl 0.9.1 bundle for the lent GPU machine (nothing can be downloaded there) as parts small enough to
# carry, one part per device call, like scripts/vllm_parts.sh:
#
#   bash scripts/verl_parts.sh [OUT_DIR]    # here; default OUT_DIR .verl-parts (ignored via .git/info/exclude)
#
# verl 0.9.1 pins torch==2.11.0 (the GPU image's) for its vLLM extra and vLLM 0.24.0 (built for torch 2.11,
# CUDA 13). The bundle holds vLLM 0.24.0 with the small packages its offline LLM path imports (FlashAttention-2's
# kernel, the Rust front end and DeepGEMM's other-Python extensions dropped, as in vllm_parts.sh), verl itself,
# and what verl imports that the image lacks or holds at a version verl refuses: ray (the single-node runtime),
# tensordict 0.10 (verl: <= 0.10), torchdata, hydra-core with omegaconf 2.3 and antlr4, codetiming, pylatexenc,
# datasets 4.8 (+ dill, multiprocess), transformers 5.10 (verl: < 5.11; the image has 5.17), jsonschema (ray).
# A second, small layer (EXTRA: a gzip tarball as a part of its own, first on PYTHONPATH) holds what the bundle
# lacked on the GPU image: the tokenizers (<= 0.23.0) and huggingface-hub (< 2) transformers 5.10 checks at import
# (the image's are newer); what verl's vLLM server rollout imports and the offline path does not (uvicorn,
# watchfiles, httpx2 for openai 3, model-hosting-container-standards, prometheus-fastapi-instrumentator);
# TransferQueue (verl 0.9.1's default V1 trainer); and xgrammar 0.2.5.post1, the newest that takes the
# apache-tvm-ffi 0.1.9 vLLM 0.24 pins (0.2.9 needs 0.1.11). Check both layers here before a GPU run:
#   uv run python tools/verl_import_check.py
# EXTRA_ONLY=1 rebuilds only that layer, keeping the base parts in OUT_DIR (xz of the base takes long on 2 cores).
# Packed with xz and split into 47 MiB parts: OUT_DIR/p0/part.0 ... pN/part.N, each with the same unpack.sh,
# which reassembles them into /tmp/verlsite (sha256-checked) and prints the PYTHONPATH export.
#
# Carry one part per call, back to back (the machine goes back ~30 s after a call: send the calls in one
# message), then run scripts/verl_grpo.sh in the last call:
#   call 1: carry [".verl-parts/p0"]   command: mkdir -p /tmp/vstash && cp .verl-parts/p0/* /tmp/vstash/
#   call i: carry [".verl-parts/pI"]   command: cp .verl-parts/pI/* /tmp/vstash/
#   last:   carry [".verl-parts/pN", ...] command: cp .verl-parts/pN/* /tmp/vstash/ && bash scripts/verl_grpo.sh
set -euo pipefail
OUT=${1:-.verl-parts}
PY=${PY312:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python}
[ -x "$PY" ] || PY=python3.12
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 24 26 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
VLLM_DEPS=(annotated-types==0.8.0 apache-tvm-ffi==0.1.9 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.1
      gguf==0.19.0 jiter==0.19.0 llguidance==1.9.1 msgspec==0.23.0 openai==3.57.0 openai-harmony==0.0.8
      opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4
      pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 typing-inspection==0.4.5
      xgrammar==0.2.9 blake3==1.0.8 depyf==0.20.0 compressed-tensors==0.17.0)
VERL_DEPS=(verl==0.9.1 ray==2.55.0 tensordict==0.10.0 pyvers==0.1.0 orjson==3.11.5 torchdata==0.11.0
      hydra-core==1.3.2 omegaconf==2.3.0 codetiming==1.4.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 transformers==5.10.2 jsonschema==4.25.1
      jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0)
EXTRA_DEPS=(tokenizers==0.22.2 huggingface-hub==1.33.0 uvicorn==0.55.0 watchfiles==1.3.0 httpx2==2.16.2
      httpcore2==2.16.2 truststore==0.10.5 model-hosting-container-standards==0.1.16 jmespath==1.1.0
      xgrammar==0.2.5.post1 transferqueue==0.1.11 prometheus-fastapi-instrumentator==8.1.0)
extra_layer() {  # SHA: the EXTRA layer as a part of its own, OUT/p<N>/extra.tgz (N after the base's parts)
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/xwhl" "${EXTRA_DEPS[@]}"
  mkdir -p "$WORK/xsite" && for w in "$WORK"/xwhl/*.whl; do unzip -q -o "$w" -d "$WORK/xsite"; done
  last="$OUT/p$(ls -d "$OUT"/p* | grep -c "/p[0-9]*$")"
  [ ! -f "$OUT/p$(( $(ls -d "$OUT"/p* | wc -l) - 1 ))/extra.tgz" ] || last="$OUT/p$(( $(ls -d "$OUT"/p* | wc -l) - 1 ))"
  mkdir -p "$last" && tar -C "$WORK/xsite" -czf "$last/extra.tgz" . && write_unpack "$last" "$1"
}
write_unpack() {  # DIR SHA: the unpack.sh every part carries (the last one copied wins; they are equal)
  cat > "$1/unpack.sh" <<UNPACK
#!/usr/bin/env bash
# Reassemble /tmp/vstash/part.* into /tmp/verlsite (once) and print the exports that make verl and vLLM 0.24 importable.
set -euo pipefail
if [ ! -d /tmp/verlsite/verl ]; then
cat /tmp/vstash/part.* > /tmp/verlsite.tar.xz
got=\$(sha256sum /tmp/verlsite.tar.xz | cut -c1-64)
[ "\$got" = "$2" ] || { echo "verl bundle: sha256 \$got, expected $2 (a part is missing?)" >&2; exit 1; }
mkdir -p /tmp/verlsite && tar -xJf /tmp/verlsite.tar.xz -C /tmp/verlsite
fi
[ -f /tmp/vstash/extra.tgz ] || { echo "verl bundle: /tmp/vstash/extra.tgz missing (the last part)" >&2; exit 1; }
[ -d /tmp/verlsite-extra ] || { mkdir -p /tmp/verlsite-extra && tar -xzf /tmp/vstash/extra.tgz -C /tmp/verlsite-extra; }
echo "export PYTHONPATH=/tmp/verlsite-extra:/tmp/verlsite:\${PYTHONPATH:-} VLLM_USE_FLASHINFER_SAMPLER=0"
UNPACK
}
if [ "${EXTRA_ONLY:-0}" = 1 ]; then
  sha=$(grep -o "[0-9a-f]\{64\}" "$OUT/p0/unpack.sh" | head -1)
  for d in "$OUT"/p*; do write_unpack "$d" "$sha"; done
  extra_layer "$sha"; echo "verl bundle: extra layer in $last"; du -sh "$last"; exit 0
fi
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" vllm==${VLLM_VERSION:-0.24.0} "${VLLM_DEPS[@]}" \
  "${VERL_DEPS[@]}"
# hydra-core's antlr4 runtime (4.9.*) and pylatexenc are source-only: pure Python, built into wheels here
"$PY" -m pip wheel -q --no-deps -w "$WORK/whl" antlr4-python3-runtime==4.9.3 pylatexenc==2.10
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WORK"/whl/*.whl
rm -f "$WORK/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$WORK/site/vllm/vllm-rs"
rm -f "$WORK"/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]*
rm -rf "$WORK"/site/ray/core/src/ray/raylet/*.debug "$WORK"/site/ray/jars
tar -C "$WORK/site" -cf - . | xz -6 -T2 > "$WORK/site.tar.xz"
rm -rf "$OUT"; mkdir -p "$OUT"
split -b 47M -d -a 1 "$WORK/site.tar.xz" "$WORK/part."
sha=$(sha256sum "$WORK/site.tar.xz" | cut -c1-64)
i=0
for p in "$WORK"/part.*; do
  mkdir -p "$OUT/p$i"; mv "$p" "$OUT/p$i/"
  write_unpack "$OUT/p$i" "$sha"
  i=$((i+1))
done
extra_layer "$sha"
echo "verl bundle: $i parts in $OUT (sha256 $sha)"; du -sh "$OUT"/p*
