#!/usr/bin/env bash
# Tensor parallelism on a node with two (or more) GPUs, in one call (written for nvidia-h200-x2):
#   1. the tensor-parallel GPU tests: loopback (every rank on GPU 0) and NCCL (one GPU per rank)
#      logits against one GPU on the fixtures (rel-L2 ≤ 2e-2) and transformers (≤ 5e-2);
#   2. decode and prefill of the Qwen3-30B-A3B shape (and GLM-4.5-Air's, fewer layers; optionally
#      DeepSeek-V3's, MLA) at 1 and 2 GPUs, with the experts that fit placed on the GPUs
#      (`--gpu-experts auto`), and with a fixed count; CUDA graphs on (each GPU captures its own);
#   3. a markdown table for docs/PERF.md.
# Stage first (from the branch): D/gpu_tests (dev-profile gpu_tests binary) and D/moe-daemon (release).
# Usage there: D=.device/tensor-parallel bash scripts/tp_gpu_session.sh [QWEN_LAYERS] [GLM_LAYERS] [DS_LAYERS]
#   QWEN_LAYERS (default 12): 1.2 GiB of bf16 experts per layer (12: 15 GiB in /dev/shm);
#   GLM_LAYERS (default 4, 0 = skip): 4.4 GiB per layer (4: 18 GiB). The engine's DRAM copy of the
#   experts is as large again: keep the sum under ~50 GiB of the 128 GiB RAM.
#   DS_LAYERS (default 0 = skip): DeepSeek-V3's first 3 layers are dense, each later one 22 GiB of
#   experts: 4 layers = 25 GiB (run it without GLM). The tests include MLA and the hybrid models
#   (GLM-5.3-Flash, GLM-5) over NCCL.
# Expected time: ~2 min tests + ~1.5 min per checkpoint and GPU count (load dominates): ~9 min with GLM.
set -uo pipefail
# run from the root of the repository (fixtures in tests/fixtures)
D=${D:-.device/tensor-parallel}
QL=${1:-12}
GL=${2:-4}
DL=${3:-0}
OUT=${OUT:-/tmp/tp-gpu}; mkdir -p "$OUT"
export MOE_FIXTURES=$PWD/tests/fixtures RUST_BACKTRACE=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -5

# cudarc opens libnccl.so; Debian's libnccl2 and the nvidia-nccl wheels ship libnccl.so.2 only.
NCCL_DIR=/tmp/tp-nccl; mkdir -p "$NCCL_DIR"
if ! ldconfig -p | grep -q 'libnccl.so '; then
    lib=$( (ldconfig -p | awk '/libnccl.so.2 /{print $NF}'; \
            find / -xdev -name 'libnccl.so.2' 2>/dev/null) | head -1)
    if [ -n "$lib" ]; then
        ln -sf "$lib" "$NCCL_DIR/libnccl.so"
        export LD_LIBRARY_PATH=$NCCL_DIR:${LD_LIBRARY_PATH:-}
        echo "NCCL: $lib (linked as libnccl.so)"
    else
        echo "NCCL: no libnccl.so.2 on this machine: the NCCL runs below will refuse to start"
    fi
fi

echo "== tensor-parallel GPU tests"
timeout 420 "$D/gpu_tests" tensor_parallel --test-threads 1 --nocapture > "$OUT/tp_tests.log" 2>&1
echo "rc=$?"
grep -E "^test |panicked|test result|skipped" "$OUT/tp_tests.log" | tail -20
grep -E "rel-L2" "$OUT/tp_tests.log" | awk '{for(i=1;i<=NF;i++) if($i=="GPU") print $(i+1)}' \
    | tr -d ',' | sort -g | tail -1 | sed 's/^/worst rel-L2 vs one GPU: /'

