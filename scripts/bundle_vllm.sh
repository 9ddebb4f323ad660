#!/usr/bin/env bash
# Bundle vLLM 0.33.0's Python package (no compiled parts) and the dependency wheels the lent GPU
# machine lacks into .whl/vllm/, for a machine with no registry (scripts/gpu_vllm_bench.sh unpacks it
# there; `carry` .whl/vllm). ~37 MB: a device call carries 64 MiB, lmtier's source travels beside it.
#
#   bash scripts/bundle_vllm.sh          (run here, from the repo root; needs the network, ~2 min)
#
# What it writes:
#   .whl/vllm/vllm-0.33.0-py.tar.xz   the wheel's files minus its compiled parts: every *.so (flash-attn
#                                      2/3, _C_stable_libtorch, _moe_C, ...), vllm-rs, third_party/ except
#                                      the pure-Python pynvml.py / triton_kernels / flash_linear_attention /
#                                      tml_fa4 / flashmla wrappers (deep_gemm and fmha_sm100 are compiled
#                                      code), C/C++/CUDA sources and headers, the API docs' static web
#                                      files and the dist-info RECORD. The dist-info itself stays:
#                                      vLLM's platform detection reads its version (importlib.metadata).
#   .whl/vllm/wheels/*.whl             the packages vLLM imports that the GPU machine's image lacks
#                                      (its list: /work/.library/device/KINDS.md), cp312 manylinux, pinned.
#   .whl/vllm/MANIFEST.txt             the source wheel's sha256, sizes, the wheel list.
# The compiled ops vLLM still needs on that machine are replaced by lmtier/testing/vllm_gpu_shim.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
VLLM_VERSION=0.33.0
dst=.whl/vllm
work=${VLLM_BUNDLE_WORK:-$(mktemp -d)}
[ -n "${VLLM_BUNDLE_WORK:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"

# The GPU machine's Python is CPython 3.12 on glibc 2.39 (Ubuntu 24.04): manylinux up to 2_35 works
# there (llguidance ships only manylinux_2_31).
plats=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
  manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  plats+=(--platform "$p")
done
download() {  # download DIR SPEC...
  local d=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" -d "$d" "$@" 2> >(grep -v "^WARNING: Location" >&2)
}

# 1. vLLM's own wheel (336 MB) -> the Python-only extract
wheel=$(ls "$work"/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  download "$work" "vllm==$VLLM_VERSION"
  wheel=$(ls "$work"/vllm-"$VLLM_VERSION"-*.whl | head -1)
fi
rm -rf "$work/ex"
mkdir -p "$work/ex"
python3 -m zipfile -e "$wheel" "$work/ex"
(
  cd "$work/ex"
  find . -name '*.so' -delete
  rm -rf vllm/vllm-rs vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 \
    vllm/entrypoints/serve/instrumentator/static vllm-"$VLLM_VERSION".dist-info/RECORD
  find . \( -name '*.h' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.cu' -o -name '*.cpp' -o -name '*.c' \) -delete
  find . -type d -empty -delete
)
mkdir -p "$dst"
rm -f "$dst"/vllm-*-py.tar.xz
tar -C "$work/ex" -cf - . | xz -T0 -6 > "$dst/vllm-$VLLM_VERSION-py.tar.xz"

# 2. the dependency wheels. Versions: what pip resolves for vllm 0.33.0's requirements on CPython 3.12
# (2026-12-02), with vLLM's own pins (apache-tvm-ffi, compressed-tensors, depyf, lark, llguidance,
# lm-format-enforcer, outlines-core, xgrammar); pydantic and pydantic-core must match each other.
# Left out: what the image has (transformers 5.17, tokenizers, safetensors, numpy, torch 2.11, triton
# 3.6, tiktoken, httpx, ...), the server-only extras (anthropic, mcp, sse-starlette, supervisor)
# and vLLM's GPU kernel packages (flashinfer, tilelang, quack, humming, ...: not used with TRITON_ATTN).
WHEELS=(
  annotated-types==0.8.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0
  compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1 anyio==4.16.0 diskcache==5.6.3 distro==1.9.0 fastapi==0.136.3
  frozendict==2.5.1 gguf==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 ijson==3.6.0 interegular==0.3.3
  jiter==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3
  mistral-common==1.13.1 msgspec==0.23.0 openai==3.57.0 orjson==3.13.0 oss-harmony==0.0.11
  outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0
  pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 python-json-logger==4.2.0 pyzmq==27.3.0
  setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.55.0
  watchfiles==1.3.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-semantic-conventions-ai==0.5.1
)
rm -rf "$dst/wheels"
download "$dst/wheels" "${WHEELS[@]}"

{
  echo "vllm $VLLM_VERSION from $(basename "$wheel") sha256 $(sha256sum "$wheel" | cut -d' ' -f1)"
  echo "extract: $(find "$work/ex" -type f | wc -l) files, $(du -sm "$work/ex" | cut -f1) MB unpacked," \
    "$(du -k "$dst/vllm-$VLLM_VERSION-py.tar.xz" | cut -f1) KiB as tar.xz"
  echo "wheels: $(ls "$dst/wheels" | wc -l), $(du -sk "$dst/wheels" | cut -f1) KiB"
  ls "$dst/wheels"
} > "$dst/MANIFEST.txt"
head -3 "$dst/MANIFEST.txt"
du -sh "$dst"
