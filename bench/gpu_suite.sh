#!/usr/bin/env bash
# The GPU machine's measurement set, each stage's output (logs, JSON) into OUT:
#   bench/gpu_suite.sh OUT LLAMA_SRC [STAGE ...]
# LLAMA_SRC: llama.cpp source for upstream's llama-bench (a directory, the llama-cpp-python sdist or a
# tarball; built once into /tmp/fle-bench, about 6 minutes on 16 cores, started in the background first).
# Stages (default: tests slots prefill), run in the order given:
#   build    only start upstream's build (in the background, its own process session: it outlives this
#            call, and a later call on the same machine waits for it); prefill and decode start it too
#   tests    the GPU tests of the engine (greedy tokens and KLD against the reference, the captured step,
#            the kernels, the lanes; 16-bit dense matrices, every expert type, prefill), pytest -n 4
#   slots    fle-engine serve with 2 slots against 1 on the GPU engine, factory models of qwen3moe, qwen3next,
#            and qwen4exp (bench/serve_slots.py --engine)
#   prefill  FLE prefill (-ub 4096 and 8192) against upstream's best micro-batch at 1k, 4k and 8k tokens,
#            30B-A3B shape, 1/3 of the expert bytes on the GPU, calibrated routing (bench/engine.py --prefill);
#            waits for the build
#   decode   FLE decode against upstream at the same GPU bytes, near-uniform and calibrated routing, misses
#            on the GPU and split with the CPU; everything on the GPU for both (the first routing's file); FLE
#            with two expert launches per layer and with the one launch (kernel sets cuda, cuda-ffn); the
#            verify step T(n), n = 0..3, at the calibrated skew. With a build in flight, under 10 minutes:
#            start the build in the call before (stage build)
#   kernels  the CUDA C kernels against their references (tests/test_cuda_mv.py), the engine's greedy tokens
#            and KLD with the one-launch gate+up+down (FLE_CUDA_MV_FFN), then the kernel timings of one
#            layer, Triton's against CUDA C's, two launches against one (bench/engine_kernels.py --cuda)
#   checks   30B-A3B shape, calibrated routing, FLE alone: a decode step at position ~1,000 with 8,192 and
#            131,072 positions allocated, and GPU memory and host time per token over 10,000 decoded tokens
#            (bench/engine.py --checks)
#   union    the CUDA C union kernel of T-row steps (FLE_CUDA_MV_UNION=1): its tests against the references, the
#            engine's verify-step, MTP and slots tests with it, then the verify step's T(n) at the calibrated skew
#            with Triton's union kernel, with the CUDA C one, and with it and the T-row Q8_0 dense kernels
#            (FLE_CUDA_MV_DENSE_T=4, its kernels profiled), misses on the GPU (bench/verify_step.py)
#   dense    the Q8_0 kernel staged through shared memory (the default) against the one-block-per-lane one
#            (FLE_CUDA_MV_DENSE=stage / word), nothing else changed: their tests, the T = 1..4 products
#            (bench/engine_kernels.py --dense), the verify step's T(n) and FLE's decode (calibrated, misses
#            split, and everything on the GPU) with each, on one machine
#   misses   the cost of a missed expert in a layer's launches against a kernel that only reads it
#            (bench/engine_kernels.py --misses): this machine's zero-copy speed, which differs between machines
#   verify   the verify step's T(n), n = 0..3, at the calibrated skew with the default kernels: 1/3 of the expert
#            bytes cached with the misses split (the issue's measure), then every expert cached (no misses: how
#            the dense, attention and cached-expert kernels grow with T), both profiled at n = 0 and 2; then the
#            tests of prefetch in T-row steps and 1/3 cached with 4 predicted misses per layer copied one layer
#            ahead (--miss-prefetch 4: the step's union of misses read while the layer before computes), misses
#            on the GPU and split
#   long     FLE alone, calibrated routing: the decode step after prompts of 1,000, 8,192 and 32,768 tokens
#            (bench/engine.py --positions): how a step grows with the sequence, with the attention split into 32
#            (the default) and 128 chunks (FLE_ATTN_SPLITS), after the attention tests with other split counts
#   rows     short prompts, 30B-A3B shape, calibrated routing, FLE alone: prefill (-ub 8192) against decode steps of
#            one and of --prompt-rows tokens at 16-96 tokens (bench/engine.py --prefill ... --row-steps), for the
#            choice of --prefill-min
# One stage's failure is logged and the next one runs; the exit status is the number of stages that failed.
set -uo pipefail
OUT=${1:?usage: bench/gpu_suite.sh OUT LLAMA_SRC [STAGE ...]}
SRC=${2:?usage: bench/gpu_suite.sh OUT LLAMA_SRC [STAGE ...]}
shift 2
STAGES=${*:-tests slots prefill}
cd "$(dirname "$0")/.."
mkdir -p "$OUT" /tmp/fle-bench
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
LLAMA_BENCH=/tmp/fle-bench/llama-build/bin/llama-bench
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt" 2>&1
{ date -u; git rev-parse HEAD 2>/dev/null || true; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } >> "$OUT/machine.txt" 2>&1

