#!/usr/bin/env bash
# CPU routed-expert kernels at decode sizes on the H200 host: the split path (gate/up, down activations
# and down as separate pool regions) against the fused one (one region, per-expert readiness), in ONE
# process per shape (`--paths split,fused,split,fused`: each token count timed four times, the paths
# alternating), both shapes of the seeds, bf16 and int8, tokens 1,2,4,6,8, 16 threads, enough layers
# cycled that every call reads its weights from DRAM (24-32 layers ≫ the 320 MB L3). Then the fused
# path's item sizes (MOE_CPU_DECODE_ITEM_KIB), the kernels' prefetch distance (MOE_CPU_PREFETCH) and
# cache hint (MOE_CPU_PREFETCH_HINT), and the kernels' unit tests on this CPU.
#
# Staging (build machine, branch checkout):
#   cargo build --release -p moe-kernels --example cpu_moe_bench
#   T=$(cargo test --release --no-run -p moe-kernels --lib 2>&1 | grep -o 'target/release/deps/moe_kernels-[0-9a-f]*')
#   D=/work/main/.device/cpudec8; mkdir -p $D
#   xz -T2 -c target/release/examples/cpu_moe_bench > $D/cpu_moe_bench.xz; xz -T2 -c $T > $D/moe_kernels_tests.xz
#   cp kernels/bench/decode_ab_on_device.sh $D/
# Call: D=.device/cpudec8; xz -d -k -f $D/*.xz; chmod +x $D/*; OUT=$OUT D=$D bash $D/decode_ab_on_device.sh
set -u
D=${D:-.device/cpudec8}
OUT=${OUT:-/tmp/decode_ab}
mkdir -p "$OUT"
B=$D/cpu_moe_bench
log() { echo "[$(date +%H:%M:%S)] $*"; }

# Reserved 2 MiB pages for the packed experts (largest set: 24 Qwen layers of bf16, 29 GB, plus the
# 4 GiB probe); without root the experts go on transparent huge pages.
# The previous reservation is put back at the end.
PREV_PAGES=$(cat /proc/sys/vm/nr_hugepages)
if [ -w /proc/sys/vm/nr_hugepages ]; then echo "${PAGES:-17000}" > /proc/sys/vm/nr_hugepages; fi
log "2 MiB pages reserved: $(cat /proc/sys/vm/nr_hugepages)"
lscpu | grep -E "Model name|L2 cache|L3 cache" | sed 's/  */ /g'

COMMON=(--threads 16 --tokens 1,2,4,6,8 --iters 60)
QWEN=(--experts 128 --topk 8 --hidden 2048 --inter 768)
ST=(--experts 64 --topk 6 --hidden 2560 --inter 768)

log "A/B Qwen3-30B-A3B shape"
timeout 100 "$B" "${QWEN[@]}" --layers 24 --dtype bf16,int8 "${COMMON[@]}" \
  --paths split,fused,split,fused > "$OUT/qwen_ab.md" 2>&1
cat "$OUT/qwen_ab.md"
log "A/B SmallThinker-21B shape"
timeout 100 "$B" "${ST[@]}" --layers 32 --dtype bf16,int8 "${COMMON[@]}" \
  --paths split,fused,split,fused > "$OUT/st_ab.md" 2>&1
cat "$OUT/st_ab.md"

# Knobs read once per process (one process each, 12 Qwen layers of bf16, 0.9 GB cycled at 1 token):
# the fused path's item sizes, then the kernels' prefetch distance and cache hint on both paths.
tune() {
  local name=$1 paths=$2; shift 2
  log "tuning: $name"
  env "$@" timeout 40 "$B" "${QWEN[@]}" --layers 12 --dtype bf16 --threads 16 --tokens 1,8 --iters 60 \
    --paths "$paths" --probe-mib 1024 > "$OUT/tune_$name.md" 2>&1
  grep -E "^\| 16 \||DRAM read" "$OUT/tune_$name.md"
}
tune default split,fused
tune items128_96 fused,fused MOE_CPU_DECODE_ITEM_KIB=128,96
tune items512_384 fused,fused MOE_CPU_DECODE_ITEM_KIB=512,384
tune prefetch8192 split,fused MOE_CPU_PREFETCH=8192
tune hint_nta split,fused MOE_CPU_PREFETCH_HINT=nta
tune hint_t1 split,fused MOE_CPU_PREFETCH_HINT=t1

log "kernel unit tests (cpu::moe, cpu::bench, cpu::pool)"
timeout 60 "$D/moe_kernels_tests" cpu::moe cpu::bench cpu::pool > "$OUT/tests.log" 2>&1
grep -E "test result|FAILED|panicked" "$OUT/tests.log"
echo "$PREV_PAGES" > /proc/sys/vm/nr_hugepages 2>/dev/null
log done
