#!/usr/bin/env bash
# Device-routed experts on the H200 in one call (~2.5 min): the GPU tests of the path and of the graphs
# it replays, then decode with the device-routed experts off (host-planned, `MOE_DEVICE_ROUTED=0`) and
# on (the default) in turn (A B A B, one process, same sequences: `bench decode --device-routed-ab N`)
# on a 16-layer SmallThinker-21B-shape checkpoint with every expert resident (`--gpu-experts auto`),
# with CUDA graphs (on: the whole layer stack of a step is one graph) and without (on: the same
# kernels, launched one by one), so the graph's share of the gain shows; then, budget allowing, with
# W8A16 dense projections (`--dense-dtype fp8`). ×52/16 for the real depth.
#   OUT=$OUT D=.device/devroute2 BUDGET=170 bash $D/device_routed_session.sh
# Every step runs under its own timeout and stops being started once BUDGET seconds have passed.
# The checkpoint goes to /dev/shm and is removed at the end. ROUNDS (default 3): A/B rounds.
set -uo pipefail
D=${D:-.device/devroute2}
OUT=${OUT:-/tmp/devroute-out}
BUDGET=${BUDGET:-170}
THREADS=${THREADS:-16}
ROUNDS=${ROUNDS:-3}
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
step gpu_tests 90 "$D/gpu_tests" --test-threads 1 --nocapture routed_kernels device_routed \
  live_move_keeps_logits cuda_graph_decode_matches_eager
grep -E "^test |test result|vs host-planned|routed kernels|SmallThinker-21B experts|whole-step|live re-placement|graphs vs eager|panicked|argmax differs|step [0-9]+: rel-L2" \
  "$OUT/gpu_tests.log" | tail -80

BENCH=(bench decode --device cuda --cpu-threads "$THREADS" --steps 32 --prompt-len 64 --device-routed-ab "$ROUNDS")
show() { grep -E "decode: batch|per step:|device-routed|GPU memory plan" "$OUT/$1.log"; }

step synth_st16 60 "$D/moe-daemon" bench synth-checkpoint --like smallthinker-21b --layers 16 --out /dev/shm/st16
step st16_graphs 45 "$D/moe-daemon" "${BENCH[@]}" --model /dev/shm/st16 --gpu-experts auto
show st16_graphs
step st16_eager 45 "$D/moe-daemon" "${BENCH[@]}" --model /dev/shm/st16 --gpu-experts auto --no-cuda-graphs
show st16_eager
# If the budget allows: the attention projections and lm_head through the W8A16 GEMVs instead of
# cuBLAS's one-row GEMMs (half the bytes): where a layer's non-expert GPU time goes.
step st16_fp8dense 40 "$D/moe-daemon" "${BENCH[@]}" --model /dev/shm/st16 --gpu-experts auto --dense-dtype fp8
show st16_fp8dense
rm -rf /dev/shm/st16
echo "total $(($(date +%s) - start)) s"
