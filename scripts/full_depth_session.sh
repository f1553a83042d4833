#!/usr/bin/env bash
# The full-depth hybrid figures beside llama.cpp in one device call, on ONE GGUF both read: the 48-layer
# Qwen3-30B-A3B shape (random weights, bf16 experts) written by the peer kit (`run_peer.sh gen`), then
#   llama-bench -ngl 99 -ncmoe 48 -t 16: pp512 / pp4096 / pp8192 and tg64 (op offload on, llama.cpp's default)
#   ours, every routed expert in DRAM, the defaults: decode (CUDA graphs) at batch 1, 8 and 32 with the DRAM
#   bound of the distinct experts each step reads, and prefill 512 / 4096 / 8192 (cold and warm; 512
#   splits each layer's DRAM experts between the GPU and the CPU, and is timed again with the split
#   paused, --split-ab), with bf16 experts (and the expert stream's profile, MOE_STREAM_PROFILE=1) and with
#   int8 experts (repacked from the same file at load; batch 1), with the decode switches of AB_INT8 (empty: none) A/B'd in
#   that process (`--ab`, default defer1: deferred experts' time and teacher-forced effect on the logits);
#   then, if time is left, bf16 with GPU64 routed experts per layer on the GPU (the mixed layer) and the
#   switches of AB_GPU64 A/B'd (default mixed-grouped,device-routed; empty: none), timed at GPU64_BATCHES.
#   Every run prints the hand-off profile
#   per MoE layer and the process's host memory by kind.
# Every step under its own timeout and a call deadline (BUDGET seconds; a step that would not end in time is
# skipped and says so). llama-bench is the packed CUDA build of an earlier call (LLAMA_PARTS), never built
# here. Ours needs about as much RAM as its experts beside the file: a step is skipped when MemAvailable is
# below what it needs (the file sits in /dev/shm when the peer kit finds room there, which RAM cannot reclaim).
#
# Layout (run from the repository root): $D/moe-daemon; the peer kit in $PEERS (.device/peers); the packed
# llama-bench in $LLAMA_PARTS (.device/seed-runs/llama). Usage there:
#   OUT=$OUT D=.device/main BUDGET=380 bash .device/main/full_depth_session.sh
set -uo pipefail
D=${D:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
MOE=$D/moe-daemon
PEERS=${PEERS:-$PWD/.device/peers}
LLAMA_PARTS=${LLAMA_PARTS:-$PWD/.device/seed-runs/llama}
OUT=${OUT:-/tmp/full-depth-out}
BUDGET=${BUDGET:-250}
LAYERS=${LAYERS:-48}
THREADS=${THREADS:-16}
PREFILL=${PREFILL:-512,4096,8192}
BATCHES=${BATCHES:-1,8,32}
AB_INT8=${AB_INT8:-defer1}
AB_GPU64=${AB_GPU64:-mixed-grouped,device-routed}
GPU64=${GPU64:-64}
GPU64_BATCHES=${GPU64_BATCHES:-1}
GPU64_NEEDS=${GPU64_NEEDS:-110}
LWORK=/tmp/peer-llama
LB=$LWORK/build/bin/llama-bench
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=$(( T0 + BUDGET ))
log() { echo "[full +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
fits() { [ "$(left)" -ge "$1" ] || { log "skipped (needs ~$1 s, $(left) s left)"; return 1; }; }
room_for() {  # GiB of MemAvailable a step needs
  local avail; avail=$(awk '/MemAvailable/ {print int($2/1048576)}' /proc/meminfo)
  [ "$avail" -ge "$1" ] || { log "only $avail GiB available, need $1: skipped"; return 1; }
}

# ours NAME TIMEOUT EXPECTED ARGS...: bench decode on the GGUF, its figures grepped
ours() {
  local name=$1 to=$2 expect=$3; shift 3
  fits "$expect" || return 0
  log "ours $name: $*"
  timeout "$to" "$MOE" bench decode --device cuda --cpu-threads "$THREADS" --model "$G" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "  rc=$?"
  grep -E "^loaded|^prefill|^decode|^DRAM|per step|by region|DRAM bound|expert stream:|expert GEMM|GPU memory:|hand-off|host memory|^A/B|^logits|rror|panick|does not fit" "$OUT/$name.log" \
    | sed 's/^/  /' | cut -c1-500
  free -g | sed -n 2p | sed 's/^/  /'
}

log "facts: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader); $(nproc) CPUs; $(free -g | awk '/Mem:/ {print $7}') GiB available; $(df -h /dev/shm /tmp | tail -2 | awk '{print $6 " " $4 " free"}' | tr '\n' ' ')"
mkdir -p "$LWORK/build/bin"
if cat "$LLAMA_PARTS"/llama-bench-cuda.tar.xz.part* | xz -d | tar -x -C "$LWORK/build/bin" && "$LB" --version > /dev/null 2>&1; then
  log "prebuilt llama-bench ready"
else
  log "no runnable llama-bench from $LLAMA_PARTS: llama.cpp steps skipped"
fi
log "generate the ${LAYERS}-layer bf16 GGUF (peer kit)"
KIT="$PEERS/kit" WORK=$LWORK OUT="$OUT/peer" LAYERS=$LAYERS DTYPE=bf16 timeout 150 bash "$PEERS/run_peer.sh" gen \
  > "$OUT/gen.log" 2>&1
echo "  rc=$?"; grep -E "generate|wrote|NOTE|error|Error" "$OUT/gen.log" | sed 's/^/  /'
G=$(cat "$LWORK/model.path" 2>/dev/null || true)
[ -n "$G" ] && [ -f "$G" ] || { log "no GGUF; stopping"; exit 1; }
free -g | sed -n 2p

if [ -x "$LB" ] && fits 90; then
  log "llama.cpp: -ngl 99 -ncmoe $LAYERS -t $THREADS -p $PREFILL -n 64 -r 1 -b 8192 -ub 4096"
  timeout 150 "$LB" -m "$G" -ngl 99 -ncmoe "$LAYERS" -t "$THREADS" -p "$PREFILL" -n 64 -r 1 -b 8192 -ub 4096 \
    -o md > "$OUT/llama.md" 2> "$OUT/llama.err"
  echo "  rc=$?"; grep -E "^\|" "$OUT/llama.md" | sed 's/^/  /'; tail -3 "$OUT/llama.err" | sed 's/^/  /'
fi

common=(--gpu-experts 0 --steps 32 --prompt-len 32 --prefill-lens "$PREFILL" --split-ab)
# bf16: the engine's packed experts (~55 GiB) beside the file
room_for 62 && MOE_STREAM_PROFILE=1 ours q3_L${LAYERS}_bf16 240 120 "${common[@]}" --batch "$BATCHES"
# int8: ~29 GiB of experts
ab_int8=(); [ -n "$AB_INT8" ] && ab_int8=(--ab "$AB_INT8" --ab-rounds 2)
room_for 36 && ours q3_L${LAYERS}_int8 200 80 "${common[@]}" --expert-dtype int8 "${ab_int8[@]}"
# the mixed layer: half the routed experts of each layer resident on the GPU, the rest in DRAM (~28 GiB)
ab_gpu64=(); [ -n "$AB_GPU64" ] && ab_gpu64=(--ab "$AB_GPU64" --ab-rounds 2)
room_for 34 && ours q3_L${LAYERS}_gpu$GPU64 180 "$GPU64_NEEDS" --gpu-experts "$GPU64" --steps 32 --prompt-len 32 \
  --batch "$GPU64_BATCHES" "${ab_gpu64[@]}"
rm -f "$G" "$G.done"
log "done"
