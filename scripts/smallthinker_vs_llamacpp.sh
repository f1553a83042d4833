#!/usr/bin/env bash
# SmallThinker-21B-A3B at full depth (52 layers, bf16, random weights) beside llama.cpp on the same GGUF
# file, in one device call: builds llama-bench with CUDA in the background (peer kit), writes the GGUF
# into /dev/shm (scripts/make_gguf_smallthinker.py), then
#   ours:      bench decode, all experts on the CPU (--gpu-experts 0) and --gpu-experts auto, prefill 512/4096
#   llama.cpp: llama-bench -ngl 99 -ncmoe 52 (all experts on the CPU), pp512 / tg128
# Needs: .device/moe-daemon (release build of this branch), .device/peers (a copy of /work/shared/peers).
# Every step has its own timeout; results go to stdout and $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/st-out}
mkdir -p "$OUT"
GGUF=${GGUF:-/dev/shm/st21.gguf}
THREADS=${THREADS:-16}
T0=$(date +%s)
log() { echo "[st +$(( $(date +%s) - T0 ))s] $*"; }

log "llama.cpp CUDA build in the background"
( KIT=$PWD/.device/peers/kit WORK=/tmp/peer-llama OUT=$OUT timeout 540 bash .device/peers/run_peer.sh check build \
    > "$OUT/peer_build.log" 2>&1; echo "rc=$?" >> "$OUT/peer_build.log" ) &
BUILD=$!

log "GGUF"
pip install --no-index --quiet --target /tmp/site .device/peers/kit/gguf-*.whl 2>/dev/null
PYTHONPATH=/tmp/site PEERS=.device/peers timeout 240 python3 scripts/make_gguf_smallthinker.py --out "$GGUF" \
    || { log "GGUF failed"; exit 1; }

D=.device/moe-daemon
log "ours: all experts on the CPU"
timeout 200 $D bench decode --model "$GGUF" --device cuda --gpu-experts 0 --steps 32 --prompt-len 64 \
    --prefill-lens 512,4096 --cpu-threads "$THREADS" 2>&1 | grep -v "^\s*$" | tail -25
log "ours: --gpu-experts auto"
timeout 150 $D bench decode --model "$GGUF" --device cuda --gpu-experts auto --steps 32 --prompt-len 64 \
    --cpu-threads "$THREADS" 2>&1 | grep -v "^\s*$" | tail -12

log "waiting for the llama.cpp build"
wait $BUILD; tail -3 "$OUT/peer_build.log"
B=/tmp/peer-llama/build/bin/llama-bench
if [ -x "$B" ]; then
  log "llama.cpp: all experts on the CPU"
  timeout 240 $B -m "$GGUF" -ngl 99 -ncmoe 52 -t "$THREADS" -p 512 -n 128 -r 2 -nopo 1 2>&1 | tail -8
else
  log "no llama-bench (see $OUT/peer_build.log)"
fi
rm -f "$GGUF"
log "done"
