#!/usr/bin/env bash
# A/B of two daemon builds in one device call: the GPU test binary of the new build (extra arguments in
# GPU_TEST_ARGS, e.g. "--skip dense_dtypes"; SKIP_TESTS=1 skips it), both builds' logits compared bit for
# bit on fixtures (SKIP_LOGITS=1 skips it), then on one synthetic Qwen3-30B-A3B-shape checkpoint
# `bench decode` (with its `--prefill-lens` prefill, the same timing function as `bench prefill`)
# alternating the builds, base first, ROUNDS rounds (default 2); then the new build once per entry of
# NEW_VARIANTS (';'-separated flag sets, e.g. "--defer-experts 1;--defer-experts 2").
# Binaries: $D/moe-daemon (new), $BASE (default $D/moe-daemon.base), $D/gpu_tests (new); D defaults to
# .device. Usage there: OUT=$OUT D=.device/x BASE=.device/y/moe-daemon bash scripts/gpu_ab.sh [LAYERS]
# (12 layers, 2 rounds: ~7-9 min; 8 layers, 1 round, SKIP_LOGITS=1: ~3 min).
set -uo pipefail
# from the repository root (the device copies this script next to the binaries)
[ -d tests/fixtures ] || cd "$(dirname "$0")/.."
L=${1:-12}
D=${D:-.device}
NEW=$D/moe-daemon
BASE=${BASE:-$D/moe-daemon.base}
ROUNDS=${ROUNDS:-2}
DECODE_FLAGS=${DECODE_FLAGS:-}
OUT=${OUT:-/tmp/gpu-ab}; mkdir -p "$OUT"
export MOE_FIXTURES=$PWD/tests/fixtures RUST_BACKTRACE=1
if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== gpu_tests (new build)"
    # shellcheck disable=SC2086 # GPU_TEST_ARGS holds several arguments
    timeout "${TEST_TIMEOUT:-200}" "$D/gpu_tests" --test-threads 1 --nocapture ${GPU_TEST_ARGS:-} > "$OUT/gpu_tests.log" 2>&1
    echo "rc=$?"; grep -E "^test |panicked|test result|^deferred experts" "$OUT/gpu_tests.log" | tail -40
fi
if [ -z "${SKIP_LOGITS:-}" ]; then
    echo "== logits of both builds, bit for bit (fixtures; 4 GPU experts; decode, then a layerwise prompt)"
    P40=$(seq -s, 1 40)
    for fx in qwen3_moe qwen2_moe deepseek_v3 glm4_moe smallthinker; do
        for mode in "decode:1,2,3,4,5" "layerwise:$P40"; do
            ids=${mode#*:}; extra=""; [ "${mode%%:*}" = layerwise ] && extra="--gpu-prefill-threshold 16"
            for bin in "$BASE" "$NEW"; do
                tag=$([ "$bin" = "$NEW" ] && echo new || echo base)
                timeout 60 "$bin" generate --model "tests/fixtures/$fx/model_bf16" --device cuda \
                    --gpu-experts 4 $extra --prompt-ids "$ids" --max-tokens 12 --ignore-eos \
                    --logits-out "$OUT/$fx.${mode%%:*}.$tag.json" >/dev/null 2>"$OUT/$fx.${mode%%:*}.$tag.err" ||
                    echo "$fx ${mode%%:*} $tag: rc=$? ($(tail -1 "$OUT/$fx.${mode%%:*}.$tag.err"))"
            done
            python3 - "$OUT/$fx.${mode%%:*}.base.json" "$OUT/$fx.${mode%%:*}.new.json" <<'PY'
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
fi
M=/dev/shm/q$L
timeout 240 "$NEW" bench synth-checkpoint --like qwen3-30b-a3b --layers "$L" --out "$M" >/dev/null 2>&1
echo "synth ($L layers) rc=$?"
run() {  # run <binary> <bench decode flags…>
    local bin=$1; shift
    echo "== $([ "$bin" = "$NEW" ] && echo new || echo base) $*"
    # shellcheck disable=SC2086 # DECODE_FLAGS holds several arguments
    timeout 100 "$bin" bench decode --model "$M" --device cuda --prompt-len 32 $DECODE_FLAGS "$@" 2>&1 |
        grep -E "^prefill|^decode|per step|region|rror|WARN|panicked"
}
{
    for _ in $(seq "$ROUNDS"); do
        for bin in "$BASE" "$NEW"; do
            run "$bin" --steps 32 --gpu-experts 0 --prefill-lens "${PREFILL_LENS:-4096}"
            [ -n "${SKIP_GPU128:-}" ] || run "$bin" --steps 32 --gpu-experts 128
        done
    done
    IFS=';' read -ra variants <<< "${NEW_VARIANTS:-}"
    for v in "${variants[@]}"; do
        # shellcheck disable=SC2086 # a variant holds several arguments
        run "$NEW" --steps 32 --gpu-experts 0 $v
    done
} 2>&1 | tee "$OUT/bench.log"
rm -rf "$M"
