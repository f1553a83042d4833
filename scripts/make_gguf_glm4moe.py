#!/usr/bin/env python3
"""Write a random-weight GGUF with llama.cpp's `glm4moe` layout, streaming (GLM-4.5-Air by default: 46 layers,
the first dense, hidden 4096, 96 q-heads / 8 kv-heads of 128 with q/k/v biases, partial RoPE over 64 of 128,
128 routed experts of width 1408 plus one shared expert, top-8 sigmoid router with a correction bias, dense
intermediate 10944, vocab 151552, untied output). Metadata and tensor names are those llama.cpp's converter
writes for Glm4MoeForCausalLM (no MTP layer: `nextn_predict_layers` 0). Weights come from the random pools of
gguf_random.py beside this script, so the file is written at disk speed. Both llama.cpp and `moe-daemon
bench` read it: the same weights for both.

Types: --dtype for the routed experts, --dense-dtype for attention, the dense layer, shared experts and
token_embd, --output-dtype for output.weight. A tensor whose rows are not whole blocks of its type (1408-wide
down projections and the 10944-wide dense down projection under K-quants) takes --fallback-dtype (default
Q8_0). llama.cpp's quantizer falls back to Q5_0 for Q4_K rows (Q8_0 for Q6_K): a GLM-4.5-Air Q4_K_M file
from llama-quantize holds Q5_0 down projections, a type moe-daemon's GGUF reader does not take yet
(`--fallback-dtype q5_0` writes such a file).

    python3 scripts/make_gguf_glm4moe.py --layers 12 --dtype q4_0 --dense-dtype q4_k --output-dtype q6_k \\
        --out /dev/shm/glm12.gguf                                   # Q4_K_M-style dense, ~15 GiB
    python3 scripts/make_gguf_glm4moe.py --layers 2 --experts 8 --vocab 4096 --out /tmp/g.gguf   # smoke test
"""
import argparse

import gguf
from gguf import GGMLQuantizationType as QT
from gguf_random import DTYPES, F32, FILE_TYPE, Tensor, fits, total_bytes, write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=46)
    ap.add_argument("--dense-layers", type=int, default=1, help="leading dense layers")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=1408, help="routed (and shared) expert width")
    ap.add_argument("--ffn", type=int, default=10944, help="dense layers' intermediate width")
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151552)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="type of the routed experts")
    ap.add_argument("--dense-dtype", choices=sorted(DTYPES), default=None, help="default: --dtype")
    ap.add_argument("--output-dtype", choices=sorted(DTYPES), default=None, help="default: --dense-dtype")
    ap.add_argument("--fallback-dtype", choices=sorted(DTYPES), default="q8_0",
                    help="for rows that are not whole blocks of the chosen type")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="print the size only")
    a = ap.parse_args()

    et = DTYPES[a.dtype]
    dt = DTYPES[a.dense_dtype or a.dtype]
    ot = DTYPES[a.output_dtype or a.dense_dtype or a.dtype]
    fb = DTYPES[a.fallback_dtype]
    H, F, FF, E, L, V, HD = a.hidden, a.inter, a.ffn, a.experts, a.layers, a.vocab, a.head_dim
    NQ, NKV = a.heads * HD, a.kv_heads * HD

    def fit(t: QT, row: int) -> QT:
        return t if fits(t, row) else fb

    tensors = [Tensor("token_embd.weight", (V, H), fit(dt, H))]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [
            Tensor(p + "attn_norm.weight", (H,), F32, "one"),
            Tensor(p + "attn_q.weight", (NQ, H), fit(dt, H)),
            Tensor(p + "attn_q.bias", (NQ,), F32, "normal"),
            Tensor(p + "attn_k.weight", (NKV, H), fit(dt, H)),
            Tensor(p + "attn_k.bias", (NKV,), F32, "normal"),
            Tensor(p + "attn_v.weight", (NKV, H), fit(dt, H)),
            Tensor(p + "attn_v.bias", (NKV,), F32, "normal"),
            Tensor(p + "attn_output.weight", (H, NQ), fit(dt, NQ)),
            Tensor(p + "post_attention_norm.weight", (H,), F32, "one"),
        ]
        if i < a.dense_layers:
            tensors += [
                Tensor(p + "ffn_gate.weight", (FF, H), fit(dt, H)),
                Tensor(p + "ffn_up.weight", (FF, H), fit(dt, H)),
                Tensor(p + "ffn_down.weight", (H, FF), fit(dt, FF)),
            ]
        else:
            tensors += [
                Tensor(p + "ffn_gate_inp.weight", (E, H), F32, "normal"),
                Tensor(p + "exp_probs_b.bias", (E,), F32, "zero"),
                Tensor(p + "ffn_gate_exps.weight", (E, F, H), fit(et, H)),
                Tensor(p + "ffn_up_exps.weight", (E, F, H), fit(et, H)),
                Tensor(p + "ffn_down_exps.weight", (E, H, F), fit(et, F)),
                Tensor(p + "ffn_gate_shexp.weight", (F, H), fit(dt, H)),
                Tensor(p + "ffn_up_shexp.weight", (F, H), fit(dt, H)),
                Tensor(p + "ffn_down_shexp.weight", (H, F), fit(dt, F)),
            ]
    tensors += [Tensor("output_norm.weight", (H,), F32, "one"), Tensor("output.weight", (V, H), fit(ot, H))]
    used = sorted({t.qt.name for t in tensors})
    print(f"glm4moe L={L} (dense {a.dense_layers}) H={H} E={E}+1 shared top{a.topk} F={F} experts {a.dtype}, "
          f"dense {dt.name}, output {ot.name} (types used: {', '.join(used)}): {total_bytes(tensors)/2**30:.2f} GiB",
          flush=True)
    if a.dry_run:
        return

    w = gguf.GGUFWriter(path=None, arch="glm4moe")
    w.add_context_length(a.ctx)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(FF)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_freq_base(1.0e6)
    w.add_rope_dimension_count(HD // 2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_file_type(int(FILE_TYPE[a.dtype]))
    w.add_expert_count(E)
    w.add_expert_used_count(a.topk)
    w.add_expert_shared_count(1)
    w.add_expert_feed_forward_length(F)
    w.add_leading_dense_block_count(a.dense_layers)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if hasattr(w, "add_nextn_predict_layers"):
        w.add_nextn_predict_layers(0)
    write(w, a.out, tensors, V, a.seed)


if __name__ == "__main__":
    main()
