#!/usr/bin/env bash
# The seeds' setups on the H200 machine, ours beside llama.cpp in the same call, every step under its own
# timeout and a phase deadline (steps that would not finish in time are skipped and say so):
#
#   a  SmallThinker-21B-A3B at full depth (52 layers), one bf16 GGUF in /dev/shm (40 GiB) read by both:
#      ours with all experts on the CPU (--gpu-experts 0) and with --gpu-experts auto, decode and prefill
#      512 / 4096; llama-bench -ngl 99 -ncmoe 52 (experts on the CPU) and, time allowing, -ncmoe 0.
#   b  Consumer-GPU budgets with quantized dense weights, beside llama-bench with its quantized dense weights on
#      the GPU and every expert on the CPU (-ot exps=CPU), in this order (later steps skipped when out of time):
#      a GLM-4.5-Air-shape GGUF of GLM_LAYERS layers (Q4_0 experts, Q4_K dense, Q6_K output; Q8_0 where rows
#      are not whole Q4_K blocks): ours int4 at 24GiB, int4 at 16GiB, fp8 at 16GiB (host embeddings; GPU
#      experts per layer as the full-depth plan); then SmallThinker-21B (bf16 experts, Q4_K dense, Q6_K output,
#      38 GiB): ours int4 at 24GiB and fp8 at 16GiB with --gpu-experts auto; then (B_MODELS with "stq")
#      SmallThinker-21B as llama-quantize Q4_K_M leaves it (12 GiB): ours int4 at 24 and 16 GiB.
#   c  Early routing on the CUDA backend (SmallThinker routes from the layer input): a 16-layer
#      SmallThinker-21B-shape checkpoint, decode with every expert in DRAM, routing after attention
#      (--expert-prefetch-mib 0) against early routing with the chosen experts prefetched while attention
#      runs (32 MiB per layer), two rounds each (A B A B). scripts/hybrid_session.sh does the same beside
#      the decode launch order and the long-prefill profile.
#   p  Page backing of the packed experts: bench cpu-moe at SmallThinker-21B's expert shape on reserved 2 MiB
#      pages (reserved first, while memory is unfragmented); a P_LAYERS-layer (52) SmallThinker-21B in bf16 in
#      /dev/shm (40 GiB: a GGUF from make_gguf_smallthinker.py, or P_SOURCE=synth for bench synth-checkpoint's
#      safetensors, ~0.3 GB/s); decode with every expert in DRAM on those reserved pages (--hugepages 2M),
#      then on transparent huge pages only (--hugepages thp, reserved pages released); then, time allowing,
#      bench cpu-moe and decode on 4 KiB pages (--hugepages off) and decode at a 24 GiB GPU budget. Each load
#      logs what backs the experts ("packed DRAM experts: ..."), each decode is timed twice on the same load
#      (--batch 1,1). Needs root for /proc/sys/vm/nr_hugepages.
#
# GPU memory: ours prints its plan and peak; for both, a sampler records nvidia-smi's memory.used.
# llama.cpp: built here with CUDA from the peer kit in the background (its processes are stopped while our
# timed steps run and continued after), or reused from /tmp/peer-llama (a warm machine) or from
# $LLAMA_PARTS/llama-bench-cuda.tar.xz.part* (default $SEED/llama; packed into $OUT/llama/ by a run that
# built it).
#
# Layout on the device (run from the repository root):
#   $SEED (default: this script's folder): moe-daemon, make_gguf_smallthinker.py, make_gguf_glm4moe.py and
#   the module they share, gguf_random.py
#   $PEERS (default .device/peers): the peer kit (run_peer.sh, kit/ with the gguf wheel)
# Usage: OUT=$OUT bash seed_runs.sh a b          (or one phase per call: a, then b; B_MODELS="glm" or "st"
#        runs one of phase b's two models, LLAMA_PARTS=DIR takes the packed llama-bench from DIR)
set -uo pipefail
SEED=${SEED:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
MOE=${MOE:-$SEED/moe-daemon}
PEERS=${PEERS:-$PWD/.device/peers}
OUT=${OUT:-/tmp/seed-out}
THREADS=${THREADS:-16}
SHM=${SHM:-/dev/shm}
A_BUDGET=${A_BUDGET:-280}       # seconds for phase a
B_BUDGET=${B_BUDGET:-210}       # seconds for phase b
C_BUDGET=${C_BUDGET:-150}       # seconds for phase c
P_BUDGET=${P_BUDGET:-170}       # seconds for phase p
GLM_LAYERS=${GLM_LAYERS:-16}
B_MODELS=${B_MODELS:-glm st}    # phase b's models, in order (glm: GLM-4.5-Air shape; st: SmallThinker-21B;
                                # stq: SmallThinker-21B Q4_K_M, not run unless named)
GEN_EXTRA=${GEN_EXTRA:-}        # smoke test: GEN_EXTRA="--layers 1 --vocab 4096" ROOM_CHECK=0
ROOM_CHECK=${ROOM_CHECK:-1}
LLAMA_PARTS=${LLAMA_PARTS:-$SEED/llama}
LWORK=/tmp/peer-llama
LB=$LWORK/build/bin/llama-bench
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[seed +$(( $(date +%s) - T0 ))s] $*"; }
DEADLINE=$T0
left() { echo $(( DEADLINE - $(date +%s) )); }
# fits SECONDS: true when a step expected to take SECONDS still ends before the phase deadline
fits() { [ "$(left)" -ge "$1" ] || { log "skipped (needs ~$1 s, $(left) s left)"; return 1; }; }
# a run is started when half its timeout is left (the timeout is its worst case)
fits_run() { fits $(( $1 / 2 )); }

facts() {
  log "facts"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  nproc; free -g | head -2; df -h /tmp "$SHM" | tail -2
  ls -la "$MOE" "$SEED"/*.py "$LB" 2>&1 | sed 's/^/  /'
}

gguf_env() {
  if [ ! -d /tmp/seed-site/gguf ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/seed-site "$PEERS"/kit/gguf-*.whl
  fi
  export PYTHONPATH=/tmp/seed-site PEERS
}

# --- llama.cpp: build in the background, pausable --------------------------------------------------------
BUILD_SID=""
llama_start() {
  [ -x "$LB" ] && { log "llama-bench already here"; return 0; }
  local parts; parts=$(ls "$LLAMA_PARTS"/llama-bench-cuda.tar.xz.part* 2>/dev/null || true)
  if [ -n "$parts" ]; then
    mkdir -p "$LWORK/build/bin"
    cat $parts | xz -d | tar -x -C "$LWORK/build/bin" && "$LB" --version > /dev/null 2>&1 \
      && { log "prebuilt llama-bench"; return 0; }
    rm -f "$LB"; log "prebuilt llama-bench does not run here; building"
  fi
  log "llama.cpp CUDA build in the background (stopped while our timed steps run)"
  setsid env KIT="$PEERS/kit" WORK="$LWORK" OUT="$OUT" BUILD_TIMEOUT=560 \
    bash "$PEERS/run_peer.sh" build > "$OUT/llama_build.log" 2>&1 &
  BUILD_SID=$!
}
build_signal() {  # STOP or CONT every process of the build's session (twice: catches a fork in between)
  [ -n "$BUILD_SID" ] || return 0
  local i p
  for i in 1 2; do
    p=$(ps -o pid= -s "$BUILD_SID" 2>/dev/null | tr '\n' ' ')
    [ -n "${p// /}" ] && kill -"$1" $p 2>/dev/null
  done
  return 0
}
llama_ready() {
  if [ -n "$BUILD_SID" ]; then
    build_signal CONT; log "waiting for the llama.cpp build"
    wait "$BUILD_SID"; tail -4 "$OUT/llama_build.log"; BUILD_SID=""
    [ -x "$LB" ] && pack_llama
  fi
  [ -x "$LB" ] || { log "no llama-bench (see $OUT/llama_build.log)"; return 1; }
}
pack_llama() {  # so a fresh machine can skip the build: carry these parts as $SEED/llama/
  mkdir -p "$OUT/llama"
  ( strip "$LB" 2>/dev/null; tar -C "$LWORK/build/bin" -cf - llama-bench | xz -T0 -3 \
      | split -b 15M -d - "$OUT/llama/llama-bench-cuda.tar.xz.part" ) && ls -la "$OUT/llama" | tail -n +2
}

# --- GPU memory sampler ----------------------------------------------------------------------------------
SAMPLER=""
sampler_start() {
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/.gpumem" 2>/dev/null &
  SAMPLER=$!
}
sampler_stop() {  # NAME
  [ -n "$SAMPLER" ] && { kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null; }
  SAMPLER=""
  local base peak
  base=$(grep -E '^[0-9]+$' "$OUT/.gpumem" | head -1); peak=$(grep -E '^[0-9]+$' "$OUT/.gpumem" | sort -n | tail -1)
  echo "  $1: nvidia-smi memory.used peak ${peak:-?} MiB (at start ${base:-?} MiB)" | tee -a "$OUT/gpu_memory.txt"
}

# --- the runs ---------------------------------------------------------------------------------------------
# ours NAME TIMEOUT ARGS...: bench decode; the llama.cpp build is stopped from "loaded" (load done) to exit
ours() {
  local name=$1 to=$2; shift 2
  fits_run "$to" || return 0
  log "ours $name: $*"
  sampler_start
  timeout "$to" "$MOE" bench decode --device cuda --cpu-threads "$THREADS" "$@" \
    2> >(while IFS= read -r l; do
           printf '%s\n' "$l" >> "$OUT/$name.err"
           case $l in "loaded "*) build_signal STOP ;; esac
         done) > "$OUT/$name.log"
  local rc=$?
  build_signal CONT
  sampler_stop "$name"
  sleep 0.2
  echo "  rc=$rc"
  grep -hE "^loaded|dense projections|GPU memory plan|^  (attention|dense MLP|shared experts|lm_head|embeddings|GPU experts|KV cache|activations) |GPU memory at start|^prefill|^decode|per step|early routing|GPU memory:|packed DRAM experts|DRAM read bandwidth|DRAM bound|rror|panick|does not fit" \
    "$OUT/$name.err" "$OUT/$name.log" | sed 's/^/  /' | cut -c1-400
}

# llama NAME TIMEOUT ARGS...: llama-bench (markdown table)
llama() {
  local name=$1 to=$2; shift 2
  fits_run "$to" || return 0
  [ -x "$LB" ] || { log "llama $name skipped: no llama-bench"; return 0; }
  log "llama.cpp $name: $*"
  sampler_start
  timeout "$to" "$LB" -t "$THREADS" -o md "$@" > "$OUT/$name.md" 2> "$OUT/$name.err"
  local rc=$?
  sampler_stop "$name"
  echo "  rc=$rc"; grep -E "^\|" "$OUT/$name.md" | sed 's/^/  /'
  [ $rc -eq 0 ] || tail -5 "$OUT/$name.err" | sed 's/^/  /'
}

gen() {  # SCRIPT OUTFILE ARGS...
  local script=$1 file=$2; shift 2
  log "generate $file: $script $*"
  timeout 200 python3 "$SEED/$script" --out "$file" "$@" $GEN_EXTRA || { log "generation failed"; rm -f "$file"; return 1; }
  free -g | sed -n 2p
}

room_for() {  # GiB: true when MemAvailable holds that much more
  [ "$ROOM_CHECK" = 1 ] || return 0
  local avail; avail=$(awk '/MemAvailable/ {print int($2/1048576)}' /proc/meminfo)
  [ "$avail" -ge "$1" ] || { log "only $avail GiB available, need $1: skipped"; return 1; }
}

phase_a() {
  DEADLINE=$(( $(date +%s) + A_BUDGET ))
  log "phase a: SmallThinker-21B bf16, budget ${A_BUDGET}s"
  local G=$SHM/st21-bf16.gguf
  llama_start
  gen make_gguf_smallthinker.py "$G" || return 1
  # ours holds the checkpoint-form weights (40 GiB bf16) beside the file's 40 GiB of /dev/shm
  if room_for 50; then
    ours st21_bf16_cpu 200 --model "$G" --gpu-experts 0 --steps 32 --prompt-len 64 \
      --prefill-lens 512,4096 --chunk 2048
    ours st21_bf16_auto 200 --model "$G" --gpu-experts auto --steps 32 --prompt-len 64 \
      --prefill-lens 512,4096 --chunk 2048
  fi
  if llama_ready; then
    llama llama_st21_bf16_cpu 150 -m "$G" -ngl 99 -ncmoe 52 -p 512,4096 -n 64 -r 2 -b 2048 -ub 2048
    llama llama_st21_bf16_gpu 100 -m "$G" -ngl 99 -p 512,4096 -n 64 -r 2 -b 2048 -ub 2048
  fi
  rm -f "$G"
}

phase_b() {
  DEADLINE=$(( $(date +%s) + B_BUDGET ))
  log "phase b: consumer-GPU budgets, budget ${B_BUDGET}s"
  local S=$SHM/st21-q4k.gguf M=$SHM/glm-air-L$GLM_LAYERS.gguf
  local common=(--steps 16 --prompt-len 32 --prefill-lens 4096 --chunk 2048)
  llama_start
  # GLM-4.5-Air shape: GPU experts per layer as the full 46-layer model's plan gives them under each budget
  # and dense dtype for this file's types (Q4_K dense kept as int4 with group minimums, Q8_0 / Q6_K as int8;
  # sizing test stored_tests::the_plan_sizes_the_kept_codes_and_says_so: 24 GiB int4 1, fp8 0; 16 GiB
  # int4 4, fp8 2), so each layer runs as it would at full depth.
  if [[ " $B_MODELS " == *" glm "* ]] && gen make_gguf_glm4moe.py "$M" --layers "$GLM_LAYERS" --dtype q4_0 --dense-dtype q4_k --output-dtype q6_k \
       && room_for 30; then
    local glm=(--model "$M" --host-embeddings on "${common[@]}")
    ours glm_L${GLM_LAYERS}_int4_24g 100 "${glm[@]}" --gpu-memory-limit 24GiB --dense-dtype int4 --gpu-experts 1
    llama_ready && llama llama_glm_L${GLM_LAYERS}_cpu 80 -m "$M" -ngl 99 -ot exps=CPU -p 4096 -n 64 -r 2 -b 2048 -ub 2048
    ours glm_L${GLM_LAYERS}_int4_16g 100 "${glm[@]}" --gpu-memory-limit 16GiB --dense-dtype int4 --gpu-experts 4
    ours glm_L${GLM_LAYERS}_fp8_16g 100 "${glm[@]}" --gpu-memory-limit 16GiB --dense-dtype fp8 --gpu-experts 2
  fi
  rm -f "$M"
  # SmallThinker-21B with llama.cpp's Q4_K_M choice for the dense tensors, bf16 experts as the seed runs them
  if [[ " $B_MODELS " == *" st "* ]] && fits 120 && gen make_gguf_smallthinker.py "$S" --dense-dtype q4_k --output-dtype q6_k && room_for 45; then
    ours st21_q4k_int4_24g 150 --model "$S" --gpu-memory-limit 24GiB --gpu-experts auto --dense-dtype int4 "${common[@]}"
    llama_ready && llama llama_st21_q4k_cpu 90 -m "$S" -ngl 99 -ot exps=CPU -p 4096 -n 64 -r 2 -b 2048 -ub 2048
    ours st21_q4k_fp8_16g 150 --model "$S" --gpu-memory-limit 16GiB --gpu-experts auto --dense-dtype fp8 "${common[@]}"
  fi
  rm -f "$S"
  # SmallThinker-21B as llama-quantize Q4_K_M leaves it (Q4_K experts and dense, Q6_K attn_v / ffn_down_exps
  # in 26 of 52 layers, Q6_K output; 12 GiB): the file llama.cpp users run with -ot exps=CPU
  local Q=$SHM/st21-q4km.gguf
  if [[ " $B_MODELS " == *" stq "* ]] && fits 100 && gen make_gguf_smallthinker.py "$Q" --mix q4_k_m && room_for 30; then
    ours st21_q4km_int4_24g 100 --model "$Q" --gpu-memory-limit 24GiB --gpu-experts auto --dense-dtype int4 "${common[@]}"
    llama_ready && llama llama_st21_q4km_cpu 80 -m "$Q" -ngl 99 -ot exps=CPU -p 4096 -n 64 -r 2 -b 2048 -ub 2048
    ours st21_q4km_int4_16g 100 --model "$Q" --gpu-memory-limit 16GiB --gpu-experts auto --dense-dtype int4 "${common[@]}"
  fi
  rm -f "$Q"
}

phase_c() {
  DEADLINE=$(( $(date +%s) + C_BUDGET ))
  log "phase c: early routing A/B, budget ${C_BUDGET}s"
  local M=$SHM/st21-L16
  log "synth-checkpoint smallthinker-21b, 16 layers"
  timeout 90 "$MOE" bench synth-checkpoint --like smallthinker-21b --layers 16 --out "$M" > "$OUT/synth_c.log" 2>&1 \
    || { tail -3 "$OUT/synth_c.log"; rm -rf "$M"; return 1; }
  local round
  for round in 1 2; do
    ours st16_route_after_r$round 60 --model "$M" --gpu-experts 0 --steps 32 --prompt-len 64 --expert-prefetch-mib 0
    ours st16_route_early_r$round 60 --model "$M" --gpu-experts 0 --steps 32 --prompt-len 64 --expert-prefetch-mib 32
  done
  rm -rf "$M"
}

# Reserved 2 MiB pages for the P_LAYERS layers' packed DRAM experts: 360 pages of 64 × 11.25 MiB per layer,
# one mapping per layer (one NUMA node here), plus a few for the rest.
P_LAYERS=${P_LAYERS:-52}
P_SOURCE=${P_SOURCE:-gguf}      # gguf: make_gguf_smallthinker.py (fast; needs $SEED's writers and $PEERS' gguf
                                # wheel); synth: moe-daemon bench synth-checkpoint (slow: use P_LAYERS=16)
P_PAGES=${P_PAGES:-$(( P_LAYERS * 360 + 64 ))}
pages_facts() {
  grep -E "^(AnonHugePages|HugePages_(Total|Free|Rsvd)|MemAvailable)" /proc/meminfo | tr -s ' ' | paste -sd ' '
  echo "  THP enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled); defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
}

# kernel NAME TIMEOUT HUGEPAGES: bench cpu-moe at SmallThinker-21B's expert shape (64 of width 768, top-6,
# hidden 2560), 1 and 6 tokens, 16 layers cycled (12 GB: from DRAM), 16 threads
kernel() {
  local name=$1 to=$2 hp=$3
  fits_run "$to" || return 0
  log "bench cpu-moe $name (--hugepages $hp)"
  timeout "$to" "$MOE" bench cpu-moe --experts 64 --topk 6 --hidden 2560 --inter 768 --dtype bf16 \
    --tokens 1,6 --threads "$THREADS" --layers 16 --iters 30 --probe-mib 2048 --hugepages "$hp" \
    > "$OUT/$name.md" 2> "$OUT/$name.err"
  echo "  rc=$?"; grep -E "^(DRAM|## dtype|\| *[0-9])" "$OUT/$name.md" | sed 's/^/  /'
}

phase_p() {
  DEADLINE=$(( $(date +%s) + P_BUDGET ))
  log "phase p: page backing of the packed experts, budget ${P_BUDGET}s"
  local M t
  t=$(date +%s%N)
  echo "$P_PAGES" > /proc/sys/vm/nr_hugepages
  log "reserved $(cat /proc/sys/vm/nr_hugepages) of $P_PAGES 2 MiB pages in $(( ($(date +%s%N) - t) / 1000000 )) ms"
  pages_facts
  kernel cpu_moe_st_2m 40 2M
  if [ "$P_SOURCE" = gguf ]; then
    # llama.cpp-layout bf16 GGUF, written at /dev/shm speed by the Python writer (SEED holds it)
    M=$SHM/st21-L$P_LAYERS.gguf
    gguf_env
    gen make_gguf_smallthinker.py "$M" --layers "$P_LAYERS" \
      || { echo 0 > /proc/sys/vm/nr_hugepages; return 1; }
  else
    # bench synth-checkpoint writes ~0.3 GB/s there: 52 layers (40 GiB) take over 2 minutes
    M=$SHM/st21-L$P_LAYERS
    log "synth-checkpoint smallthinker-21b, $P_LAYERS layers"
    timeout 150 "$MOE" bench synth-checkpoint --like smallthinker-21b --layers "$P_LAYERS" --out "$M" \
      > "$OUT/synth_p.log" 2>&1 \
      || { tail -3 "$OUT/synth_p.log"; rm -rf "$M"; echo 0 > /proc/sys/vm/nr_hugepages; return 1; }
    tail -1 "$OUT/synth_p.log"
  fi
  pages_facts
  local run=(--model "$M" --steps 48 --prompt-len 64 --batch 1,1)
  ours st21_L52_dram_2m 90 "${run[@]}" --gpu-experts 0 --hugepages 2M
  echo 0 > /proc/sys/vm/nr_hugepages; pages_facts
  ours st21_L52_dram_thp 90 "${run[@]}" --gpu-experts 0 --hugepages thp
  pages_facts
  kernel cpu_moe_st_4k 40 off
  ours st21_L52_dram_4k 90 "${run[@]}" --gpu-experts 0 --hugepages off
  ours st21_L52_24g_thp 90 "${run[@]}" --gpu-experts auto --gpu-memory-limit 24GiB --hugepages thp
  rm -rf "$M"
}

facts
[ $# -ge 1 ] || set -- a b
[[ " $* " == *" a "* || " $* " == *" b "* ]] && gguf_env
for p in "$@"; do
  case $p in
    a) phase_a ;;
    b) phase_b ;;
    c) phase_c ;;
    p) phase_p ;;
    *) echo "unknown phase $p (a, b, c, p)"; exit 2 ;;
  esac
done
[ -n "$BUILD_SID" ] && { build_signal CONT; log "llama.cpp build still running: left to finish in the background"; }
rm -f "$OUT/.gpumem"
log "done"
