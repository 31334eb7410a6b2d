#!/usr/bin/env bash
# Builds .gpu-carry/ in the project root: what the GPU host needs to run vLLM 0.33 there without
# vLLM's compiled build, which cannot travel (its CUDA wheel is 326 MB and pins torch 2.14; that
# machine has torch 2.11+cu130): vLLM's Python sources, the wheels its Python imports beyond the
# host's image, and torch-native stand-ins for the few compiled kernels a dense model's forward
# reaches (vllm_native_C.py). With them a real vllm.LLM runs on the H200 (see README.md).
# Usage, from the project root:  make gpu-carry   (or bash tests/gpu/host/prepare.sh [VLLM_VERSION], default 0.33.0)
# Then send .gpu-carry to the GPU host with the checkout and start the GPU tier there with
#   make test-gpu   (source .gpu-carry/setup.sh && python3 -m pytest tests/gpu)
set -euo pipefail
version=${1:-0.33.0}
root=$(git rev-parse --show-toplevel)
out=$root/.gpu-carry
grep -qx '/.gpu-carry/' "$root/.git/info/exclude" 2>/dev/null || echo '/.gpu-carry/' >>"$root/.git/info/exclude"
rm -rf "$out" && mkdir -p "$out/whl"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "vllm==$version" 2>&1 | grep -v 'is ignored' || true
mkdir -p "$tmp/src" && (cd "$tmp/src" && python3 -m zipfile -e "$tmp"/vllm-*.whl . )
# vLLM's CuMem allocator (27 KB, the one compiled module kept) is what sleep mode allocates through; it calls only the
# CUDA driver API, so it loads on the host's torch (2026-12-07, run 69). The rest cannot load there.
find "$tmp/src" \( -name "*.so" -o -name "*.h" -o -name "*.hpp" -o -name "*.cuh" -o -name "*.inl" -o -name "*.cu" \) \
  ! -name "cumem_allocator.abi3.so" -delete
rm -rf "$tmp/src/vllm/third_party/deep_gemm" "$tmp/src/vllm/third_party/fmha_sm100" "$tmp/src/vllm/vllm-rs" "$tmp/src/vllm/model_executor/layers/fused_moe/configs" "$tmp/src/vllm/model_executor/layers/quantization/utils/configs"
tar czf "$out/vllm-py.tgz" -C "$tmp/src" vllm "vllm-$version.dist-info"
# What vLLM's Python imports on the GPU host beyond its image (found by emulating that image); for `vllm serve`
# (the GPU tier's server test): uvicorn, prometheus-fastapi-instrumentator, watchfiles, and
# model-hosting-container-standards with jmespath and supervisor (its SageMaker routes import them at start).
# Name more packages after the version if a script needs what the host's image lacks.
# torchrl and the tensordict it pins: the TorchRL weight-sync scheme tests (tests/gpu/test_gpu_torchrl_scheme.py).
for p in pyzmq pydantic pydantic-core typing-inspection annotated-types cbor2 httpx2 httpcore2 truststore \
         openai openai-harmony sniffio pybase64 tensordict==0.14.3 torchrl==0.14.1 \
         msgspec cachetools orjson blake3 setproctitle dill email-validator dnspython fastapi starlette jsonschema \
         jsonschema-specifications referencing rpds-py more-itertools partial-json-parser pydantic-extra-types \
         python-multipart opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
         opentelemetry-semantic-conventions-ai gguf xgrammar==0.2.8 apache-tvm-ffi==0.1.11 python-json-logger ijson \
         compressed-tensors==0.17.0 loguru depyf astor pyvers uvicorn prometheus-fastapi-instrumentator watchfiles \
         model-hosting-container-standards jmespath supervisor "$@"; do
  [ "$p" = "$version" ] && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out/whl" "$p" 2>&1 | grep -v 'is ignored' || true
done
# llguidance's wheels are tagged manylinux_2_31 (abi3): asked for separately.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi abi3 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 -d "$out/whl" "llguidance==1.7.6" 2>&1 | grep -v 'is ignored' || true
cp "$(dirname "$0")/setup.sh" "$(dirname "$0")/vllm_native_C.py" "$out/"
rm -rf "$tmp"
du -sh "$out"
