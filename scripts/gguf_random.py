"""Random-weight GGUF files in llama.cpp's layouts, shared by the writers beside it
(make_gguf_smallthinker.py, make_gguf_glm4moe.py) and kernels/bench/make_gguf_llama.py.

Speed depends on tensor names, shapes and block types, not on values, so the writers declare a tensor list
and the metadata llama.cpp's converter writes for the architecture; this module encodes the weights and
writes the file streaming. Weights are normal(0, 0.02) values in the target type (bf16 / f16 / f32, Q8_0 /
Q4_0 / Q4_1 / Q5_0 through `gguf.quants`, the reference quantizers of llama.cpp), or, for Q4_K / Q6_K, random
blocks with small super-block scales. By default each chunk of each tensor is a slice of a ~64 MiB pool of
encoded blocks per type at a random offset, so a 40 GiB file is written at disk speed; `fresh` draws new
values for every tensor instead (small files). Norms are 1.0, routers and biases fresh f32 normal(0, 0.02).

Needs numpy and PyPI `gguf` (the peer kit's wheel, 0.19.0).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Iterator, NamedTuple

import numpy as np

try:
    import gguf
    import gguf.quants as gq
    from gguf import GGML_QUANT_SIZES, GGUFWriter
    from gguf import GGMLQuantizationType as QT
except ImportError as e:  # pragma: no cover
    sys.exit(f"cannot import gguf ({e}); pip install --no-index --target /tmp/site gguf-*.whl "
             "and export PYTHONPATH=/tmp/site")

DTYPES = {
    "bf16": QT.BF16,
    "f16": QT.F16,
    "f32": QT.F32,
    "q8_0": QT.Q8_0,
    "q4_0": QT.Q4_0,
    "q4_1": QT.Q4_1,
    "q5_0": QT.Q5_0,
    "q4_k": QT.Q4_K,
    "q6_k": QT.Q6_K,
}
FILE_TYPE = {  # general.file_type (llama_ftype) named after a tensor type
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "f32": gguf.LlamaFileType.ALL_F32,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
}
STD = 0.02
F32 = QT.F32
REFERENCE_QUANTIZERS = {QT.Q8_0: gq.Q8_0, QT.Q4_0: gq.Q4_0, QT.Q4_1: gq.Q4_1, QT.Q5_0: gq.Q5_0}


class Tensor(NamedTuple):
    """One tensor of the file: numpy shape (reversed ggml ne) and what fills it: "w" random weights of
    type `qt`, "one" / "zero" f32 constants, "normal" fresh f32 normal(0, STD) (routers, biases)."""

    name: str
    shape: tuple[int, ...]
    qt: QT
    kind: str = "w"


def nbytes_of(shape, qt: QT) -> int:
    n = int(np.prod(shape))
    blk, tsz = GGML_QUANT_SIZES[qt]
    if shape[-1] % blk:
        raise SystemExit(f"row length {shape[-1]} is not a multiple of the {qt.name} block size {blk}")
    return n // blk * tsz


def fits(qt: QT, row: int) -> bool:
    """Whether rows of `row` values are whole blocks of `qt`."""
    return row % GGML_QUANT_SIZES[qt][0] == 0


def encode(x: np.ndarray, qt: QT, rng: np.random.Generator) -> np.ndarray:
    """f32 values (a whole number of blocks) -> the bytes of type qt."""
    blk, tsz = GGML_QUANT_SIZES[qt]
    if qt == QT.F32:
        return x.astype(np.float32).view(np.uint8).ravel()
    if qt == QT.F16:
        return x.astype(np.float16).view(np.uint8).ravel()
    if qt == QT.BF16:  # round to nearest even, no NaNs here
        b = x.astype(np.float32).view(np.uint32)
        b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return b.astype(np.uint16).view(np.uint8).ravel()
    if qt in REFERENCE_QUANTIZERS:  # bit-exact with ggml-quants.c; `gq.quantize` adds a slow wrapper
        return REFERENCE_QUANTIZERS[qt].quantize_blocks(x.reshape(-1, blk)).ravel()
    # K-quants: random bytes with small super-block scales (values of order +-0.05)
    nblk = x.size // blk
    raw = rng.integers(0, 256, size=(nblk, tsz), dtype=np.uint8)
    if qt == QT.Q4_K:  # half d, half dmin, u8 scales[12], u8 qs[128]; y = d*sc*q - dmin*m
        raw[:, 0:2] = np.full(nblk, 1.0e-4, np.float16).view(np.uint8).reshape(nblk, 2)
        raw[:, 2:4] = np.full(nblk, 7.5e-4, np.float16).view(np.uint8).reshape(nblk, 2)
    elif qt == QT.Q6_K:  # u8 ql[128], u8 qh[64], i8 scales[16], half d; y = d*sc*(q-32)
        raw[:, 208:210] = np.full(nblk, 1.0e-5, np.float16).view(np.uint8).reshape(nblk, 2)
    else:
        raise SystemExit(f"no encoder for {qt.name}")
    return raw.ravel()


def random_weights(n: int, qt: QT, rng: np.random.Generator) -> np.ndarray:
    """`n` fresh normal(0, STD) values encoded as `qt`."""
    x = rng.standard_normal(n, dtype=np.float32)
    x *= STD
    return encode(x, qt, rng)


class Pool:
    """A pool of encoded random weights of one type; hands out block-aligned slices."""

    def __init__(self, qt: QT, pool_bytes: int, rng: np.random.Generator):
        self.qt, self.rng = qt, rng
        self.blk, self.tsz = GGML_QUANT_SIZES[qt]
        self.nblocks = max(1, pool_bytes // self.tsz)
        parts, left = [], self.nblocks
        while left:  # build in pieces to bound the float32 temporaries
            nb = min(left, max(1, (16 << 20) // (self.blk * 4)))
            parts.append(random_weights(nb * self.blk, qt, rng))
            left -= nb
        self.data = np.concatenate(parts)
        self.mv = memoryview(self.data)

    def chunks(self, total_bytes: int, chunk_bytes: int) -> Iterator[memoryview]:
        """Memoryviews that together are exactly total_bytes (whole blocks)."""
        chunk_blocks = max(1, min(chunk_bytes // self.tsz, self.nblocks // 2 or 1))
        left = total_bytes // self.tsz
        assert left * self.tsz == total_bytes
        while left:
            nb = min(left, chunk_blocks)
            start = int(self.rng.integers(0, self.nblocks - nb + 1))
            yield self.mv[start * self.tsz:(start + nb) * self.tsz]
            left -= nb


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits` (llama-quant.cpp): the layers whose attn_v / ffn_down get more bits in the
    _M mixes: the first and last eighth, and every third in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int, row: int, has_output: bool = True) -> QT:
    """The type llama-quantize Q4_K_M gives tensor `name` (rows of `row` values) of a model of `layers` layers
    with more than 8 experts (`llama_tensor_get_type`): Q6_K for the output (or the token table a tied model
    multiplies with), attn_v and every ffn_down (routed experts, shared expert and dense alike) in
    `use_more_bits` layers; Q4_K for the other matrices; rows that are not whole 256-blocks fall back to Q5_0
    (for Q4_K) and Q8_0 (for Q6_K), as llama.cpp's quantizer does."""
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        t = QT.Q6_K
    elif "attn_v.weight" in name or "ffn_down" in name:
        layer = int(name.split(".")[1])
        t = QT.Q6_K if use_more_bits(layer, layers) else QT.Q4_K
    else:
        t = QT.Q4_K
    if not fits(t, row):
        t = {QT.Q4_K: QT.Q5_0, QT.Q6_K: QT.Q8_0}[t]
    return t


