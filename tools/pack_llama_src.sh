#!/usr/bin/env bash
# Pack the llama.cpp source of the llama-cpp-python sdist that the reference tier
# pins, trimmed to what a CUDA `llama-bench` build needs (a few MB instead of ~75),
# so that it can travel to a GPU machine without network access:
#   tools/pack_llama_src.sh OUT.tar.xz [SDIST.tar.gz]
# bench/engine.py --llama-src OUT.tar.xz (build_llama_bench) unpacks and builds it.
set -euo pipefail
out=$(realpath -m "$1")
sdist=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$sdist" ]; then
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==${LLAMA_VERSION:-0.3.36}" -d "$work"
    sdist=$(ls "$work"/llama_cpp_python-*.tar.gz)
fi
tar xzf "$sdist" -C "$work"
top=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)
cd "$top"
# the CPU and CUDA backends only; no server web UI, models, docs or tests
keep_ggml=$(ls ggml/src | grep -v -E '^ggml-(cann|hexagon|hip|metal|musa|opencl|openvino|sycl|virtgpu|vulkan|webgpu|zdnn|zendnn|et|blas|rpc)$' \
    | sed 's|^|ggml/src/|')
tar cJf "$out" --exclude='tools/server/webui' --exclude='tools/server/public*' \
    CMakeLists.txt cmake common include src vendor licenses app pocs tools \
    ggml/CMakeLists.txt ggml/cmake ggml/include $keep_ggml $(ls -d ggml/src/ggml-blas ggml/src/ggml-rpc 2>/dev/null)
echo "$out: $(du -h "$out" | cut -f1)"
