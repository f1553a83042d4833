#!/usr/bin/env bash
# CPU routed-expert kernels at decode sizes on the H200 host: every row in ONE process per (shape,
# dtype), so that the rows share that process's DRAM probe and memory. Rows (`cpu_moe_bench --paths`):
# decode paths (`PLAN[:pfBYTES][:t0|t1|t2|nta][:wsKIB][:guKIB][:dnKIB][:stKIB]`, plans split,
# fused, chained = the default, streams) and read anchors (`read`, `read:pf8192:t1`: the same
# experts' bytes streamed by the pool with the DRAM probe's loop, the limit of those very pages).
# Engine-like conditions (`--gaps` µs idle before each call with the caller and workers spinning and
# the input rows flushed; `--cycles` layers cycled; `--routings fresh`: a routing drawn per call, no L3
# reuse from pass to pass; `--threads 15,16`) are timed in the same process.
#
# MODE=final (default): the A/B of what ships (the chained plan with the item sizes before and after
# part 3, with and without a warm start, and the read anchor, twice each; once the T2 prefetch hint and
# items of 1 MiB / 768 KiB;
# a routing drawn per call),
# Qwen3-30B-A3B, SmallThinker-21B, GLM-4.5-Air shapes, bf16 and int8, tokens 1,2,4,8 (GLM 1,4,8),
# then bf16 at one token at 48 / 52 layers with the engine's 74 µs gap; then the kernels' cpu:: unit
# tests on this CPU (AMX tier included).
# MODE=explore: batch A of 2026-12-02 13:21 UTC (prefetch / item-size / warm-start sweep at SmallThinker
# and Qwen bf16, the engine-like processes, the int8 and GLM baselines).
#
# Expert counts are below the models' (64 / 32 / 24 instead of 128 / 64 / 128) so that generating and
# packing fits a device call: one token reads top_k experts either way. Engine-like processes keep
# 2 × top_k experts per layer and 48 (Qwen) / 52 (SmallThinker) layers, the models' depth: the pages
# one token reads are the engine's. Stdout: one line per dtype × tokens × threads: each row's
# "label median/mean ms(% of the DRAM probe, median)", labels abbreviated (ch chained, st streams,
# fu fused, sp split, rd read, @N prefetch distance, /f routing per call, /gN gap µs, /LN layers
# cycled); full tables
# with p90 / max and the pool's late joins in $OUT/cpuplan10/*.md. Hard cap: the timeouts below.
#
# Staging (build machine, branch checkout):
#   cargo build --release -p moe-kernels --example cpu_moe_bench
#   T=$(cargo test --release --no-run -p moe-kernels --lib 2>&1 | grep -o 'target/release/deps/moe_kernels-[0-9a-f]*')
#   D=/work/main/.device/cpuplan10; mkdir -p $D
#   strip -o /tmp/b target/release/examples/cpu_moe_bench && xz -T1 -c /tmp/b > $D/cpu_moe_bench.xz
#   strip -o /tmp/t $T && xz -T1 -c /tmp/t > $D/moe_kernels_tests.xz
#   cp kernels/bench/decode_ab_on_device.sh $D/run.sh
# Call: D=.device/cpuplan10 OUT=$OUT bash .device/cpuplan10/run.sh   (MODE=explore, PATHS=… override)
set -u
D=${D:-.device/cpuplan10}
OUT=${OUT:-/tmp/cpuplan10out}
L=$OUT/cpuplan10
MODE=${MODE:-final}
mkdir -p "$L"
xz -d -k -f "$D"/*.xz
chmod +x "$D"/cpu_moe_bench "$D"/moe_kernels_tests
B=$D/cpu_moe_bench
START=$(date +%s)
# Reserved 2 MiB pages for the packed experts (largest set: 16 Qwen-shape layers of 64 bf16 experts,
# 9.7 GB, plus the 2 GiB probe); without root the experts go on transparent huge pages. The previous
# reservation is put back at the end.
PREV_PAGES=$(cat /proc/sys/vm/nr_hugepages)
if [ -w /proc/sys/vm/nr_hugepages ]; then echo "${PAGES:-14000}" > /proc/sys/vm/nr_hugepages; fi
echo "2M pages: $(cat /proc/sys/vm/nr_hugepages); $(lscpu | grep -E 'Model name' | sed 's/  */ /g')"

# One line per dtype x tokens x threads: each row's median/mean ms and % of the probe (median).
summ() {
  awk '
    /^## dtype/ { d=$3; sub(/:.*/,"",d) }
    /^\| [0-9]+ \| [0-9]+ \|/ {
      split($0,f,"|"); for (i in f) gsub(/ /,"",f[i]);
      p=f[14]; gsub(/chained/,"ch",p); gsub(/streams/,"st",p); gsub(/split/,"sp",p); gsub(/fused/,"fu",p);
      gsub(/read/,"rd",p); gsub(/\/fresh/,"/f",p); gsub(/:pf/,"@",p); gsub(/:t1/,"",p); v=f[9]; gsub(/%/,"",v);
      m=f[5]; sub(/^0/,"",m); a=f[4]; sub(/^0/,"",a);
      k=d" t"f[3]" th"f[2]; if (!(k in line)) { order[++n]=k; line[k]=k":" }
      line[k]=line[k]" "p" "m"/"a"("v")"
    }
    END { for (i=1;i<=n;i++) print line[order[i]] }' "$1"
}

