#!/usr/bin/env bash
# One GPU-machine session in one call (device time is scarce): the GPU checks, then the benchmarks of
# docs/PERF.md on a synthetic Qwen3-30B-A3B-shape checkpoint and a GLM-4.5-Air-shape one.
# Stage first (docs/GPU.md): .device/moe-daemon and .device/gpu_tests, stripped; carry .device.
# Usage there: bash scripts/gpu_session.sh [LAYERS]   (6 layers: ~2 min; 48 layers: the synth takes ~3.5 min)
set -uo pipefail
cd "$(dirname "$0")/.."
L=${1:-6}
OUT=${OUT:-/tmp/gpu-session}; mkdir -p "$OUT"
export MOE_FIXTURES=$PWD/tests/fixtures RUST_BACKTRACE=1
echo "== gpu_tests"
timeout 90 .device/gpu_tests --test-threads 1 --nocapture > "$OUT/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "^test |panicked|test result" "$OUT/gpu_tests.log" | tail -20
timeout 300 .device/moe-daemon bench synth-checkpoint --like qwen3-30b-a3b --layers "$L" --out /dev/shm/q3 >/dev/null 2>&1
echo "synth q3 ($L layers) rc=$?"
run() {
    echo "== $*"
    timeout 120 .device/moe-daemon bench decode --steps 16 --prompt-len 32 --device cuda "$@" 2>&1 |
        grep -E "^prefill|^decode|per step|rror|WARN"
}
{
    run --model /dev/shm/q3 --gpu-experts 0 --prefill-lens 4096,8192
    run --model /dev/shm/q3 --gpu-experts 0
    run --model /dev/shm/q3 --gpu-experts 0 --expert-dtype int8
    for g in 32 64 128; do run --model /dev/shm/q3 --gpu-experts "$g"; done
} 2>&1 | tee "$OUT/bench.log"
rm -rf /dev/shm/q3
timeout 120 .device/moe-daemon bench synth-checkpoint --like glm-4.5-air --layers 4 --dtype fp8 --out /dev/shm/glm >/dev/null 2>&1
echo "synth glm rc=$?"
run --model /dev/shm/glm --gpu-experts 64 --expert-dtype int8 --prefill-lens 4096 | tee "$OUT/bench_glm.log"
rm -rf /dev/shm/glm
