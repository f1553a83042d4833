#!/usr/bin/env bash
# CPU-only decode / prefill on the H200 host against llama.cpp's CPU build, same call, 16 threads, on the
# 12-layer Qwen3-30B-A3B-shape GGUF (experts and dense weights in one type). Parts, several per call:
#   main    q8_0: our decode/prefill 512 (twice, then with the old dense path: MOE_CPU_DENSE_INPUT=bf16),
#           llama-bench pp512/tg64, the kernels' unit tests on this CPU (AMX paths included)
#   extra   q8_0: decode at a 4096-token context with the f16 and the f32 CPU KV cache, llama.cpp at depth
#           4096 (TABLES=1: also the dense GEMV and q8_0 expert benchmarks first)
#   q4k     q4_k (or $DTYPE when set to another type): our decode/prefill 512 (twice), llama-bench pp512/tg64
# One llama.cpp CPU build serves every part; it and the GGUFs the parts need are made first, side by side
# (each type in its own /dev/shm directory), and nothing is timed until all are done.
#   D=.device/BRANCH bash $D/cpu_path_on_device.sh extra q4k      # ~6 min on a fresh machine
# Staged in $D (relative to the working directory, default .device): moe-daemon, and for their parts
# cpu_dense_bench, cpu_moe_bench, moe_kernels_tests; peers/ (the peer kit: run_peer.sh,
# make_gguf_qwen3moe.py, kit/). Runs from the root of any checkout (it reads only $D). Every step has
# its own timeout; results go to stdout and $OUT.
set -uo pipefail
D=${D:-.device}
OUT=${OUT:-/tmp/cpu-path-out}; mkdir -p "$OUT"
PARTS=("$@"); [ ${#PARTS[@]} -gt 0 ] || PARTS=(main)
export LAYERS=12 CUDA=OFF JOBS=16
BUILD_WORK=/tmp/peer-cpu
LLAMA=$BUILD_WORK/build/bin/llama-bench
lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))'
echo 7000 > /proc/sys/vm/nr_hugepages 2>/dev/null || true

dtype_of() {  # the GGUF type a part measures: q8_0, or for q4k $DTYPE unless unset or q8_0
  case $1 in q4k) echo "${DTYPE:-q4_k}" | sed 's/^q8_0$/q4_k/' ;; *) echo q8_0 ;; esac
}
gen() {  # writes the GGUF of type $1 (its own work and model directory), path into /tmp/peer-gen-$1/model.path
  WORK=/tmp/peer-gen-$1 MODEL_DIR=/dev/shm/$1 DTYPE=$1 timeout 240 bash $D/peers/run_peer.sh gen \
    > "$OUT/gen_$1.log" 2>&1
  echo "gen $1 rc=$?" >> "$OUT/gen_$1.log"
}
model() { cat /tmp/peer-gen-$1/model.path; }

# llama.cpp's CPU-only build (skipped when already built) and the GGUFs, side by side.
(WORK=$BUILD_WORK timeout 300 bash $D/peers/run_peer.sh build > "$OUT/llama_build.log" 2>&1
 echo "llama build rc=$?" >> "$OUT/llama_build.log") &
PIDS=($!)
TYPES=$(for p in "${PARTS[@]}"; do dtype_of "$p"; done | sort -u)
for t in $TYPES; do mkdir -p /dev/shm/$t; gen "$t" & PIDS+=($!); done
wait "${PIDS[@]}"
tail -1 "$OUT/llama_build.log"; for t in $TYPES; do tail -1 "$OUT/gen_$t.log"; done

ours() {  # label file, then the bench arguments
  local file=$1; shift
  timeout 150 $D/moe-daemon bench decode --cpu-threads 16 "$@" 2>&1 \
    | grep -E "^prefill \(warm|^decode|per step|rror|panick" | tee -a "$OUT/$file"
}

for PART in "${PARTS[@]}"; do
  M=$(model "$(dtype_of "$PART")")
  echo "## part $PART on $M"
  case $PART in
  main)
    for run in 1 2 bf16; do
      echo "run $run" | tee -a "$OUT/ours.md"
      if [ $run = bf16 ]; then
        MOE_CPU_DENSE_INPUT=bf16 ours ours.md --model "$M" --steps 32 --prompt-len 32 --prefill-lens 512
      else
        ours ours.md --model "$M" --steps 32 --prompt-len 32 --prefill-lens 512
      fi
    done
    echo "## llama.cpp CPU-only, same model"
    timeout 100 $LLAMA -m "$M" -t 16 -ngl 0 -p 512 -n 64 -r 3 -o md 2>&1 | tee "$OUT/llama.md"
    echo "## kernels' unit tests"
    timeout 120 $D/moe_kernels_tests --test-threads 8 > "$OUT/tests.log" 2>&1
    grep -E "test result|panicked|FAILED" "$OUT/tests.log"
    ;;
  extra)
    if [ "${TABLES:-0}" = 1 ]; then
      echo "## dense GEMV (q8_0), 16 threads"
      timeout 90 $D/cpu_dense_bench --threads 16 --tokens 1,4 --iters 30 --probe-mib 2048 2>&1 | tee "$OUT/dense.md"
      echo "## q8_0 experts (int8g32) against int8, 16 threads"
      timeout 90 $D/cpu_moe_bench --experts 128 --topk 8 --hidden 2048 --inter 768 --layers 4 \
          --dtype int8g32,int8 --tokens 1,4,64 --threads 16 --iters 30 2>&1 | grep -E "DRAM|dtype|^\| 16 " | tee "$OUT/moe.md"
    fi
    echo "## ours at a 4096-token context: f16 KV (default), then f32 KV"
    for kv in f16 f32; do
      echo "kv $kv" | tee -a "$OUT/ours_ctx.md"
      ours ours_ctx.md --model "$M" --steps 16 --prompt-len 4096 --cpu-kv-dtype $kv
    done
    echo "## llama.cpp decode at depth 4096"
    timeout 120 $LLAMA -m "$M" -t 16 -ngl 0 -p 0 -n 32 -d 4096 -r 1 -o md 2>&1 | tee "$OUT/llama_ctx.md"
    ;;
  q4k)
    for run in 1 2; do
      echo "run $run" | tee -a "$OUT/ours_q4k.md"
      ours ours_q4k.md --model "$M" --steps 32 --prompt-len 32 --prefill-lens 512
    done
    echo "## llama.cpp CPU-only, same model"
    timeout 100 $LLAMA -m "$M" -t 16 -ngl 0 -p 512 -n 64 -r 3 -o md 2>&1 | tee "$OUT/llama_q4k.md"
    ;;
  *) echo "unknown part $PART (main | extra | q4k)"; exit 2 ;;
  esac
done
