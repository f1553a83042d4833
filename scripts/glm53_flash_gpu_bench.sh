#!/usr/bin/env bash
# GLM-5.3-Flash shape on the CUDA backend (H200 host): FP8 synthetic checkpoint of the first 8 layers
# (layers 0-2 dense FFN, 3 and 7 indexed MLA, the rest linear attention; 5 MoE layers of 288 FP8 experts,
# ~36 GiB), decode with every routed expert in DRAM and with 14 GPU experts per layer, prefill 4096.
# A 4-layer view of the same files (one MoE layer) gives the cost of layers 4-7 by difference; layers
# 4..44 of the real model follow the same 3 linear : 1 indexed pattern, so full depth is extrapolated as
# T(45) = T(4) + 41/4 · (T(8) - T(4)).
# Stage (build machine): .device/moe-daemon (release, stripped; or B=path/to/moe-daemon); carry .device.
# Usage there, one phase per call (each < 10 min):
#   bash scripts/glm53_flash_gpu_bench.sh synth|dram|gpu14|small|graphs|graphs-small|clean
# `graphs` / `graphs-small`: decode only, CUDA graphs on and off in turn in one process (--graphs-ab; hybrid
# models replay graphs only with --cuda-graphs-hybrid) at 8 / 4 layers.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/glm53-out}; mkdir -p "$OUT"
M=/tmp/glm53-8; V=/tmp/glm53-4
B=${B:-.device/moe-daemon}
bench() { # label, model, extra args
    local label=$1 model=$2; shift 2
    echo "== $label"
    timeout 280 "$B" bench decode --model "$model" --device cuda --steps 16 --prompt-len 32 "$@" 2>&1 |
        grep -E "^loaded|^prefill|^decode|per step|graphs A/B|^A/B|^logits|GPU memory|rror|WARN" | tee -a "$OUT/bench.log"
}
case "${1:-}" in
synth)
    df -h /tmp | tail -1; free -g | head -2
    t0=$(date +%s)
    timeout 550 "$B" bench synth-checkpoint --like glm-5.3-flash --layers 8 --dtype fp8 --out "$M" \
        > "$OUT/synth.log" 2>&1
    echo "synth rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/synth.log"; du -sh "$M"
    # the 4-layer view: same tensor files, config cut to 4 layers (unused tensors are never read)
    mkdir -p "$V"; for f in "$M"/*; do ln -sf "$f" "$V/"; done; rm -f "$V/config.json"
    python3 - "$M/config.json" "$V/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); t = c["text_config"]; L = 4
t["num_hidden_layers"] = L
for k in ("layer_types", "mlp_layer_types", "indexer_types"):
    if isinstance(t.get(k), list): t[k] = t[k][:L]
lac = t.get("linear_attn_config") or {}
for k in ("kda_layers", "full_attn_layers"):
    if isinstance(lac.get(k), list): lac[k] = [i for i in lac[k] if i < L]
json.dump(c, open(sys.argv[2], "w"))
PY
    echo "view rc=$?"; ls -la "$V" | head ;;
dram)  bench "8 layers, all routed experts in DRAM" "$M" --gpu-experts 0 --prefill-lens 4096 ;;
gpu14) bench "8 layers, 14 GPU experts per layer" "$M" --gpu-experts 14 --prefill-lens 4096 ;;
small)
    bench "4 layers, all routed experts in DRAM" "$V" --gpu-experts 0
    bench "4 layers, 14 GPU experts per layer" "$V" --gpu-experts 14 ;;
graphs)
    bench "8 layers, all routed experts in DRAM, CUDA graphs and eager in turn" "$M" --gpu-experts 0 \
        --cuda-graphs-hybrid --graphs-ab 5
    bench "8 layers, 14 GPU experts per layer, CUDA graphs and eager in turn" "$M" --gpu-experts 14 \
        --cuda-graphs-hybrid --graphs-ab 5 ;;
graphs-small)
    bench "4 layers, all routed experts in DRAM, CUDA graphs and eager in turn" "$V" --gpu-experts 0 \
        --cuda-graphs-hybrid --graphs-ab 5
    bench "4 layers, 14 GPU experts per layer, CUDA graphs and eager in turn" "$V" --gpu-experts 14 \
        --cuda-graphs-hybrid --graphs-ab 5 ;;
clean) rm -rf "$M" "$V" ;;
*) echo "usage: $0 synth|dram|gpu14|small|graphs|graphs-small|clean"; exit 2 ;;
esac
