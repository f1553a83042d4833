#!/usr/bin/env python3
"""Write a random-weight GGUF with llama.cpp's `smallthinker` layout, streaming (SmallThinker-21B-A3B by
default: 52 layers, hidden 2560, 28 q-heads / 4 kv-heads of 128, 64 experts of width 768, top-6, softmax
router, 4096 sliding window, untied output, vocab 151936, rope theta 1.5e6). Metadata and tensor names
are those llama.cpp's converter writes for SmallThinkerForCausalLM (see
tests/fixtures/make_smallthinker_gguf.py, which does it from real safetensors); weights come from the
random pools of gguf_random.py beside this script, so the file is written at disk speed. Both llama.cpp and
`moe-daemon bench` read it: the same weights for both.

    python3 scripts/make_gguf_smallthinker.py --out /dev/shm/st21.gguf            # ~40 GiB, bf16
    python3 scripts/make_gguf_smallthinker.py --layers 2 --vocab 4096 --out /tmp/s.gguf   # smoke test
    python3 scripts/make_gguf_smallthinker.py --dense-dtype q4_k --output-dtype q6_k --out ...  # Q4_K_M-style dense
    python3 scripts/make_gguf_smallthinker.py --mix q4_k_m --out ...   # llama-quantize Q4_K_M's types, ~12 GiB

`--mix q4_k_m` gives every tensor the type llama-quantize's Q4_K_M gives it (gguf_random.q4_k_m_type): Q4_K,
with Q6_K for attn_v and ffn_down_exps in llama.cpp's `use_more_bits` layers (the first and last eighth and
every third between: 26 of 52) and for the output (the token table when --tied); norms and routers F32.
That is the file llama.cpp users run with `-ot exps=CPU`.
"""
import argparse
from collections import Counter

import gguf
from gguf_random import DTYPES, F32, FILE_TYPE, Tensor, q4_k_m_type, total_bytes, write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=52)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--window", type=int, default=4096, help="0: no sliding window")
    ap.add_argument("--sigmoid", action="store_true", help="sigmoid router (default softmax, as the 21B)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="type of the expert tensors")
    ap.add_argument("--dense-dtype", choices=sorted(DTYPES), default=None,
                    help="attention projections and token_embd (default: --dtype); q4_k with --output-dtype "
                         "q6_k is llama.cpp's Q4_K_M choice for those tensors")
    ap.add_argument("--output-dtype", choices=sorted(DTYPES), default=None,
                    help="output.weight (lm_head; default: --dense-dtype)")
    ap.add_argument("--mix", choices=["q4_k_m"], default=None,
                    help="llama-quantize's type for every matrix instead of --dtype / --dense-dtype / --output-dtype")
    ap.add_argument("--tied", action="store_true", help="no output.weight: the token table is the lm_head (4B-A0.6B)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="print the size only")
    a = ap.parse_args()

    qt = DTYPES[a.dtype]
    dt = DTYPES[a.dense_dtype or a.dtype]
    ot = DTYPES[a.output_dtype or a.dense_dtype or a.dtype]
    H, F, E, L, V, HD = a.hidden, a.inter, a.experts, a.layers, a.vocab, a.head_dim
    NQ, NKV = a.heads * HD, a.kv_heads * HD
    tensors = [Tensor("token_embd.weight", (V, H), dt)]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [
            Tensor(p + "attn_norm.weight", (H,), F32, "one"),
            Tensor(p + "attn_q.weight", (NQ, H), dt),
            Tensor(p + "attn_k.weight", (NKV, H), dt),
            Tensor(p + "attn_v.weight", (NKV, H), dt),
            Tensor(p + "attn_output.weight", (H, NQ), dt),
            Tensor(p + "ffn_norm.weight", (H,), F32, "one"),
            Tensor(p + "ffn_gate_inp.weight", (E, H), F32, "normal"),
            Tensor(p + "ffn_gate_exps.weight", (E, F, H), qt),
            Tensor(p + "ffn_up_exps.weight", (E, F, H), qt),
            Tensor(p + "ffn_down_exps.weight", (E, H, F), qt),
        ]
    tensors += [Tensor("output_norm.weight", (H,), F32, "one")]
    if not a.tied:
        tensors += [Tensor("output.weight", (V, H), ot)]
    if a.mix:
        tensors = [t._replace(qt=q4_k_m_type(t.name, L, t.shape[-1], not a.tied)) if t.kind == "w" else t
                   for t in tensors]
    used = ", ".join(f"{q} {n}" for q, n in sorted(Counter(t.qt.name for t in tensors).items()))
    print(f"smallthinker L={L} H={H} E={E} top{a.topk} F={F} "
          + (f"llama.cpp {a.mix.upper()} mix" if a.mix else f"experts {a.dtype}, dense {dt.name}, output {ot.name}")
          + f" (tensors: {used}): {total_bytes(tensors)/2**30:.2f} GiB", flush=True)
    if a.dry_run:
        return

    w = gguf.GGUFWriter(path=None, arch="smallthinker")
    w.add_context_length(a.ctx)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_freq_base(1.5e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M if a.mix else FILE_TYPE[a.dtype]))
    w.add_expert_count(E)
    w.add_expert_used_count(a.topk)
    w.add_expert_feed_forward_length(F)
    w.add_feed_forward_length(F)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if a.sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if a.window:
        w.add_sliding_window(a.window)
    write(w, a.out, tensors, V, a.seed)


if __name__ == "__main__":
    main()