# the build runs in a process session of its own (setsid) and says where it stands in files beside the binary,
# so that a call that only starts it (stage "build") can return and the next call on the same machine waits for it
BUILD_PID=/tmp/fle-bench/build.pid BUILD_RC=/tmp/fle-bench/build.rc BUILD_LOG=/tmp/fle-bench/build.log
start_build() {
    [ -x "$LLAMA_BENCH" ] && return 0
    if [ -f "$BUILD_PID" ] && kill -0 "$(cat "$BUILD_PID")" 2>/dev/null; then return 0; fi
    rm -f "$BUILD_RC"
    setsid bash -c 'python3 -c "
import sys; sys.path.insert(0, \"bench\")
from pathlib import Path
from engine import build_llama_bench
build_llama_bench(Path(sys.argv[1]), Path(\"/tmp/fle-bench\"))" "$1" > "$2" 2>&1; echo $? > "$3"' _ \
        "$SRC" "$BUILD_LOG" "$BUILD_RC" < /dev/null &
    echo $! > "$BUILD_PID"
}
if [[ " $STAGES " =~ " build " || " $STAGES " =~ " prefill " || " $STAGES " =~ " decode " ]]; then
    start_build
fi

failed=0
stage() {   # stage NAME COMMAND...
    local name=$1; shift
    echo "== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$OUT/stages.log"
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc ($(date -u +%H:%M:%S))" | tee -a "$OUT/stages.log"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}
wait_build() {
    [ -x "$LLAMA_BENCH" ] && return 0
    while [ -f "$BUILD_PID" ] && kill -0 "$(cat "$BUILD_PID")" 2>/dev/null; do sleep 5; done
    cp -f "$BUILD_LOG" "$OUT/build.log" 2>/dev/null
    [ -x "$LLAMA_BENCH" ] || { echo "llama-bench build failed (exit $(cat "$BUILD_RC" 2>/dev/null)): $OUT/build.log"
                               failed=$((failed + 1)); return 1; }
}

for s in $STAGES; do
    case $s in
        build) ;;              # started above; the stages that need it wait for it
        tests) stage tests python3 -m pytest -q -n 4 tests/test_engine.py tests/test_engine_slots.py \
                   -k "greedy or kld or captured or experts_kernel or lanes or slots"
               # the 16-bit dense kernel, every expert type's kernels, per-token stats, prefill against the
               # reference, the kernels' busy time
               stage tests-more python3 -m pytest -q -n 4 tests/test_engine_float_dense.py tests/test_engine_types.py \
                   tests/test_engine_stats.py tests/test_bench_busy.py tests/test_prefill.py ;;
        slots) for arch in qwen3moe qwen3next qwen4exp; do
                   stage "slots-$arch" python3 bench/serve_slots.py --arch "$arch" --engine --device cuda \
                       --clients 8 --tokens 256 --repeat 3
               done ;;
        prefill) wait_build && stage prefill python3 bench/engine.py --llama-bench "$LLAMA_BENCH" \
                     --prefill 1024,4096,8192 --no-decode --routing calibrated -r 2 --fle-ubatch 4096,8192 \
                     --json "$OUT/prefill.json" ;;
        decode) wait_build && stage decode python3 bench/engine.py --llama-bench "$LLAMA_BENCH" -n 64 -r 2 \
                    --routing uniform,calibrated --miss-split gpu,auto --kernels cuda,cuda-ffn \
                    --verify calibrated --json "$OUT/decode.json" ;;
        kernels) stage kernels-tests python3 -m pytest -q -n 6 tests/test_cuda_mv.py
                 FLE_CUDA_MV_FFN=2,4,4,1 stage kernels-engine python3 -m pytest -q -n 8 tests/test_engine.py \
                     -k "experts_kernel or greedy or kld or captured or split"
                 stage kernels-bench python3 bench/engine_kernels.py --cuda --json "$OUT/kernels.json" ;;
        checks) stage checks python3 bench/engine.py --skip-upstream --routing calibrated -n 32 -r 1 --no-all-gpu \
                    --miss-split auto --checks --memory-tokens 10000 --json "$OUT/checks.json" ;;
        union) FLE_CUDA_MV_UNION=1 stage union-kernel python3 -m pytest -q -n 6 tests/test_cuda_mv.py -k union
               FLE_CUDA_MV_UNION=1 FLE_CUDA_MV_DENSE_T=4 stage union-engine python3 -m pytest -q -n 8 tests/test_verify_step.py \
                   tests/test_engine_mtp.py tests/test_engine_slots.py
               # UNION:DENSE_T: Triton's union kernel, the CUDA C one, and with it the T-row Q8_0 dense kernels
               # (FLE_CUDA_MV_DENSE_T=4); the last with the step's kernels profiled at n = 0 and 2
               for v in 0:1 1:1 1:4; do
                   u=${v%:*} t=${v#*:} prof=""
                   [ "$v" = 1:4 ] && prof="--profile 0,2"
                   FLE_CUDA_MV_UNION=$u FLE_CUDA_MV_DENSE_T=$t stage "union-verify-$u-$t" python3 bench/verify_step.py \
                       --routing calibrated --warmup 256 --reps 30 --miss-split gpu $prof \
                       --json "$OUT/verify-union-$u-dense-$t.json"
               done ;;
        misses) stage misses python3 bench/engine_kernels.py --misses --json "$OUT/misses.json" ;;
        verify) for b in third all; do
                    stage "verify-$b" python3 bench/verify_step.py --routing calibrated --cache-budget $b --warmup 256 \
                        --reps 30 --miss-split auto --profile 0,2 --json "$OUT/verify-$b.json"
                done
                stage verify-prefetch-tests python3 -m pytest -q -n 4 tests/test_miss_prefetch.py
                for sp in gpu auto; do
                    stage "verify-prefetch-$sp" python3 bench/verify_step.py --routing calibrated --warmup 256 \
                        --reps 30 --miss-split $sp --miss-prefetch 4 --json "$OUT/verify-prefetch-$sp.json"
                done ;;
        long) stage long-tests python3 -m pytest -q tests/test_engine.py -k "attention"
              for n in 32 128; do
                  FLE_ATTN_SPLITS=$n stage "long-$n" python3 bench/engine.py --skip-upstream --no-decode \
                      --routing calibrated --positions 1000,8192,32768 --json "$OUT/long-$n.json"
              done ;;
        rows) stage rows python3 bench/engine.py --skip-upstream --no-decode --routing calibrated \
                  --prefill 16,32,48,64,96 --row-steps --fle-ubatch 8192 -r 3 --json "$OUT/rows.json" ;;
        dense) stage dense-tests python3 -m pytest -q -n 6 tests/test_cuda_mv.py -k "dense or graph"
               stage dense-kernels python3 bench/engine_kernels.py --dense --json "$OUT/dense.json"
               for k in word stage; do
                   FLE_CUDA_MV_DENSE=$k stage "dense-verify-$k" python3 bench/verify_step.py --routing calibrated \
                       --warmup 256 --reps 30 --miss-split auto --json "$OUT/dense-verify-$k.json"
                   FLE_CUDA_MV_DENSE=$k stage "dense-decode-$k" python3 bench/engine.py --skip-upstream \
                       --routing calibrated -n 64 -r 2 --miss-split auto --json "$OUT/dense-decode-$k.json"
               done ;;
        *) echo "unknown stage $s (build, tests, slots, prefill, decode, kernels, checks, union, dense, misses, verify, long, rows)"
           failed=$((failed + 1)) ;;
    esac
done
exit $failed
