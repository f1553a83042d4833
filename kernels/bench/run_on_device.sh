#!/bin/bash
# One device-tool call measuring the CPU expert kernels against kt-kernel in the same machine session.
# Stage first (build machine):
#   cargo build --release -p moe-daemon
#   cargo test --release --no-run -p moe-kernels   # note the "Executable unittests" path
#   mkdir -p .device && cp <that executable> .device/moe_kernels_tests
#   cp target/release/moe-daemon kernels/bench/run_on_device.sh ../shared/anchors/* .device/
# then: run(command="bash .device/run_on_device.sh", carry=[".device"]) — about 2 minutes; results in $OUT.
cd "$(dirname "$0")"
O=${OUT:-/tmp/out}
mkdir -p "$O"
S=$O/summary.txt
./moe_kernels_tests --test-threads 4 > "$O/tests.log" 2>&1; echo "tests rc=$?" >> "$S"
grep -E "test result|panicked" "$O/tests.log" >> "$S"
echo 7000 > /proc/sys/vm/nr_hugepages            # 2 MiB pages for the expert memory (root only)
B="--experts 128 --topk 8 --hidden 2048 --inter 768 --layers 8"
./moe-daemon bench cpu-moe $B --dtype bf16,int8,int4,fp8 --tokens 1,4,16,64,256,1024 --threads 8,12,16 --iters 30 \
    > "$O/ours.md" 2>&1; echo "ours rc=$?" >> "$S"
MOE_CPU_PREFETCH=0 ./moe-daemon bench cpu-moe $B --dtype bf16,int4 --tokens 1,64 --threads 16 --iters 30 --probe-mib 1024 \
    > "$O/ours_noprefetch.md" 2>&1
./moe-daemon bench cpu-moe $B --dtype bf16,int8 --tokens 256,1024 --threads 16 --iters 20 --tier avx512 --probe-mib 1024 \
    > "$O/ours_avx512.md" 2>&1
echo 0 > /proc/sys/vm/nr_hugepages
# kt-kernel: the anchor script, except that one random source serves all 8 layers (kt-kernel repacks each
# layer into its own memory, so every layer still streams from DRAM); saves ~10 s of numpy per layer.
python3 - <<'PY'
s = open("kt_moe_bench.py").read()
old = "    g, u, d = bf16((E, I, H)), bf16((E, I, H)), bf16((E, H, I))"
assert old in s
s = s.replace(old, "    if L == 0:\n    " + old)
open("kt_moe_bench_fast.py", "w").write(s)
PY
python3 -m pip install -q --no-index --no-deps --target /tmp/site kt_kernel-*.whl
export PYTHONPATH=/tmp/site/kt_kernel
for t in 12 16 8; do
    timeout 100 python3 kt_moe_bench_fast.py --threads $t --layers 8 --iters 30 --cls AMXBF16_MOE \
        --qlens 1 4 16 64 256 1024 2>&1 | grep qlen | sed "s/^/threads=$t /" >> "$O/kt.txt"
done
for c in AMXInt8_MOE AMXInt4_MOE; do
    timeout 100 python3 kt_moe_bench_fast.py --threads 12 --layers 8 --iters 30 --cls $c \
        --qlens 1 4 16 64 256 1024 2>&1 | grep qlen | sed "s/^/threads=12 /" >> "$O/kt.txt"
done
cat "$S"; grep -E "DRAM|dtype|^\| 16 |^\| 12 \| 1 " "$O/ours.md"; cat "$O/kt.txt"
