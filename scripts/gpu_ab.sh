#!/usr/bin/env bash
# A/B of two daemon builds in one device call: the GPU test binary of the new build (extra arguments in
# GPU_TEST_ARGS, e.g. "--skip dense_dtypes"), both builds' logits compared bit for bit on fixtures, then
# on one synthetic Qwen3-30B-A3B-shape checkpoint `bench decode` (with its `--prefill-lens` prefill, the
# same timing function as `bench prefill`) alternating the builds, base first, two rounds.
# Stage (docs/GPU.md): .device/moe-daemon (new), .device/moe-daemon.base (base), .device/gpu_tests (new);
# carry .device. Usage there: OUT=$OUT bash scripts/gpu_ab.sh [LAYERS]   (12 layers: ~7-9 min)
set -uo pipefail
cd "$(dirname "$0")/.."
L=${1:-12}
OUT=${OUT:-/tmp/gpu-ab}; mkdir -p "$OUT"
export MOE_FIXTURES=$PWD/tests/fixtures RUST_BACKTRACE=1
echo "== gpu_tests (new build)"
# shellcheck disable=SC2086 # GPU_TEST_ARGS holds several arguments
timeout 200 .device/gpu_tests --test-threads 1 --nocapture ${GPU_TEST_ARGS:-} > "$OUT/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "^test |panicked|test result" "$OUT/gpu_tests.log" | tail -30
echo "== logits of both builds, bit for bit (fixtures; 4 GPU experts; decode, then a layerwise prompt)"
P40=$(seq -s, 1 40)
for fx in qwen3_moe qwen2_moe deepseek_v3 glm4_moe smallthinker; do
    for mode in "decode:1,2,3,4,5" "layerwise:$P40"; do
        ids=${mode#*:}; extra=""; [ "${mode%%:*}" = layerwise ] && extra="--gpu-prefill-threshold 16"
        for bin in moe-daemon.base moe-daemon; do
            timeout 60 ".device/$bin" generate --model "tests/fixtures/$fx/model_bf16" --device cuda \
                --gpu-experts 4 $extra --prompt-ids "$ids" --max-tokens 12 --ignore-eos \
                --logits-out "$OUT/$fx.${mode%%:*}.$bin.json" >/dev/null 2>"$OUT/$fx.${mode%%:*}.$bin.err" ||
                echo "$fx ${mode%%:*} $bin: rc=$? ($(tail -1 "$OUT/$fx.${mode%%:*}.$bin.err"))"
        done
        python3 - "$OUT/$fx.${mode%%:*}.moe-daemon.base.json" "$OUT/$fx.${mode%%:*}.moe-daemon.json" <<'PY'
import json, sys
try:
    a, b = (json.load(open(f))["steps"] for f in sys.argv[1:3])
except Exception as e:
    print(sys.argv[2], "unreadable:", e); sys.exit()
fa = [x for s in a for x in (s["logits"] if isinstance(s, dict) else s)]
fb = [x for s in b for x in (s["logits"] if isinstance(s, dict) else s)]
d = max((abs(x - y) for x, y in zip(fa, fb)), default=float("nan"))
same = len(fa) == len(fb) and fa == fb
print(sys.argv[2].split("/")[-1].rsplit(".", 2)[0], "identical" if same else f"DIFFER: max |diff| {d:.3e} over {len(fa)} values")
PY
    done
done
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
    done
done 2>&1 | tee "$OUT/bench.log"
rm -rf "$M"