# bench NAME TP ARGS...: one decode and prefill run; its lines go to $OUT/NAME-tpTP.log
bench() {
    local name=$1 tp=$2; shift 2
    local log="$OUT/$name-tp$tp.log"
    timeout 420 "$D/moe-daemon" bench decode --device cuda --tensor-parallel "$tp" \
        --kv-cache-tokens 16384 --prefill-lens 512,4096 "$@" > "$log" 2>&1
    echo "$name tp=$tp rc=$?"
    grep -E "^decode|^prefill \(warm\)|GPU memory:|experts per layer on each|rror|refuse|does not fit" "$log" | head -8
}

row() { # NAME TP: one markdown row from the log
    local log="$OUT/$1-tp$2.log"
    local dec pre512 pre4k experts
    dec=$(grep -m1 '^decode' "$log" | sed -E 's/.*: ([0-9.]+) ms\/step, ([0-9.]+) tok\/s.*/\1 ms (\2 tok\/s)/')
    pre512=$(grep '^prefill (warm): 512 ' "$log" | sed -E 's/.*= ([0-9]+) tok\/s.*/\1/')
    pre4k=$(grep '^prefill (warm): 4096 ' "$log" | sed -E 's/.*= ([0-9]+) tok\/s.*/\1/')
    experts=$(grep -m1 -oE '[0-9]+ GPU experts per layer on each \([0-9]+ on the node\)|[0-9]+ GPU experts/layer' "$log")
    echo "| $1 | $2 | ${experts:-?} | ${dec:-failed} | ${pre512:--} | ${pre4k:--} |"
}

timeout 300 "$D/moe-daemon" bench synth-checkpoint --like qwen3-30b-a3b --layers "$QL" --out /dev/shm/q3tp >/dev/null 2>&1
echo "synth qwen3-30b-a3b ($QL layers) rc=$?"
for tp in 1 2; do
    bench "qwen3-30b-a3b-${QL}L-auto-b1" "$tp" --model /dev/shm/q3tp --gpu-experts auto --batch 1 --steps 64
    bench "qwen3-30b-a3b-${QL}L-32-b8" "$tp" --model /dev/shm/q3tp --gpu-experts 32 --batch 8 --steps 64
done
rm -rf /dev/shm/q3tp

if [ "$GL" -gt 0 ]; then
    timeout 400 "$D/moe-daemon" bench synth-checkpoint --like glm-4.5-air --layers "$GL" --out /dev/shm/glmtp >/dev/null 2>&1
    echo "synth glm-4.5-air ($GL layers) rc=$?"
    for tp in 1 2; do
        bench "glm-4.5-air-${GL}L-auto-b1" "$tp" --model /dev/shm/glmtp --gpu-experts auto --batch 1 --steps 32
        bench "glm-4.5-air-${GL}L-32-b8" "$tp" --model /dev/shm/glmtp --gpu-experts 32 --batch 8 --steps 32
    done
    rm -rf /dev/shm/glmtp
fi

if [ "$DL" -gt 0 ]; then
    timeout 400 "$D/moe-daemon" bench synth-checkpoint --like deepseek-v3 --layers "$DL" --out /dev/shm/dstp >/dev/null 2>&1
    echo "synth deepseek-v3 ($DL layers) rc=$?"
    for tp in 1 2; do
        bench "deepseek-v3-${DL}L-auto-b1" "$tp" --model /dev/shm/dstp --gpu-experts auto --batch 1 --steps 32
    done
    rm -rf /dev/shm/dstp
fi

echo
echo "| checkpoint (synthetic, layers, GPU experts, batch) | GPUs | GPU experts per layer | decode per step | prefill 512 tok/s | prefill 4096 tok/s |"
echo "|---|---|---|---|---|---|"
for name in "qwen3-30b-a3b-${QL}L-auto-b1" "qwen3-30b-a3b-${QL}L-32-b8" "glm-4.5-air-${GL}L-auto-b1" "glm-4.5-air-${GL}L-32-b8" "deepseek-v3-${DL}L-auto-b1"; do
    for tp in 1 2; do
        [ -f "$OUT/$name-tp$tp.log" ] && row "$name" "$tp"
    done
done
