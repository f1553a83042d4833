#!/usr/bin/env bash
# The default model's shape (SmolLM2-135M-Instruct Q4_1: llama, hidden 576, 30 layers, 9/3 heads, FFN 1536,
# vocab 49152, tied Q8_0 embedding) on 2 cores of the H200 host, ours against llama.cpp's CPU build in the
# same call. Every timed run is pinned to CPUs 0,1 (`taskset -c 0,1`, 2 threads); llama.cpp is built first
# on all cores, before anything is measured. The GGUF is generated here (`make_gguf_llama.py`, random
# values, same tensor names, shapes and block types as the real file: the real one is too big to carry).
#   bash smollm2_on_device.sh main    ours decode 64 / prefill 64 (twice), 8 streams (AMX from 16 or 8 rows),
#                                     an A/B of the dense activation input (MOE_CPU_DENSE_INPUT=int8pair|int8),
#                                     llama.cpp pp64/tg64
#   bash smollm2_on_device.sh tests   the kernels' unit tests on this CPU (AMX paths included)
# Staged in $D (relative to the working directory): moe-daemon, moe_kernels_tests, peers/ (the peer kit with
# kit/; else .device/peers); make_gguf_llama.py beside this script. Results to stdout and $OUT.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
D=${D:-.device}
PEERS=${PEERS:-$D/peers}; [ -f "$PEERS/run_peer.sh" ] || PEERS=.device/peers
OUT=${OUT:-/tmp/smollm2-out}; mkdir -p "$OUT"
export WORK=/tmp/peer-cpu CUDA=OFF JOBS=16
PIN="taskset -c 0,1"
M=/dev/shm/smollm2-shape-q4_1.gguf
lscpu | grep -E '^(Model name|CPU\(s\)|L2 cache|L3 cache)'
for PART in "$@"; do
  case $PART in
  main)
    (timeout 200 bash $PEERS/run_peer.sh build > "$OUT/llama_build.log" 2>&1; echo "llama build rc=$?" >> "$OUT/llama_build.log") &
    BUILD=$!
    pip install -q --no-index --no-deps --target /tmp/site $PEERS/kit/gguf-*.whl > /dev/null 2>&1
    PYTHONPATH=/tmp/site timeout 60 python3 $HERE/make_gguf_llama.py --out $M
    wait $BUILD; tail -1 "$OUT/llama_build.log"
    LLAMA=$WORK/build/bin/llama-bench
    run() {  # label, then the bench arguments
      local label=$1; shift
      echo "### ours: $label" | tee -a "$OUT/ours.md"
      timeout 60 $PIN $D/moe-daemon bench decode --model $M --cpu-threads 2 "$@" 2>&1 \
        | grep -E "^prefill \(warm|^decode|per step|rror|panick" | tee -a "$OUT/ours.md"
    }
    run "1 stream, run 1" --prompt-len 64 --steps 64 --prefill-lens 64
    run "1 stream, run 2" --prompt-len 64 --steps 64 --prefill-lens 64
    run "8 streams" --batch 8 --prompt-len 64 --steps 32
    for rows in 8; do  # AMX (through bf16 widening) from this many rows on, instead of 16
      MOE_CPU_DENSE_AMX_MIN_ROWS=$rows run "8 streams, AMX from $rows rows" --batch 8 --prompt-len 64 --steps 32
    done
    for input in int8pair int8; do  # the defaults: int8pair for 4-bit codes, int8 for 8-bit codes
      MOE_CPU_DENSE_INPUT=$input run "1 stream, $input activations for every format" --prompt-len 64 --steps 64
      MOE_CPU_DENSE_INPUT=$input run "8 streams, $input activations for every format" --batch 8 --prompt-len 64 --steps 32
    done
    echo "### llama.cpp CPU build, same model, 2 threads pinned"
    timeout 90 $PIN $LLAMA -m $M -t 2 -p 64 -n 64 -r 5 -o md 2>&1 | tee "$OUT/llama.md"
    ;;
  tests)
    echo "### the kernels' unit tests on this CPU"
    [ -x $D/moe_kernels_tests ] || { echo "no $D/moe_kernels_tests staged: skipped"; continue; }
    timeout 150 $D/moe_kernels_tests --test-threads 8 > "$OUT/tests.log" 2>&1
    grep -E "test result|panicked|FAILED" "$OUT/tests.log"
    ;;
  *) echo "unknown part $PART (main | tests)"; exit 2 ;;
  esac
done
