#!/usr/bin/env bash
# Device-routed experts on the H200 in one call: the GPU tests of the path, then decode with the
# device-routed experts off (host-planned, the default) and on (MOE_DEVICE_ROUTED=1) in turn (A B A B, one process,
# same sequences: `bench decode --device-routed-ab 2`) on a 16-layer SmallThinker-21B-shape checkpoint
# with every expert resident (`--gpu-experts auto`) and with none (`0`: the path must not change), then
# an 8-layer Qwen3-30B-A3B-shape checkpoint with 64 of 128 experts per layer on the GPU.
#   OUT=$OUT D=.device/devroute BUDGET=230 bash $D/device_routed_session.sh
# Every step runs under its own timeout and stops being started once BUDGET seconds have passed.
# Checkpoints go to /dev/shm and are removed at the end.
set -uo pipefail
D=${D:-.device/devroute}
OUT=${OUT:-/tmp/devroute-out}
BUDGET=${BUDGET:-230}
THREADS=${THREADS:-16}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
step() {  # NAME TIMEOUT CMD...: runs CMD under min(TIMEOUT, budget left), output to $OUT/NAME.log
  local name=$1 t=$2
  shift 2
  local l
  l=$(left)
  if [ "$l" -le 10 ]; then
    echo "== $name: skipped (budget)"
    return
  fi
  [ "$t" -gt "$l" ] && t=$l
  echo "== $name (timeout ${t}s): $*"
  local t0
  t0=$(date +%s)
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  echo "   rc=$? in $(($(date +%s) - t0)) s"
}

export MOE_FIXTURES=${MOE_FIXTURES:-$PWD/tests/fixtures}
step gpu_tests 100 "$D/gpu_tests" --test-threads 1 routed_kernels device_routed live_move_keeps_logits
grep -E "^test |test result|rel-L2 vs host|routed kernels|live re-placement|panicked|argmax differs" "$OUT/gpu_tests.log" | tail -60

BENCH=(bench decode --device cuda --cpu-threads "$THREADS" --steps 32 --prompt-len 64 --device-routed-ab 2)
show() { grep -E "decode: batch|per step:|device-routed|GPU memory" "$OUT/$1.log"; }

step synth_st16 90 "$D/moe-daemon" bench synth-checkpoint --like smallthinker-21b --layers 16 --out /dev/shm/st16
step st16_auto 75 "$D/moe-daemon" "${BENCH[@]}" --model /dev/shm/st16 --gpu-experts auto
show st16_auto
step st16_dram 60 "$D/moe-daemon" "${BENCH[@]}" --model /dev/shm/st16 --gpu-experts 0
show st16_dram
rm -rf /dev/shm/st16

step synth_q8 60 "$D/moe-daemon" bench synth-checkpoint --like qwen3-30b-a3b --layers 8 --out /dev/shm/q8
step q8_gpu64 60 "$D/moe-daemon" "${BENCH[@]}" --model /dev/shm/q8 --gpu-experts 64
show q8_gpu64
rm -rf /dev/shm/q8
echo "total $(($(date +%s) - start)) s"
