#!/usr/bin/env bash
# Long-prefill attention on the H200 in one device call: the fused kernel's GPU tests (against the host
# reference and the GEMM path it replaces, and the engine's long-prefill test through it), then prefill
# 4096 and 8192 of an 8-layer Qwen3-30B-A3B-shape synth, every routed expert in DRAM, with the fused
# kernel (MOE_FLASH_PREFILL=1, the default) and with the GEMM path (=0), expert stream profile on
# (MODES="1 0 w8" adds the fused kernel in blocks of 8 warps).
#
#   D=.device/fa8 OUT=$OUT bash .device/fa8/flash_prefill_ab.sh
# D holds the staged `gpu_tests` (dev profile) and `moe-daemon` (release); run from the repository root.
set -u
D=${D:?directory of the staged binaries}
OUT=${OUT:?directory for the logs}
MODEL=${MODEL:-/dev/shm/q3fa}
LENS=${LENS:-4096,8192}

MOE_FIXTURES=$PWD/tests/fixtures timeout "${TEST_TIMEOUT:-150}" "$D/gpu_tests" flash_prefill \
    long_prefill_gemm_attention_and_expert_stream --test-threads 1 --nocapture >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E '^test |panicked|test result|worst rel-L2|flash_prefill [0-9]|rel-L2 vs CPU' "$OUT/tests.log" | tail -40

if [ ! -f "$MODEL/config.json" ]; then
    t=$(date +%s)
    timeout 150 "$D/moe-daemon" bench synth-checkpoint --like qwen3-30b-a3b --layers 8 --out "$MODEL" \
        >"$OUT/synth.log" 2>&1
    echo "synth rc=$? in $(($(date +%s) - t)) s"
fi
for flash in ${MODES:-1 0}; do
    t=$(date +%s)
    MOE_FLASH_PREFILL=$flash MOE_STREAM_PROFILE=1 timeout "${BENCH_TIMEOUT:-150}" "$D/moe-daemon" bench decode \
        --model "$MODEL" --device cuda --gpu-experts 0 --prefill-lens "$LENS" --steps 4 \
        >"$OUT/bench_flash$flash.log" 2>&1
    echo "== MOE_FLASH_PREFILL=$flash rc=$? in $(($(date +%s) - t)) s"
    grep -iE 'prefill|stream|main stream|copied|loaded|decode:' "$OUT/bench_flash$flash.log" | cut -c1-400 | tail -30
done
rm -rf "$MODEL"
