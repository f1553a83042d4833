#!/usr/bin/env bash
# Placement checks on the H200 in one call: the live re-placement GPU tests, every other GPU test, then
# `bench skew` (a skewed synthetic router whose hot set moves halfway) at the Qwen3-30B-A3B shape with 32
# GPU experts per layer for uniform, frequency-from-a-file and live placement.
# Stage first: .device/moe-daemon and .device/gpu_tests (release builds); carry .device.
# Usage there: bash scripts/placement_gpu_session.sh [LAYERS] [quick]
#   WINDOW (env, default 50): steps per reported bench window.
#   LAYERS (default 12): decoder layers of the synthetic checkpoint, 1.2 GiB of bf16 experts each
#   (12: 15 GiB in /dev/shm; 24: 29 GiB; the engine's DRAM copy is as large again, so 48 layers
#   would need 114 GiB of the 128 GiB RAM: keep it at 24 or less).  quick: tests only (~3 min).
set -uo pipefail
cd "$(dirname "$0")/.."
L=${1:-12}
W=${WINDOW:-50}
OUT=${OUT:-/tmp/placement-gpu}; mkdir -p "$OUT"
export MOE_FIXTURES=$PWD/tests/fixtures RUST_BACKTRACE=1
echo "== live re-placement tests"
timeout 120 .device/gpu_tests live_ --test-threads 1 --nocapture > "$OUT/live_tests.log" 2>&1
echo "rc=$?"; grep -E "^test |panicked|test result|hit ratio|rel" "$OUT/live_tests.log" | tail -20
echo "== the other GPU tests"
timeout 240 .device/gpu_tests --skip live_ --test-threads 1 > "$OUT/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "^test |panicked|test result" "$OUT/gpu_tests.log" | tail -25
[ "${2:-}" = quick ] && exit 0
timeout 200 .device/moe-daemon bench synth-checkpoint --like qwen3-30b-a3b --layers "$L" --out /dev/shm/q3skew >/dev/null 2>&1
echo "synth qwen3-30b-a3b ($L layers) rc=$?"
for mode in uniform frequency live; do
    echo "== bench skew --mode $mode"
    timeout 240 .device/moe-daemon bench skew --model /dev/shm/q3skew --device cuda --gpu-experts 32 \
        --kv-cache-tokens 16384 --mode "$mode" --batch 8 --steps 1000 --window "$W" \
        > "$OUT/skew_$mode.log" 2>&1
    echo "rc=$?"
    grep -E "^mode|^steps|^ *[0-9]+-|GPU experts per layer|live moves|placement plan|after the shift|slowest step|no experts moved|rror|does not fit" "$OUT/skew_$mode.log"
done
rm -rf /dev/shm/q3skew
