#!/bin/bash
# One device call: the FP8 expert kernels against bf16 and int8 at the same shape, in the same process as
# their DRAM probe, at the Qwen3-30B-A3B and GLM-5.3-Flash expert shapes; the previous FP8 decoder (16-bit
# table, forced by MOE_CPU_FP8_LUT16=1) for an A/B in the same session; kt-kernel's AMXFP8_MOE at both shapes.
# Stage first (build machine), from the repository root:
#   cargo build --release -p moe-daemon
#   cargo test --release --no-run -p moe-kernels   # note the "Executable unittests" path
#   mkdir -p .device && cp <that executable> .device/moe_kernels_tests
#   cp target/release/moe-daemon kernels/bench/fp8_on_device.sh kernels/bench/kt_fp8_bench.py \
#      ../shared/anchors/kt_kernel-*.whl .device/
# then: run(command="bash .device/fp8_on_device.sh", carry=[".device"]) — at most 9.5 minutes (every step has its timeout); results in $OUT.
cd "$(dirname "$0")"
O=${OUT:-/tmp/out}
mkdir -p "$O"
S=$O/summary.txt
timeout 90 ./moe_kernels_tests --test-threads 8 > "$O/tests.log" 2>&1; echo "tests rc=$?" >> "$S"
grep -E "test result|panicked" "$O/tests.log" >> "$S"
echo 7000 > /proc/sys/vm/nr_hugepages            # 2 MiB pages for the expert memory (root only)
# Qwen3-30B-A3B experts: hidden 2048, moe_intermediate_size 768, 128 experts top-8.
Q="--experts 128 --topk 8 --hidden 2048 --inter 768 --layers 8"
timeout 100 ./moe-daemon bench cpu-moe $Q --dtype fp8,int8,bf16 --tokens 1,4,16,64,256 --threads 16 --iters 30 \
    > "$O/qwen3.md" 2>&1; echo "qwen3 rc=$?" >> "$S"
MOE_CPU_FP8_LUT16=1 timeout 45 ./moe-daemon bench cpu-moe $Q --dtype fp8 --tokens 1,4,16 --threads 16 \
    --iters 30 --probe-mib 1024 > "$O/qwen3_fp8_lut16.md" 2>&1; echo "qwen3 lut16 rc=$?" >> "$S"
# GLM-5.3-Flash experts: hidden 4096, moe_intermediate_size 2048, top-8 of 288; 64 experts per layer here
# so 6 layers of bf16 fit the host's memory (a decode token reads 8 experts either way).
G="--experts 64 --topk 8 --hidden 4096 --inter 2048 --layers 6"
timeout 150 ./moe-daemon bench cpu-moe $G --dtype fp8,int8,bf16 --tokens 1,4,16,64 --threads 16 --iters 20 \
    > "$O/glm53.md" 2>&1; echo "glm53 rc=$?" >> "$S"
MOE_CPU_FP8_LUT16=1 timeout 50 ./moe-daemon bench cpu-moe $G --dtype fp8 --tokens 1,4 --threads 16 --iters 20 \
    --probe-mib 1024 > "$O/glm53_fp8_lut16.md" 2>&1; echo "glm53 lut16 rc=$?" >> "$S"
echo 0 > /proc/sys/vm/nr_hugepages
python3 -m pip install -q --no-index --no-deps --target /tmp/site kt_kernel-*.whl
export PYTHONPATH=/tmp/site/kt_kernel
timeout 50 python3 kt_fp8_bench.py --experts 128 --hidden 2048 --inter 768 --threads 12 --qlens 1 4 16 64 \
    > "$O/kt_fp8.txt" 2>&1; echo "kt qwen3 rc=$?" >> "$S"
timeout 70 python3 kt_fp8_bench.py --experts 64 --layers 6 --hidden 4096 --inter 2048 --threads 12 --qlens 1 4 16 \
    --iters 10 >> "$O/kt_fp8.txt" 2>&1; echo "kt glm53 rc=$?" >> "$S"
cat "$S"; grep -hE "DRAM|dtype|^\| 16 " "$O"/qwen3*.md "$O"/glm53*.md; grep -E "qlen|Error|error" "$O/kt_fp8.txt"
