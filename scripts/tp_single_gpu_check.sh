#!/usr/bin/env bash
# Tensor parallelism on ONE GPU (loopback ranks): the tensor-parallel GPU tests, then every other GPU
# test once. Stage D/gpu_tests (dev profile). Usage there: D=.device/tensor-parallel bash $D/tp_single_gpu_check.sh
# Expected ~3.5 min (TP tests ~90-120 s: GQA, MLA, graphs, live moves, warm-up; the rest ~90 s).
set -uo pipefail
D=${D:-.device/tensor-parallel}
OUT=${OUT:-/tmp/tp-one}; mkdir -p "$OUT"
export MOE_FIXTURES=${MOE_FIXTURES:-$PWD/tests/fixtures} RUST_BACKTRACE=1
echo "libnccl entries in ldconfig: $(ldconfig -p | grep -c nccl)"
timeout 300 "$D/gpu_tests" tensor_parallel --test-threads 1 --nocapture > "$OUT/tp.log" 2>&1
echo "tensor-parallel tests rc=$?"
grep -E '^test |panicked|test result|skipped' "$OUT/tp.log"
grep -A12 panicked "$OUT/tp.log" | head -40
echo "worst steps (rel-L2 vs one GPU first):"
grep 'rel-L2' "$OUT/tp.log" \
    | awk '{for(i=1;i<=NF;i++) if($i=="GPU"){v=$(i+1); sub(",","",v); print v, $0}}' | sort -g | tail -4
echo "rel-L2 lines: $(grep -c 'rel-L2' "$OUT/tp.log")"
timeout 300 "$D/gpu_tests" --skip tensor_parallel --test-threads 1 > "$OUT/all.log" 2>&1
echo "other GPU tests rc=$?"
grep -E '^test |panicked|test result' "$OUT/all.log" | tail -40
grep -A12 panicked "$OUT/all.log" | head -30
