#!/usr/bin/env bash
# A/B of two daemon builds on one synthetic Qwen3-30B-A3B-shape checkpoint, in one device call: the GPU
# test binary of the new build, then `bench decode` (with its `--prefill-lens` prefill, the same timing
# function as `bench prefill`) alternating the builds, base first, two rounds.
# Stage (docs/GPU.md): .device/moe-daemon (new), .device/moe-daemon.base (base), .device/gpu_tests (new);
# carry .device. Usage there: OUT=$OUT bash scripts/gpu_ab.sh [LAYERS]   (12 layers: ~6-8 min)
set -uo pipefail
cd "$(dirname "$0")/.."
L=${1:-12}
OUT=${OUT:-/tmp/gpu-ab}; mkdir -p "$OUT"
export MOE_FIXTURES=$PWD/tests/fixtures RUST_BACKTRACE=1
echo "== gpu_tests (new build)"
timeout 150 .device/gpu_tests --test-threads 1 --nocapture > "$OUT/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "^test |panicked|test result" "$OUT/gpu_tests.log" | tail -30
M=/dev/shm/q$L
timeout 240 .device/moe-daemon bench synth-checkpoint --like qwen3-30b-a3b --layers "$L" --out "$M" >/dev/null 2>&1
echo "synth ($L layers) rc=$?"
run() {  # run <build> <bench decode flags…>
    local bin=$1; shift
    echo "== $bin $*"
    timeout 100 ".device/$bin" bench decode --model "$M" --device cuda --prompt-len 32 "$@" 2>&1 |
        grep -E "^prefill|^decode|per step|rror|WARN|panicked"
}
for round in 1 2; do
    for bin in moe-daemon.base moe-daemon; do
        run "$bin" --steps 32 --gpu-experts 0 --prefill-lens 4096
        run "$bin" --steps 32 --gpu-experts 128
        run "$bin" --steps 16 --gpu-experts 32 --batch 8
    done
done 2>&1 | tee "$OUT/bench.log"
rm -rf "$M"
