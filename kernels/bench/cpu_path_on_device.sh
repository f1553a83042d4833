#!/usr/bin/env bash
# CPU-only decode / prefill on the H200 host against llama.cpp's CPU build, same call, 16 threads, on the
# 12-layer Qwen3-30B-A3B-shape q8_0 GGUF.
#   bash cpu_path_on_device.sh main    llama.cpp build, our decode/prefill (twice, then with the old dense
#                                       path: MOE_CPU_DENSE_INPUT=bf16), llama-bench pp512/tg64, the
#                                       kernels' unit tests on this CPU (AMX paths included)
#   bash cpu_path_on_device.sh extra   decode at a 4096-token context with the f16 and the f32 CPU KV cache,
#                                       llama.cpp at depth 4096 (TABLES=1: also the dense GEMV and q8_0
#                                       expert benchmarks first)
#   DTYPE=q4_k bash cpu_path_on_device.sh q4k   the same model with Q4_K experts and dense weights: ours
#                                       decode/prefill 512 (twice), llama-bench pp512/tg64
# Staged in $D (default .device/): moe-daemon, cpu_dense_bench, cpu_moe_bench, moe_kernels_tests, peers/
# (the peer kit with kit/). Every step has its own timeout; results go to stdout and $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:-main}
D=${D:-.device}
OUT=${OUT:-/tmp/cpu-path-out}; mkdir -p "$OUT"
export WORK=/tmp/peer-cpu LAYERS=12 DTYPE=${DTYPE:-q8_0} MODEL_DIR=/dev/shm CUDA=OFF JOBS=16
lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))'
echo 7000 > /proc/sys/vm/nr_hugepages 2>/dev/null || true

# llama.cpp's CPU-only build (skipped when already built) overlaps only the GGUF generation: nothing is
# measured until both are done.
(timeout 300 bash $D/peers/run_peer.sh build > "$OUT/llama_build.log" 2>&1; echo "llama build rc=$?" >> "$OUT/llama_build.log") &
BUILD=$!
timeout 120 bash $D/peers/run_peer.sh gen > "$OUT/gen.log" 2>&1; echo "gen rc=$?"
M=$(cat $WORK/model.path)
wait $BUILD; tail -2 "$OUT/llama_build.log"
LLAMA=$WORK/build/bin/llama-bench

if [ "$PART" = main ]; then
  echo "## ours: bench decode (twice), then the old dense path (MOE_CPU_DENSE_INPUT=bf16) once"
  for run in 1 2 bf16; do
    if [ $run = bf16 ]; then export MOE_CPU_DENSE_INPUT=bf16; fi
    echo "run $run"
    timeout 120 $D/moe-daemon bench decode --model "$M" --steps 32 --prompt-len 32 --prefill-lens 512 \
        --cpu-threads 16 2>&1 | grep -E "^prefill \(warm|^decode|per step|rror|panick" | tee -a "$OUT/ours.md"
  done
  unset MOE_CPU_DENSE_INPUT
  echo "## llama.cpp CPU-only, same model"
  timeout 100 $LLAMA -m "$M" -t 16 -ngl 0 -p 512 -n 64 -r 3 -o md 2>&1 | tee "$OUT/llama.md"
  echo "## kernels' unit tests"
  timeout 120 $D/moe_kernels_tests --test-threads 8 > "$OUT/tests.log" 2>&1
  grep -E "test result|panicked|FAILED" "$OUT/tests.log"
elif [ "$PART" = q4k ]; then
  echo "## ours on $M: bench decode (twice)"
  for run in 1 2; do
    timeout 120 $D/moe-daemon bench decode --model "$M" --steps 32 --prompt-len 32 --prefill-lens 512 \
        --cpu-threads 16 2>&1 | grep -E "^prefill \(warm|^decode|per step|rror|panick" | tee -a "$OUT/ours_q4k.md"
  done
  echo "## llama.cpp CPU-only, same model"
  timeout 100 $LLAMA -m "$M" -t 16 -ngl 0 -p 512 -n 64 -r 3 -o md 2>&1 | tee "$OUT/llama_q4k.md"
elif [ "${TABLES:-0}" = 1 ]; then
  echo "## dense GEMV (q8_0), 16 threads"
  timeout 90 $D/cpu_dense_bench --threads 16 --tokens 1,4 --iters 30 --probe-mib 2048 2>&1 | tee "$OUT/dense.md"
  echo "## q8_0 experts (int8g32) against int8, 16 threads"
  timeout 90 $D/cpu_moe_bench --experts 128 --topk 8 --hidden 2048 --inter 768 --layers 4 \
      --dtype int8g32,int8 --tokens 1,4,64 --threads 16 --iters 30 2>&1 | grep -E "DRAM|dtype|^\| 16 " | tee "$OUT/moe.md"
fi
if [ "$PART" = extra ]; then
  echo "## ours at a 4096-token context: f16 KV (default), then f32 KV"
  for kv in f16 f32; do
    timeout 150 $D/moe-daemon bench decode --model "$M" --steps 16 --prompt-len 4096 --cpu-threads 16 \
        --cpu-kv-dtype $kv 2>&1 | grep -E "^decode|per step|rror|panick" | sed "s/^/kv $kv: /" | tee -a "$OUT/ours_ctx.md"
  done
  echo "## llama.cpp decode at depth 4096"
  timeout 120 $LLAMA -m "$M" -t 16 -ngl 0 -p 0 -n 32 -d 4096 -r 1 -o md 2>&1 | tee "$OUT/llama_ctx.md"
fi
