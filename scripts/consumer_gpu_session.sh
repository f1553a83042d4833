#!/usr/bin/env bash
# Consumer-GPU checks on the H200 in one call: the dense-dtype / host-embedding / memory-plan GPU tests,
# then decode and prefill of SmallThinker-21B (full depth) and a GLM-4.5-Air shape (10 layers, fp8) with
# --gpu-memory-limit 24GiB and 16GiB, GPU memory used printed by each run.
# Stage first: .device/moe-daemon and .device/gpu_tests (release builds); carry .device.
# Usage there: bash scripts/consumer_gpu_session.sh [quick]   (quick: tests only, ~3 min)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/consumer-gpu}; mkdir -p "$OUT"
export MOE_FIXTURES=$PWD/tests/fixtures RUST_BACKTRACE=1
echo "== consumer_gpu tests"
timeout 240 .device/gpu_tests consumer_gpu --test-threads 1 --nocapture > "$OUT/consumer_tests.log" 2>&1
echo "rc=$?"; grep -E "^test |panicked|test result|: start|: peak|agreement|steps, mean" "$OUT/consumer_tests.log" | tail -30
echo "== the other GPU tests (bf16 KV cache)"
timeout 150 .device/gpu_tests --skip consumer_gpu --test-threads 1 > "$OUT/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "^test |panicked|test result" "$OUT/gpu_tests.log" | tail -12
[ "${1:-}" = quick ] && exit 0
run() {
    echo "== $*"
    timeout 170 .device/moe-daemon bench decode --steps 16 --prompt-len 32 --device cuda "$@" 2>&1 |
        grep -E "^prefill|^decode|per step|GPU memory|dense projections|rror|WARN|does not fit"
}
timeout 200 .device/moe-daemon bench synth-checkpoint --like smallthinker-21b --out /dev/shm/st21b >/dev/null 2>&1
echo "synth smallthinker-21b rc=$?"
{
    run --model /dev/shm/st21b --gpu-memory-limit 24GiB --gpu-experts auto --prefill-lens 4096 --chunk 2048
    run --model /dev/shm/st21b --gpu-memory-limit 16GiB --gpu-experts auto --prefill-lens 4096 --chunk 2048
    run --model /dev/shm/st21b --gpu-experts 0 --dense-dtype bf16
    run --model /dev/shm/st21b --gpu-experts 0 --dense-dtype int4 --host-embeddings on
    run --model /dev/shm/st21b --gpu-experts 0 --dense-dtype fp8 --host-embeddings on
} 2>&1 | tee "$OUT/bench_smallthinker.log"
rm -rf /dev/shm/st21b
timeout 150 .device/moe-daemon bench synth-checkpoint --like glm-4.5-air --layers 10 --dtype fp8 --out /dev/shm/glm >/dev/null 2>&1
echo "synth glm-4.5-air (10 layers, fp8) rc=$?"
{
    run --model /dev/shm/glm --gpu-memory-limit 24GiB --gpu-experts auto --prefill-lens 4096 --chunk 2048
    run --model /dev/shm/glm --gpu-memory-limit 16GiB --gpu-experts auto --prefill-lens 4096 --chunk 2048
    run --model /dev/shm/glm --gpu-experts 0 --dense-dtype bf16
    run --model /dev/shm/glm --gpu-experts 0 --dense-dtype int4 --host-embeddings on
} 2>&1 | tee "$OUT/bench_glm.log"
rm -rf /dev/shm/glm
