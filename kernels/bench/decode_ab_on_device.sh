#!/usr/bin/env bash
# CPU routed-expert kernels at decode sizes on the H200 host, every decode path in ONE process per
# (shape, dtype), so that the paths share that process's DRAM probe and memory: split (gate/up, down
# activations and down as separate pool regions), fused (one region, per-expert readiness), chained
# (the default: fused + each thread claims its next item before its current one's last stream, the
# kernels' prefetch runs from stream to stream, 8 KiB ahead into L2) and streams (chained + down items
# of a few experts x 96 KiB); `chained:pf4096:t0` is chained with the fused plan's prefetch. PATHS=…
# times others (prefetch settings and item sizes: `PLAN:pfBYTES:t0|t1|nta:guKIB:dnKIB:stKIB`; batch A
# of 2026-12-02 timed split,fused,chained,streams,chained:pf8192,streams:pf0,streams:pf2048,
# streams:pf8192,streams:pf16384,streams:pf8192:t1,streams:st192:dn384,streams:gu512:dn384:st192, then
# the first four again, with the prefetch default of the time, 4 KiB into L1, and TOKENS=1,2,4,8).
# Three shapes: Qwen3-30B-A3B, SmallThinker-21B, GLM-4.5-Air, bf16 and int8. Then the pool's start-up (printed by the bench first)
# and the kernels' cpu:: unit tests on this CPU.
#
# Expert counts are below the models' (64 / 32 / 24 instead of 128 / 64 / 128) so that generating and
# packing fits a device call: one token reads top_k experts either way; at 2-8 tokens fewer distinct
# experts are read. Layers cycled: 16 / 16 / 6, so one token cycles 1.2 / 1.1 / 1.7 GB through the
# 300 MiB L3. Stdout: one line per dtype x token count, "path median_ms(% of the DRAM probe)", paths
# abbreviated sp/fu/ch/st, `@N` the prefetch distance; full tables in $OUT/cpuk9/*.md. Hard cap: the
# timeouts below (76 s of benches, 10 s of tests).
#
# Staging (build machine, branch checkout):
#   cargo build --release -p moe-kernels --example cpu_moe_bench
#   T=$(cargo test --release --no-run -p moe-kernels --lib 2>&1 | grep -o 'target/release/deps/moe_kernels-[0-9a-f]*')
#   D=/work/main/.device/cpuk9; mkdir -p $D
#   strip -o /tmp/b target/release/examples/cpu_moe_bench && xz -T1 -c /tmp/b > $D/cpu_moe_bench.xz
#   strip -o /tmp/t $T && xz -T1 -c /tmp/t > $D/moe_kernels_tests.xz
#   cp kernels/bench/decode_ab_on_device.sh $D/run.sh
# Call: D=.device/cpuk9 OUT=$OUT bash .device/cpuk9/run.sh   (PATHS=… overrides the list of paths)
set -u
D=${D:-.device/cpuk9}
OUT=${OUT:-/tmp/cpuk9out}
L=$OUT/cpuk9
mkdir -p "$L"
xz -d -k -f "$D"/*.xz
chmod +x "$D"/cpu_moe_bench "$D"/moe_kernels_tests
B=$D/cpu_moe_bench
# Reserved 2 MiB pages for the packed experts (largest set: 16 Qwen-shape layers of 64 bf16 experts,
# 9.7 GB, plus the 2 GiB probe); without root the experts go on transparent huge pages. The previous
# reservation is put back at the end.
PREV_PAGES=$(cat /proc/sys/vm/nr_hugepages)
if [ -w /proc/sys/vm/nr_hugepages ]; then echo "${PAGES:-14000}" > /proc/sys/vm/nr_hugepages; fi
echo "2M pages: $(cat /proc/sys/vm/nr_hugepages); $(lscpu | grep -E 'Model name' | sed 's/  */ /g')"

# One line per dtype x tokens: each path's median ms and % of the DRAM probe (median call).
summ() {
  awk '
    /^## dtype/ { d=$3; sub(/:.*/,"",d) }
    /^\| [0-9]+ \| [0-9]+ \|/ {
      split($0,f,"|"); for (i in f) gsub(/ /,"",f[i]);
      p=f[12]; gsub(/chained/,"ch",p); gsub(/streams/,"st",p); gsub(/split/,"sp",p); gsub(/fused/,"fu",p);
      gsub(/:pf/,"@",p); gsub(/:t0/,"",p); v=f[9]; gsub(/%/,"",v);
      k=d" t"f[3]; if (!(k in line)) { order[++n]=k; line[k]=k":" }
      line[k]=line[k]" "p" "f[5]"("v")"
    }
    END { for (i=1;i<=n;i++) print line[order[i]] }' "$1"
}

run() {
  local name=$1 cap=$2; shift 2
  local t0
  t0=$(date +%s)
  timeout "$cap" "$B" "$@" > "$L/$name.md" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  grep -E "^# pool|^# DRAM" "$L/$name.md" | sed 's/ (.*workers pinned.*//'
  grep -E "^## dtype" "$L/$name.md" | sed 's/ per layer.*memory/, memory/' | cut -c1-150
  summ "$L/$name.md"
}

P=${PATHS:-split,fused,chained,chained:pf4096:t0,streams,split,fused,chained,chained:pf4096:t0,streams}
T=${TOKENS:-1,2,4,6,8}
COMMON=(--threads 16 --iters 50 --probe-mib 2048 --paths "$P")
QWEN=(--experts 64 --topk 8 --hidden 2048 --inter 768 --layers 16 --tokens "$T")
ST=(--experts 32 --topk 6 --hidden 2560 --inter 768 --layers 16 --tokens "$T")
GLM=(--experts 24 --topk 8 --hidden 4096 --inter 1408 --layers 6 --tokens 1,4,8)
run qwen_bf16 16 "${QWEN[@]}" --dtype bf16 "${COMMON[@]}"
run qwen_int8 12 "${QWEN[@]}" --dtype int8 "${COMMON[@]}"
run st_bf16 14 "${ST[@]}" --dtype bf16 "${COMMON[@]}"
run st_int8 10 "${ST[@]}" --dtype int8 "${COMMON[@]}"
run glm_bf16 14 "${GLM[@]}" --dtype bf16 "${COMMON[@]}"
run glm_int8 10 "${GLM[@]}" --dtype int8 "${COMMON[@]}"
echo "$PREV_PAGES" > /proc/sys/vm/nr_hugepages 2>/dev/null
echo "== kernels' unit tests on this CPU (cpu::, AMX tier included)"
timeout 10 "$D"/moe_kernels_tests cpu:: > "$L/tests.log" 2>&1
echo "rc=$?"; grep -E "test result|FAILED|panicked" "$L/tests.log" | head -20
echo done
