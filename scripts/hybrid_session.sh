#!/usr/bin/env bash
# Hybrid decode / prefill checks on the H200 machine in one call, every step under its own timeout and a
# call deadline (steps that would not finish in time are skipped and say so):
#
#   tests  the GPU tests named in TESTS (filters; default: those of the decode step and the expert stream).
#   early  early routing A/B on a 16-layer SmallThinker-21B-shape checkpoint in /dev/shm (12 GiB), all
#          experts in DRAM, three builds of the decode step, A B C per round (ROUNDS, default 2): launches after the routing
#          lands (MOE_GPU_PRELAUNCH=0), the all-DRAM layers' GPU half enqueued before it (the default),
#          and that plus early routing with the pool prefetching PREFETCH_MIB per layer; then prefill
#          PREFILL_LEN with the expert stream's GPU-clock profile (MOE_STREAM_PROFILE=1), the same with the
#          expert GEMMs forced onto the grouped kernel (MOE_GROUPED_GEMM=1), its chunk-size variants, and an
#          nsys summary of the same prefill when nsys is installed.
#   gemm   the expert GEMM paths A/B on a QLAYERS-layer Qwen3-30B-A3B-shape checkpoint (default 8, 10 GiB
#          in /dev/shm): prefill 4096 and 8192 with every expert streamed (--gpu-experts 0, stream
#          profile on) with the batched path forced (MOE_GROUPED_GEMM=0) and the grouped kernel
#          (MOE_GROUPED_GEMM=1); the defaults (the rule's path per use) with every expert in DRAM: prefill
#          512 split between GPU and CPU and again with the split paused (--split-ab), decode at batch 1, 8
#          and 32 with the DRAM bound; then decode with 64 and 128 GPU experts per layer, each path forced.
#   ab     decode-step switches A/B'd in one process (`bench decode --ab`, AB_ROUNDS rounds, start state
#          then each switch flipped, same sequences; each switch's teacher-forced effect on the logits;
#          the hand-off profile per MoE layer) on a QLAYERS-layer Qwen3-30B-A3B-shape checkpoint: every
#          expert in DRAM (prelaunch, defer1, defer2), 64 GPU experts per layer (mixed-grouped,
#          device-routed, prelaunch) and 128 (device-routed).
#   mem    `serve` on the same checkpoint (a byte-level tokenizer written beside it, every expert in DRAM):
#          /proc status and its "host memory once loaded" line when ready and after one request, beside
#          the "host memory" line of `bench decode` from the ab phase (run ab first).
#
# Layout (run from the repository root): $D/moe-daemon, $D/gpu_tests (D defaults to this script's folder).
# Usage there: OUT=$OUT D=.device/hybrid3 BUDGET=170 TESTS=grouped_expert_gemm bash .device/hybrid3/hybrid_session.sh tests gemm
set -uo pipefail
D=${D:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
MOE=$D/moe-daemon
OUT=${OUT:-/tmp/hybrid-out}
BUDGET=${BUDGET:-150}
LAYERS=${LAYERS:-16}
QLAYERS=${QLAYERS:-8}
PREFETCH_MIB=${PREFETCH_MIB:-16}
ROUNDS=${ROUNDS:-2}
AB_ROUNDS=${AB_ROUNDS:-3}
PREFILL_LEN=${PREFILL_LEN:-8192}
CHUNK_VARIANTS=${CHUNK_VARIANTS:-512}
TESTS=${TESTS:-grouped_expert_gemm split_prefill early_routing cuda_graph_decode_matches_eager deferred_experts cuda_matches_transformers_and_cpu long_prefill_gemm_attention_and_expert_stream}
SHM=${SHM:-/dev/shm}
mkdir -p "$OUT"
export MOE_FIXTURES=$PWD/tests/fixtures RUST_BACKTRACE=1
T0=$(date +%s)
DEADLINE=$(( T0 + BUDGET ))
log() { echo "[hyb +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
# fits SECONDS: true when a step expected to take SECONDS still ends before the deadline
fits() { [ "$(left)" -ge "$1" ] || { log "skipped (needs ~$1 s, $(left) s left)"; return 1; }; }

# bench NAME TIMEOUT EXPECTED ARGS...: `bench decode` on the CUDA backend, its figures grepped
bench() {
  local name=$1 to=$2 expect=$3; shift 3
  fits "$expect" || return 0
  log "$name: $*"
  timeout "$to" "$MOE" bench decode --device cuda "$@" > "$OUT/$name.log" 2>&1
  echo "  rc=$?"
  grep -E "^loaded|^prefill|^decode|^DRAM|per step|early routing|by region|DRAM bound|expert stream:|expert GEMM|hand-off|^A/B|^logits|rror|panick" "$OUT/$name.log" \
    | sed 's/^/  /' | cut -c1-600
}

phase_tests() {
  fits 40 || return 0
  log "gpu_tests: $TESTS"
  # shellcheck disable=SC2086 # TESTS holds several filters
  timeout 90 "$D/gpu_tests" --test-threads 1 --nocapture $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "  rc=$?"
  grep -E "^test |panicked|test result|same logits|rel-L2 vs unsplit|grouped against" "$OUT/gpu_tests.log" | sed 's/^/  /' | tail -30
}

phase_early() {
  local M=$SHM/st21-L$LAYERS
  fits 60 || return 0
  log "synth-checkpoint smallthinker-21b, $LAYERS layers"
  timeout 120 "$MOE" bench synth-checkpoint --like smallthinker-21b --layers "$LAYERS" --out "$M" \
    > "$OUT/synth.log" 2>&1 || { tail -3 "$OUT/synth.log"; rm -rf "$M"; return 1; }
  free -g | sed -n 2p
  local common=(--model "$M" --gpu-experts 0 --steps 32 --prompt-len 64)
  MOE_STREAM_PROFILE=1 bench st${LAYERS}_prefill$PREFILL_LEN 90 25 --model "$M" --gpu-experts 0 \
    --steps 4 --prefill-lens "$PREFILL_LEN"
  # the expert GEMMs of a long prompt forced onto the grouped kernel (one launch per projection and chunk)
  MOE_GROUPED_GEMM=1 MOE_STREAM_PROFILE=1 bench st${LAYERS}_prefill${PREFILL_LEN}_grouped 90 25 --model "$M" \
    --gpu-experts 0 --steps 4 --prefill-lens "$PREFILL_LEN"
  local r
  # base: launches after the routing lands (MOE_GPU_PRELAUNCH=0), routing after attention;
  # after: the GPU half of all-DRAM layers enqueued before the routing lands; early: plus early routing
  for r in $(seq "$ROUNDS"); do
    MOE_GPU_PRELAUNCH=0 bench st${LAYERS}_base_r$r 60 15 "${common[@]}" --expert-prefetch-mib 0
    bench st${LAYERS}_after_r$r 60 15 "${common[@]}" --expert-prefetch-mib 0
    bench st${LAYERS}_early_r$r 60 15 "${common[@]}" --expert-prefetch-mib "$PREFETCH_MIB"
  done
  nsys_prefill "$M"
  local c
  for c in $CHUNK_VARIANTS; do
    MOE_STREAM_PROFILE=1 bench st${LAYERS}_prefill${PREFILL_LEN}_chunk$c 90 25 --model "$M" --gpu-experts 0 \
      --steps 4 --prefill-lens "$PREFILL_LEN" --gpu-stream-chunk-mib "$c"
  done
  rm -rf "$M"
}

phase_gemm() {
  local M=$SHM/q3-L$QLAYERS
  fits 50 || return 0
  log "synth-checkpoint qwen3-30b-a3b, $QLAYERS layers"
  timeout 120 "$MOE" bench synth-checkpoint --like qwen3-30b-a3b --layers "$QLAYERS" --out "$M" \
    > "$OUT/synth_q3.log" 2>&1 || { tail -3 "$OUT/synth_q3.log"; rm -rf "$M"; return 1; }
  local p g
  for p in 0 1; do  # 0: one cuBLAS batched call per row count; 1: one grouped kernel launch
    MOE_GROUPED_GEMM=$p MOE_STREAM_PROFILE=1 bench q3_prefill_gemm$p 90 20 --model "$M" --gpu-experts 0 \
      --steps 2 --prefill-lens 4096,8192
  done
  bench q3_defaults 120 25 --model "$M" --gpu-experts 0 --steps 16 --prompt-len 32 --prefill-lens 512 --split-ab \
    --batch 1,8,32
  for g in 64 128; do
    for p in 0 1; do
      MOE_GROUPED_GEMM=$p bench q3_gpu${g}_gemm$p 60 10 --model "$M" --gpu-experts "$g" --steps 16 --prompt-len 32
    done
  done
  rm -rf "$M"
}

phase_ab() {
  local M=$SHM/q3-L$QLAYERS
  fits 45 || return 0
  if [ ! -f "$M/config.json" ]; then
    log "synth-checkpoint qwen3-30b-a3b, $QLAYERS layers"
    timeout 120 "$MOE" bench synth-checkpoint --like qwen3-30b-a3b --layers "$QLAYERS" --out "$M" \
      > "$OUT/synth_q3.log" 2>&1 || { tail -3 "$OUT/synth_q3.log"; rm -rf "$M"; return 1; }
  fi
  local common=(--model "$M" --steps 16 --prompt-len 32 --ab-rounds "$AB_ROUNDS")
  bench q3_ab_gpu0 60 18 "${common[@]}" --gpu-experts 0 --ab prelaunch,defer1,defer2
  bench q3_ab_gpu64 60 18 "${common[@]}" --gpu-experts 64 --ab mixed-grouped,device-routed,prelaunch
  bench q3_ab_gpu128 60 15 "${common[@]}" --gpu-experts 128 --ab device-routed
}

phase_mem() {
  local M=$SHM/q3-L$QLAYERS
  [ -f "$M/config.json" ] || { log "mem: no checkpoint (run the ab phase first)"; return 0; }
  fits 30 || return 0
  # serve needs a tokenizer: 256 byte tokens and an end token (the synth has none)
  python3 - "$M" <<'PY'
import json, sys
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
cs, n = bs[:], 0
for b in range(256):
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
vocab = {chr(c): b for b, c in zip(bs, cs)}
level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
end = {"id": 256, "content": "<|endoftext|>", "single_word": False, "lstrip": False, "rstrip": False,
       "normalized": False, "special": True}
tok = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
       "added_tokens": [end], "pre_tokenizer": level, "decoder": level,
       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                 "ignore_merges": False, "vocab": vocab, "merges": []}}
json.dump(tok, open(sys.argv[1] + "/tokenizer.json", "w"))
json.dump({"eos_token": "<|endoftext|>"}, open(sys.argv[1] + "/tokenizer_config.json", "w"))
PY
  log "mem: serve --device cuda --gpu-experts 0 on $M"
  timeout 90 "$MOE" serve --model "$M" --device cuda --gpu-experts 0 --port 18431 > "$OUT/serve_mem.log" 2>&1 &
  local pid=$! i
  sleep 1
  local daemon; daemon=$(pgrep -P "$pid" -f "moe-daemon serve" | head -1)  # timeout's child
  [ -n "$daemon" ] || daemon=$pid
  for i in $(seq 60); do
    sleep 1
    grep -q "engine ready" "$OUT/serve_mem.log" && break
    kill -0 "$pid" 2> /dev/null || break
  done
  echo "  ready after ${i}s: $(grep -E 'VmRSS|VmHWM|RssAnon|RssFile|RssShmem|VmLck|VmPin' /proc/$daemon/status 2> /dev/null | tr -s ' \t\n' ' ')"
  curl -s -m 20 localhost:18431/v1/completions -H 'content-type: application/json' \
    -d '{"model":"q3-L'"$QLAYERS"'","prompt":"the quick brown fox jumps over the lazy dog, twice over","max_tokens":16}' \
    | cut -c1-160
  echo
  echo "  after a request: $(grep -E 'VmRSS|VmHWM|RssAnon|RssFile|RssShmem|VmLck|VmPin' /proc/$daemon/status 2> /dev/null | tr -s ' \t\n' ' ')"
  kill "$pid" 2> /dev/null
  wait "$pid" 2> /dev/null
  sed 's/\x1b\[[0-9;]*m//g' "$OUT/serve_mem.log" | grep -E "host memory|freed host memory|warm-up|rror" | cut -c1-400 | sed 's/^/  serve: /'
  grep -h "host memory" "$OUT"/q3_ab_gpu0.log 2> /dev/null | sed 's/^/  bench decode (ab phase):/'
}

