#!/usr/bin/env python3
"""Write a random-weight GGUF with llama.cpp's `smallthinker` layout, streaming (SmallThinker-21B-A3B by
default: 52 layers, hidden 2560, 28 q-heads / 4 kv-heads of 128, 64 experts of width 768, top-6, softmax
router, 4096 sliding window, untied output, vocab 151936, rope theta 1.5e6). Metadata and tensor names
are those llama.cpp's converter writes for SmallThinkerForCausalLM (see
tests/fixtures/make_smallthinker_gguf.py, which does it from real safetensors); weights come from the
random pools of the peer kit's make_gguf_qwen3moe.py (imported from PEERS, default
/work/shared/peers or .device/peers), so the file is written at disk speed. Both llama.cpp and
`moe-daemon bench` read it: the same weights for both.

    python3 scripts/make_gguf_smallthinker.py --out /dev/shm/st21.gguf            # ~40 GiB, bf16
    python3 scripts/make_gguf_smallthinker.py --layers 2 --vocab 4096 --out /tmp/s.gguf   # smoke test
    python3 scripts/make_gguf_smallthinker.py --dense-dtype q4_k --output-dtype q6_k --out ...  # Q4_K_M-style dense
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
from gguf import GGMLQuantizationType as QT  # noqa: E402
from make_gguf_qwen3moe import DTYPES, FILE_TYPE, STD, Pool, nbytes_of  # noqa: E402


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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="print the size only")
    a = ap.parse_args()

    qt, f32 = DTYPES[a.dtype], QT.F32
    dt = DTYPES[a.dense_dtype or a.dtype]
    ot = DTYPES[a.output_dtype or a.dense_dtype or a.dtype]
    H, F, E, L, V, HD = a.hidden, a.inter, a.experts, a.layers, a.vocab, a.head_dim
    NQ, NKV = a.heads * HD, a.kv_heads * HD
    tensors = [("token_embd.weight", (V, H), dt, "w")]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (H,), f32, "one"),
            (p + "attn_q.weight", (NQ, H), dt, "w"),
            (p + "attn_k.weight", (NKV, H), dt, "w"),
            (p + "attn_v.weight", (NKV, H), dt, "w"),
            (p + "attn_output.weight", (H, NQ), dt, "w"),
            (p + "ffn_norm.weight", (H,), f32, "one"),
            (p + "ffn_gate_inp.weight", (E, H), f32, "router"),
            (p + "ffn_gate_exps.weight", (E, F, H), qt, "w"),
            (p + "ffn_up_exps.weight", (E, F, H), qt, "w"),
            (p + "ffn_down_exps.weight", (E, H, F), qt, "w"),
        ]
    tensors += [("output_norm.weight", (H,), f32, "one"), ("output.weight", (V, H), ot, "w")]
    sizes = [nbytes_of(s, t) for _, s, t, _ in tensors]
    print(f"smallthinker L={L} H={H} E={E} top{a.topk} F={F} experts {a.dtype}, dense {dt.name}, output {ot.name}: "
          f"{sum(sizes)/2**30:.2f} GiB", flush=True)
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
    w.add_file_type(int(FILE_TYPE[a.dtype]))
    w.add_expert_count(E)
    w.add_expert_used_count(a.topk)
    w.add_expert_feed_forward_length(F)
    w.add_feed_forward_length(F)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if a.sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if a.window:
        w.add_sliding_window(a.window)
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
    pools = {t: Pool(t, 64 << 20, rng, False) for t in sorted({qt, dt, ot})}
    t0 = time.time()
    for (name, shape, t, kind), nb in zip(tensors, sizes):
        n = int(np.prod(shape))
        if kind == "one":
            fout.write(np.ones(n, np.float32).tobytes())
        elif kind == "router":
            fout.write((rng.standard_normal(n, dtype=np.float32) * STD).tobytes())
        else:
            for mv in pools[t].chunks(nb, 8 << 20):
                fout.write(mv)
        pad(nb)
    w.close()
    print(f"wrote {a.out}: {os.path.getsize(a.out)/2**30:.2f} GiB in {time.time()-t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
