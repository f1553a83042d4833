#!/usr/bin/env python3
"""Write a random-weight GGUF with llama.cpp's `glm4moe` layout, streaming (GLM-4.5-Air by default: 46 layers,
the first dense, hidden 4096, 96 q-heads / 8 kv-heads of 128 with q/k/v biases, partial RoPE over 64 of 128,
128 routed experts of width 1408 plus one shared expert, top-8 sigmoid router with a correction bias, dense
intermediate 10944, vocab 151552, untied output). Metadata and tensor names are those llama.cpp's converter
writes for Glm4MoeForCausalLM (no MTP layer: `nextn_predict_layers` 0). Weights come from the random pools of
the peer kit's make_gguf_qwen3moe.py (imported from PEERS, default /work/shared/peers or .device/peers), so
the file is written at disk speed. Both llama.cpp and `moe-daemon bench` read it: the same weights for both.

Types: --dtype for the routed experts, --dense-dtype for attention, the dense layer, shared experts and
token_embd, --output-dtype for output.weight. A tensor whose rows are not whole blocks of its type (1408-wide
down projections and the 10944-wide dense down projection under K-quants) takes --fallback-dtype, as
llama.cpp's quantizer falls back for such rows.

    python3 scripts/make_gguf_glm4moe.py --layers 12 --dtype q4_0 --dense-dtype q4_k --output-dtype q6_k \\
        --out /dev/shm/glm12.gguf                                   # Q4_K_M-style dense, ~15 GiB
    python3 scripts/make_gguf_glm4moe.py --layers 2 --experts 8 --vocab 4096 --out /tmp/g.gguf   # smoke test
"""
import argparse
import os
import sys
import time

import numpy as np

for d in [os.environ.get("PEERS", ""), ".device/peers", "/work/shared/peers"]:
    if d and os.path.exists(os.path.join(d, "make_gguf_qwen3moe.py")):
        sys.path.insert(0, d)
        break
import gguf  # noqa: E402
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from make_gguf_qwen3moe import DTYPES, FILE_TYPE, STD, Pool, nbytes_of  # noqa: E402


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

    et, f32 = DTYPES[a.dtype], QT.F32
    dt = DTYPES[a.dense_dtype or a.dtype]
    ot = DTYPES[a.output_dtype or a.dense_dtype or a.dtype]
    fb = DTYPES[a.fallback_dtype]
    H, F, FF, E, L, V, HD = a.hidden, a.inter, a.ffn, a.experts, a.layers, a.vocab, a.head_dim
    NQ, NKV = a.heads * HD, a.kv_heads * HD

    def fit(t: QT, row: int) -> QT:
        return t if row % GGML_QUANT_SIZES[t][0] == 0 else fb

    tensors = [("token_embd.weight", (V, H), fit(dt, H), "w")]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (H,), f32, "one"),
            (p + "attn_q.weight", (NQ, H), fit(dt, H), "w"),
            (p + "attn_q.bias", (NQ,), f32, "bias"),
            (p + "attn_k.weight", (NKV, H), fit(dt, H), "w"),
            (p + "attn_k.bias", (NKV,), f32, "bias"),
            (p + "attn_v.weight", (NKV, H), fit(dt, H), "w"),
            (p + "attn_v.bias", (NKV,), f32, "bias"),
            (p + "attn_output.weight", (H, NQ), fit(dt, NQ), "w"),
            (p + "post_attention_norm.weight", (H,), f32, "one"),
        ]
        if i < a.dense_layers:
            tensors += [
                (p + "ffn_gate.weight", (FF, H), fit(dt, H), "w"),
                (p + "ffn_up.weight", (FF, H), fit(dt, H), "w"),
                (p + "ffn_down.weight", (H, FF), fit(dt, FF), "w"),
            ]
        else:
            tensors += [
                (p + "ffn_gate_inp.weight", (E, H), f32, "router"),
                (p + "exp_probs_b.bias", (E,), f32, "zero"),
                (p + "ffn_gate_exps.weight", (E, F, H), fit(et, H), "w"),
                (p + "ffn_up_exps.weight", (E, F, H), fit(et, H), "w"),
                (p + "ffn_down_exps.weight", (E, H, F), fit(et, F), "w"),
                (p + "ffn_gate_shexp.weight", (F, H), fit(dt, H), "w"),
                (p + "ffn_up_shexp.weight", (F, H), fit(dt, H), "w"),
                (p + "ffn_down_shexp.weight", (H, F), fit(dt, F), "w"),
            ]
    tensors += [("output_norm.weight", (H,), f32, "one"), ("output.weight", (V, H), fit(ot, H), "w")]
    sizes = [nbytes_of(s, t) for _, s, t, _ in tensors]
    used = sorted({t.name for _, _, t, _ in tensors})
    print(f"glm4moe L={L} (dense {a.dense_layers}) H={H} E={E}+1 shared top{a.topk} F={F} experts {a.dtype}, "
          f"dense {dt.name}, output {ot.name} (types used: {', '.join(used)}): {sum(sizes)/2**30:.2f} GiB",
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
    w.add_vocab_size(V)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("none")
    for (name, shape, t, _), nb in zip(tensors, sizes):
        w.add_tensor_info(name, shape, np.dtype(np.float32), nb, raw_dtype=t)
    w.write_header_to_file(path=a.out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout, align = w.fout[0], w.data_alignment

    def pad(n: int) -> None:
        if (-n) % align:
            fout.write(b"\0" * ((-n) % align))

    pad(fout.tell())
    rng = np.random.default_rng(a.seed)
    pools = {t: Pool(t, 64 << 20, rng, False) for t in sorted({t for _, _, t, k in tensors if k == "w"})}
    t0 = time.time()
    for (name, shape, t, kind), nb in zip(tensors, sizes):
        n = int(np.prod(shape))
        if kind == "one":
            fout.write(np.ones(n, np.float32).tobytes())
        elif kind == "zero":
            fout.write(np.zeros(n, np.float32).tobytes())
        elif kind in ("router", "bias"):
            fout.write((rng.standard_normal(n, dtype=np.float32) * STD).tobytes())
        else:
            for mv in pools[t].chunks(nb, 8 << 20):
                fout.write(mv)
        pad(nb)
    w.close()
    print(f"wrote {a.out}: {os.path.getsize(a.out)/2**30:.2f} GiB in {time.time()-t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
