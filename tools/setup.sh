#!/usr/bin/env bash
# Set up FLE in ./.venv on a fresh machine (idempotent; a second run is quick).
#   tools/setup.sh              the package, its console scripts and the test tools
#   tools/setup.sh --reference  also transformers 5.23 and llama-cpp-python 0.3.36, the
#                               neutral references the reference tests compare against,
#                               lm-evaluation-harness 0.4.13 (its API models) and playwright,
#                               which the server's tests run; llama-cpp-python compiles from
#                               source once (~7 min on 2 cores) and the wheel is kept in
#                               $FLE_WHEEL_CACHE (default ~/.cache/fle/wheels)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LLAMA_VERSION=0.3.36
WHEELS=${FLE_WHEEL_CACHE:-$HOME/.cache/fle/wheels}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"

# torch first, pinned: an unpinned requirement would pull a multi-GB CUDA build
# where the CPU build of this version is what the machine has.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    $PIP install -q "torch==${FLE_TORCH_VERSION:-2.13.0}"
fi
$PIP install -q -e ".[engine,test]"

if [ "${1:-}" = "--reference" ]; then
    if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
        wheel=$(ls "$WHEELS"/llama_cpp_python-${LLAMA_VERSION}-*.whl 2>/dev/null | head -n 1 || true)
        if [ -z "$wheel" ]; then
            echo "compiling llama-cpp-python ${LLAMA_VERSION} once (about 7 minutes on 2 cores) into $WHEELS" >&2
            mkdir -p "$WHEELS"
            CMAKE_ARGS="-DGGML_NATIVE=OFF" $PIP wheel -q --no-deps --no-binary llama-cpp-python \
                -w "$WHEELS" "llama-cpp-python==${LLAMA_VERSION}"
            wheel=$(ls "$WHEELS"/llama_cpp_python-${LLAMA_VERSION}-*.whl | head -n 1)
        fi
        $PIP install -q "$wheel"
    fi
    # transformers is the tie-breaker for qwen4exp outputs (reference tier only)
    .venv/bin/python -c "import transformers.models.qwen4_exp" 2>/dev/null \
        || $PIP install -q "transformers==5.23.0"
    # lm-evaluation-harness, run against fle-engine serve (tests/test_server_lm_eval.py)
    .venv/bin/python -c "import lm_eval, tenacity" 2>/dev/null \
        || $PIP install -q "lm-eval[api]==${LM_EVAL_VERSION:-0.4.13}"
    # playwright drives the chat page in headless Chromium (tests/test_server_page.py); the browser
    # is not fetched here: playwright's own (python -m playwright install chromium) or a system
    # chromium / chromium-headless-shell is used, and the test skips when there is none
    .venv/bin/python -c "import playwright" 2>/dev/null || $PIP install -q "playwright>=1.40"
fi