def total_bytes(tensors: list[Tensor]) -> int:
    return sum(nbytes_of(t.shape, t.qt) for t in tensors)


def write(w: GGUFWriter, out: str, tensors: list[Tensor], vocab: int, seed: int, fresh: bool = False,
          pool_bytes: int = 64 << 20, chunk_bytes: int = 8 << 20) -> None:
    """Writes `w`'s metadata, a tokenizer of `vocab` dummy tokens (tokenizer.ggml.model "none": enough for
    llama-bench and `moe-daemon bench`, not for text), then `tensors`, streaming, to `out`; prints the
    size and time taken."""
    w.add_vocab_size(vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("none")
    sizes = [nbytes_of(t.shape, t.qt) for t in tensors]
    for t, nb in zip(tensors, sizes):
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nb, raw_dtype=t.qt)
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout, align = w.fout[0], w.data_alignment

    def pad(n: int) -> None:
        if (-n) % align:
            fout.write(b"\0" * ((-n) % align))

    pad(fout.tell())
    rng = np.random.default_rng(seed)
    weight_types = sorted({t.qt for t in tensors if t.kind == "w"})
    pools = {} if fresh else {qt: Pool(qt, pool_bytes, rng) for qt in weight_types}
    t0 = time.time()
    for t, nb in zip(tensors, sizes):
        n = int(np.prod(t.shape))
        if t.kind == "one":
            fout.write(np.ones(n, np.float32).tobytes())
        elif t.kind == "zero":
            fout.write(np.zeros(n, np.float32).tobytes())
        elif t.kind == "normal":
            fout.write((rng.standard_normal(n, dtype=np.float32) * STD).tobytes())
        elif fresh:
            fout.write(random_weights(n, t.qt, rng).tobytes())
        else:
            for mv in pools[t.qt].chunks(nb, chunk_bytes):
                fout.write(mv)
        pad(nb)
    w.close()
    print(f"wrote {out}: {os.path.getsize(out)/2**30:.2f} GiB in {time.time()-t0:.1f}s", flush=True)
