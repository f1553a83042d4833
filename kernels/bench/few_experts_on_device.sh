#!/usr/bin/env bash
# cpu11 batch A: the CPU expert calls of decode steps with few DRAM experts (issue 15).
# (1) cpu_moe_bench, one process per shape: 1 token, a routing drawn per call, 16 threads, experts per
#     token (--topk) 2/4/6/8 (Qwen3 bf16), 3/6 (SmallThinker bf16), 4 (GLM-4.5-Air int8); rows = the
#     chained plan (the default), with :tail (no claim-ahead at the end), :ip8 / :ip6 (>= 8 / 6 items
#     per thread), smaller items (gu256:dn192), streams, and the read anchor; two rounds of the main rows.
# (2) bench decode on a 16-layer Qwen3-30B-A3B-shape bf16 GGUF with 64 GPU experts per layer:
#     --cpu-replay 4 --cpu-paths chained,chained:tail (rounds 0/1 on chained, 2/3 on chained:tail;
#     odd rounds random routing), calls split by DRAM experts per call with a line through them.
# Hard cap: BUDGET seconds (default 98). Usage (repo root): D=.device/cpu11 OUT=$OUT bash .device/cpu11/run.sh
# (PERF.md "Decode sizes, part 4", batch A of 2026-12-02 16:42 UTC).
#
# Staging (build machine, branch checkout):
#   cargo build --release -p moe-kernels --example cpu_moe_bench
#   cargo build --release -p moe-daemon --bin moe-daemon
#   D=/work/main/.device/cpu11; mkdir -p $D
#   strip -o /tmp/b target/release/examples/cpu_moe_bench && xz -T1 -c /tmp/b > $D/cpu_moe_bench.xz
#   strip -o /tmp/d target/release/moe-daemon && xz -T1 -c /tmp/d > $D/moe-daemon.xz
#   cp kernels/bench/few_experts_on_device.sh $D/run.sh
set -uo pipefail
D=${D:-.device/cpu11}
OUT=${OUT:-/tmp/cpu11-out}
O=$OUT/cpu11
mkdir -p "$O"
T0=$(date +%s); DEADLINE=$((T0 + ${BUDGET:-98}))
left() { echo $(( DEADLINE - $(date +%s) )); }
log() { echo "[cpu11 +$(( $(date +%s) - T0 ))s] $*"; }
PEERS=${PEERS:-$PWD/.device/peers}
G=/dev/shm/cpu11-q16.gguf
SITE=/tmp/cpu11-site
cleanup() { rm -f "$G"; }
trap cleanup EXIT
xz -d -k -f "$D"/*.xz && chmod +x "$D"/moe-daemon "$D"/cpu_moe_bench
log "$(nproc) CPUs; $(free -g | awk '/Mem:/ {print $7}') GiB available; THP $(cat /sys/kernel/mm/transparent_hugepage/enabled)"

# one line per topk: each row's "label median/mean ms (% of the probe, median) ~region tail µs"
summ() {
  awk '
    /^# bench cpu-moe:/ { k=$0; sub(/.*topk=/,"",k); sub(/ .*/,"",k) }
    /^## dtype/ { d=$3; sub(/:.*/,"",d) }
    /^\| [0-9]+ \| [0-9]+ \|/ {
      split($0,f,"|"); for (i in f) gsub(/ /,"",f[i]);
      p=f[14]; gsub(/chained/,"ch",p); gsub(/read/,"rd",p); gsub(/\/fresh/,"",p);
      v=f[9]; gsub(/%/,"",v); m=f[5]; sub(/^0/,"",m); a=f[4]; sub(/^0/,"",a);
      tl=f[13]; sub(/^[^\/]*\//,"",tl); sub(/\(.*/,"",tl);
      key=d" k"k" t"f[3]; if (!(key in line)) { order[++n]=key; line[key]=key" (ms med/mean(% probe) ~tail us):" }
      line[key]=line[key]" "p" "m"/"a"("v")~"tl
    }
    END { for (i=1;i<=n;i++) print line[order[i]] }' "$1"
}
bench() {
  local name=$1 cap=$2; shift 2
  local l; l=$(left); [ "$l" -lt 8 ] && { log "$name skipped ($l s left)"; return; }
  [ "$cap" -gt "$((l - 4))" ] && cap=$((l - 4))
  local t=$(date +%s)
  timeout "$cap" "$D/cpu_moe_bench" "$@" > "$O/$name.md" 2>&1
  log "$name rc=$? $(( $(date +%s) - t ))s"
  grep -E "^# pool|^# DRAM" "$O/$name.md" | sed 's/ (.*workers pinned.*//; s/ (the shares above.*//' | sort -u | head -6
  summ "$O/$name.md"
}
P=read,chained,chained:tail,chained:ip8,chained:ip8:tail,chained:ip6,chained:gu256:dn192,streams,read,chained,chained:tail,chained:ip8
COMMON=(--tokens 1 --threads 16 --routings fresh --iters 60 --probe-mib 2048 --paths "$P")
bench qwen_bf16 26 --experts 24 --layers 16 --topk 2,4,6,8 --hidden 2048 --inter 768 --dtype bf16 "${COMMON[@]}"
bench st_bf16 14 --experts 16 --layers 16 --topk 3,6 --hidden 2560 --inter 768 --dtype bf16 "${COMMON[@]}"
bench glm_int8 10 --experts 16 --layers 8 --topk 4 --hidden 4096 --inter 1408 --dtype int8 "${COMMON[@]}"

# (2) the engine: GGUF, then one bench decode process
if [ ! -d "$SITE/gguf" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$PEERS"/kit/gguf-*.whl \
    > "$O/pip.log" 2>&1
fi
l=$(left); [ "$l" -lt 40 ] && { log "engine skipped ($l s left)"; exit 0; }
t=$(date +%s)
PYTHONPATH=$SITE timeout 25 python3 "$PEERS/make_gguf_qwen3moe.py" --layers 16 --dtype bf16 --out "$G" > "$O/gen.log" 2>&1
log "gen rc=$? $(( $(date +%s) - t ))s $(ls -la "$G" 2>/dev/null | awk '{print $5}') bytes"
[ -f "$G" ] || { tail -5 "$O/gen.log"; exit 1; }
l=$(left); log "bench decode (cap $((l - 2)) s)"
timeout $((l - 2)) "$D/moe-daemon" bench decode --device cuda --gpu-experts 64 --cpu-threads 16 --model "$G" \
  --prompt-len 32 --steps 24 --cpu-replay 4 --cpu-paths chained,chained:tail > "$O/gpu64.log" 2>&1
echo "  rc=$?"
grep -E "^loaded|^DRAM|^decode|per step|other host|CPU pool|hand-off per|DRAM bound|rror|panick" "$O/gpu64.log" | cut -c1-400
grep -E "^CPU replay round .: (engine step|recorded \[|recorded:|recorded by|fresh)" "$O/gpu64.log" | grep -E "ms/layer" | cut -c1-190
grep -E "^CPU replay round .: (engine step|recorded|fresh).*by DRAM" "$O/gpu64.log" | grep -v "gap" | cut -c1-360
grep -E "^CPU replay round .: routing|^CPU replay, " "$O/gpu64.log" | cut -c1-700
log "done"