run() {
  local name=$1 cap=$2; shift 2
  local t0 left
  t0=$(date +%s)
  left=$(( ${BUDGET:-100} - (t0 - START) ))
  if [ "$left" -lt 6 ]; then echo "== $name skipped: device budget spent"; return; fi
  [ "$cap" -gt "$left" ] && cap=$left
  timeout "$cap" "$B" "$@" > "$L/$name.md" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  grep -E "^# pool|^# DRAM" "$L/$name.md" | sed 's/ (.*workers pinned.*//; s/ (the shares above.*//'
  grep -E "^## dtype" "$L/$name.md" | sed 's/ per layer.*memory/, memory/' | cut -c1-150
  summ "$L/$name.md"
}

COMMON=(--iters 50 --probe-mib 2048)
QWEN=(--topk 8 --hidden 2048 --inter 768)
ST=(--topk 6 --hidden 2560 --inter 768)
GLM=(--topk 8 --hidden 4096 --inter 1408)
if [ "$MODE" = explore ]; then
  # batch A (13:21 UTC, dcfc381) also timed `:ev2` / `:ev4` / `:ev64` (the kernels prefetching one line
  # in 2 / 4 / 64, the rest left to the hardware): 25-35 % slower everywhere, the option was removed.
  # Its `chained` had the item sizes of that time, `chained:gu256:dn192` today.
  C=chained:gu256:dn192
  SWEEP=${PATHS:-read,read:pf8192:t1,read:ck1024,$C,$C:ws64,$C:pf16384,$C:pf4096:t0,chained:gu320:dn192,chained:gu512:dn192,chained:gu256:dn384,chained:gu320:dn384,streams:gu256:dn192,fused:gu256:dn192,read,$C}
  ENG=read,$C,read,$C
  BASE=read,$C,chained:gu320:dn192,read,$C
  run st_bf16 16 "${ST[@]}" --experts 32 --layers 16 --tokens 1,8 --threads 16 --dtype bf16 --routings fresh --paths "$SWEEP" "${COMMON[@]}"
  run qwen_bf16 16 "${QWEN[@]}" --experts 64 --layers 16 --tokens 1,8 --threads 16 --dtype bf16 --routings fresh --paths "$SWEEP" "${COMMON[@]}"
  run st_bf16_engine 16 "${ST[@]}" --experts 12 --layers 52 --routings fixed,fresh --cycles 16,52 --gaps 0,74 --tokens 1 --threads 15,16 --dtype bf16 --paths "$ENG" "${COMMON[@]}"
  run qwen_bf16_engine 16 "${QWEN[@]}" --experts 16 --layers 48 --routings fixed,fresh --cycles 16,48 --gaps 0,74 --tokens 1 --threads 15,16 --dtype bf16 --paths "$ENG" "${COMMON[@]}"
  run qwen_int8 11 "${QWEN[@]}" --experts 64 --layers 16 --tokens 1,8 --threads 16 --dtype int8 --routings fresh --gaps 0,74 --paths "$BASE" "${COMMON[@]}"
  run st_int8 9 "${ST[@]}" --experts 32 --layers 16 --tokens 1,8 --threads 16 --dtype int8 --routings fresh --gaps 0,74 --paths "$BASE" "${COMMON[@]}"
  run glm_bf16 13 "${GLM[@]}" --experts 24 --layers 6 --tokens 1,8 --threads 16 --dtype bf16 --routings fresh --gaps 0,74 --paths "$BASE" "${COMMON[@]}"
else
  # chained:gu256:dn192 = the chained plan with the item sizes before part 3; chained = the default
  P=${PATHS:-read,chained:gu256:dn192,chained,chained:ws64,chained:pf8192:t2,chained:gu1024:dn768,read,chained:gu256:dn192,chained,chained:ws64}
  T=${TOKENS:-1,2,4,8}
  F=(--threads 16 --routings fresh --paths "$P" "${COMMON[@]}")
  run qwen_bf16 14 "${QWEN[@]}" --experts 64 --layers 16 --tokens "$T" --dtype bf16 "${F[@]}"
  run qwen_int8 10 "${QWEN[@]}" --experts 64 --layers 16 --tokens "$T" --dtype int8 "${F[@]}"
  run st_bf16 12 "${ST[@]}" --experts 32 --layers 16 --tokens "$T" --dtype bf16 "${F[@]}"
  run st_int8 9 "${ST[@]}" --experts 32 --layers 16 --tokens "$T" --dtype int8 "${F[@]}"
  run glm_bf16 12 "${GLM[@]}" --experts 24 --layers 6 --tokens 1,4,8 --dtype bf16 "${F[@]}"
  run glm_int8 9 "${GLM[@]}" --experts 24 --layers 6 --tokens 1,4,8 --dtype int8 "${F[@]}"
  run qwen_bf16_engine 8 "${QWEN[@]}" --experts 16 --layers 48 --gaps 74 --tokens 1 --dtype bf16 "${F[@]}"
  run st_bf16_engine 8 "${ST[@]}" --experts 12 --layers 52 --gaps 74 --tokens 1 --dtype bf16 "${F[@]}"
fi
echo "$PREV_PAGES" > /proc/sys/vm/nr_hugepages 2>/dev/null
if [ "$MODE" = final ]; then
  echo "== kernels' unit tests on this CPU (cpu::, AMX tier included)"
  timeout 10 "$D"/moe_kernels_tests cpu:: > "$L/tests.log" 2>&1
  echo "rc=$?"; grep -E "test result|FAILED|panicked" "$L/tests.log" | head -20
fi
echo "done in $(( $(date +%s) - START ))s"
