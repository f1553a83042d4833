#!/usr/bin/env bash
# The default model's shape (SmolLM2-135M-Instruct Q4_1: llama, hidden 576, 30 layers, 9/3 heads, FFN 1536,
# vocab 49152, tied Q8_0 embedding) on 2 cores of the H200 host, ours against llama.cpp's CPU build in the
# same call. Every timed run is pinned to CPUs 0,1 (`taskset -c 0,1`, 2 threads); llama.cpp is built first
# on all cores, before anything is measured. The GGUF is generated here (`make_gguf_llama.py`, random
# values, same tensor names, shapes and block types as the real file: the real one is too big to carry).
#   bash smollm2_on_device.sh main    ours decode 64 / prefill 64 (twice), 8 streams (AMX-INT8 from 8 rows,
#                                     the default), A/B runs (VNNI below 16 rows, or AMX-INT8 from 4 rows:
#                                     MOE_CPU_DENSE_AMX_INT_MIN_ROWS=0|4; prefill 64 on AMX-INT8 instead of
#                                     bf16-widened AMX; int8 pairs with residuals in outlier groups only, or
#                                     one int8 row, for every format: MOE_CPU_DENSE_INPUT=int8pair|int8),
#                                     llama.cpp pp64/tg64
#   bash smollm2_on_device.sh streams 1 and 8 streams in one process (`--batch 1,8`), three times, then
#                                     with AMX-INT8 off and with int8 activations for every format (~70 s;
#                                     no llama.cpp build)
#   bash smollm2_on_device.sh dense   the dense kernels alone on this model's shapes (cpu_dense_bench, Q4_1
#                                     projections and the Q8_0 lm_head, 1 / 4 / 8 / 16 / 64 rows; calls of 4–15
#                                     rows on VNNI, AMX-INT8 or bf16-widened AMX), 2 threads pinned
#   bash smollm2_on_device.sh tests   the kernels' unit tests on this CPU (AMX paths included)
# Staged in $D (relative to the working directory): moe-daemon, moe_kernels_tests, cpu_dense_bench, peers/ (the peer kit with
# kit/; else .device/peers); make_gguf_llama.py beside this script, with scripts/gguf_random.py of the tree it
# runs in or a copy beside them. Results to stdout and $OUT.
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
    MOE_CPU_DENSE_AMX_INT_MIN_ROWS=0 run "8 streams, VNNI below 16 rows (AMX-INT8 off)" --batch 8 --prompt-len 64 --steps 32
    MOE_CPU_DENSE_AMX_INT_MIN_ROWS=4 run "8 streams, AMX-INT8 from 4 rows" --batch 8 --prompt-len 64 --steps 32
    MOE_CPU_DENSE_AMX_MIN_ROWS=100000 MOE_CPU_DENSE_AMX_INT_MIN_ROWS=4 \
      run "prefill 64 on AMX-INT8 (no bf16 widening)" --prompt-len 64 --steps 8 --prefill-lens 64
    for input in int8pair int8; do  # the defaults: int8pair for 4-bit codes, int8pairall for 8-bit codes
      MOE_CPU_DENSE_INPUT=$input run "1 stream, $input activations for every format" --prompt-len 64 --steps 64
      MOE_CPU_DENSE_INPUT=$input run "8 streams, $input activations for every format" --batch 8 --prompt-len 64 --steps 32
    done
    echo "### llama.cpp CPU build, same model, 2 threads pinned"
    timeout 90 $PIN $LLAMA -m $M -t 2 -p 64 -n 64 -r 5 -o md 2>&1 | tee "$OUT/llama.md"
    ;;
  streams)
    # 1 and 8 streams in one process each (`--batch 1,8`: the same loaded model, so the ratio is not
    # split by call-to-call noise), three times, then on VNNI alone (AMX-INT8 off, as on a machine
    # without AMX) and with int8 activations for every format.
    pip install -q --no-index --no-deps --target /tmp/site $PEERS/kit/gguf-*.whl > /dev/null 2>&1
    [ -f $M ] || PYTHONPATH=/tmp/site timeout 60 python3 $HERE/make_gguf_llama.py --out $M
    for r in 1 2 3; do
      echo "### ours: 1 and 8 streams, run $r" | tee -a "$OUT/streams.md"
      timeout 60 $PIN $D/moe-daemon bench decode --model $M --cpu-threads 2 --batch 1,8 --prompt-len 64 --steps 32 2>&1 \
        | grep -E "^decode|per step|rror|panick" | tee -a "$OUT/streams.md"
    done
    # the build machine kind has no AMX: the VNNI kernels for every call below 16 rows
    echo "### ours: 1 and 8 streams, VNNI below 16 rows (AMX-INT8 off)" | tee -a "$OUT/streams.md"
    MOE_CPU_DENSE_AMX_INT_MIN_ROWS=0 timeout 60 $PIN $D/moe-daemon bench decode --model $M --cpu-threads 2 --batch 1,8 \
      --prompt-len 64 --steps 32 2>&1 | grep -E "^decode|per step|rror|panick" | tee -a "$OUT/streams.md"
    echo "### ours: 1 and 8 streams, int8 activations for every format" | tee -a "$OUT/streams.md"
    MOE_CPU_DENSE_INPUT=int8 timeout 60 $PIN $D/moe-daemon bench decode --model $M --cpu-threads 2 --batch 1,8 \
      --prompt-len 64 --steps 32 2>&1 | grep -E "^decode|per step|rror|panick" | tee -a "$OUT/streams.md"
    ;;
  dense)
    echo "### dense kernels alone, SmolLM2-135M shapes, 2 threads pinned"
    [ -x $D/cpu_dense_bench ] || { echo "no $D/cpu_dense_bench staged: skipped"; continue; }
    SHAPES=qkv=576x576+192x576+192x576,o=576x576,gate_up=1536x576+1536x576,down=576x1536
    # where each kernel pays: VNNI below 16 rows (default), AMX-INT8 from 4 rows, bf16-widened AMX from 4
    for ab in "0 16" "4 16" "0 4"; do
      read -r ai am <<< "$ab"
      echo "MOE_CPU_DENSE_AMX_INT_MIN_ROWS=$ai MOE_CPU_DENSE_AMX_MIN_ROWS=$am" | tee -a "$OUT/dense.md"
      MOE_CPU_DENSE_AMX_INT_MIN_ROWS=$ai MOE_CPU_DENSE_AMX_MIN_ROWS=$am timeout 60 $PIN $D/cpu_dense_bench --threads 2 \
        --ggml q4_1 --shapes $SHAPES --tokens 1,4,8,16,64 --input int8pair,int8 --iters 50 --probe-mib 256 2>&1 | tee -a "$OUT/dense.md"
      MOE_CPU_DENSE_AMX_INT_MIN_ROWS=$ai MOE_CPU_DENSE_AMX_MIN_ROWS=$am timeout 60 $PIN $D/cpu_dense_bench --threads 2 \
        --ggml q8_0 --shapes lm_head=49152x576 --tokens 1,8,16 --input int8pairall,int8 --iters 20 --probe-mib 256 2>&1 | tee -a "$OUT/dense.md"
    done
    ;;
  tests)
    echo "### the kernels' unit tests on this CPU"
    [ -x $D/moe_kernels_tests ] || { echo "no $D/moe_kernels_tests staged: skipped"; continue; }
    timeout 150 $D/moe_kernels_tests --test-threads 8 > "$OUT/tests.log" 2>&1
    grep -E "test result|panicked|FAILED" "$OUT/tests.log"
    ;;
  *) echo "unknown part $PART (main | streams | dense | tests)"; exit 2 ;;
  esac
done