nsys_prefill() {  # MODEL
  local M=$1
  if command -v nsys > /dev/null && fits 50; then
    log "nsys: prefill $PREFILL_LEN"
    timeout 100 nsys profile -o "$OUT/prefill" --force-overwrite true --stats=true -t cuda,osrt \
      "$MOE" bench decode --device cuda --model "$M" --gpu-experts 0 --steps 2 --prefill-lens "$PREFILL_LEN" \
      > "$OUT/nsys.log" 2>&1
    echo "  rc=$?"
    grep -E -A14 "cuda_api_sum|cuda_gpu_kern_sum|cuda_gpu_mem_time_sum" "$OUT/nsys.log" | cut -c1-220 | head -60
    rm -f "$OUT"/prefill.nsys-rep "$OUT"/prefill.sqlite
  else
    log "nsys not installed (or no time left): the stream profile above is the breakdown"
  fi
}

log "facts: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader); $(nproc) CPUs; $(free -g | awk '/Mem:/ {print $7}') GiB available"
[ $# -ge 1 ] || set -- tests early
for p in "$@"; do
  case $p in
    tests) phase_tests ;;
    early) phase_early ;;
    gemm) phase_gemm ;;
    ab) phase_ab ;;
    mem) phase_mem ;;
    *) echo "unknown phase $p (tests, early, gemm, ab, mem)"; exit 2 ;;
  esac
done
rm -rf "$SHM/q3-L$QLAYERS" "$SHM/st21-L$LAYERS"
log "done"
