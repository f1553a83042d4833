#!/usr/bin/env python3
"""What the GPU's 8-bit KV cache formats cost, measured with transformers instead of our engine.

K and V are rounded per (position, KV head) as `kernels/src/cuda/kv_q8.cu` stores them (int8: scale =
amax / 127, round half to even; fp8: E4M3 with scale = amax / 448), by wrapping the model module's
`eager_attention_forward`, so every attention reads rounded keys and values (the current token's too, as
the GPU's cache append comes before attention).

    python3 scripts/kv_rounding_reference.py fixtures qwen3_moe glm4_moe ...
        per-step logits rel-L2 of each rounding against bf16 K/V on the fixtures' oracle sequences
    python3 scripts/kv_rounding_reference.py perplexity MODEL.gguf TEXT
        perplexity in windows of 512 (1024 tokens) with f32, bf16, int8 and fp8 K/V (needs `gguf`)
"""
import importlib
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def int8(x):
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127.0
    return torch.round(x / s).clamp(-127, 127) * s


def e4m3(x):
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
    return (x / s).to(torch.float8_e4m3fn).float() * s


def bf16(x):
    return x.to(torch.bfloat16).float()


ROUNDINGS = {"f32": lambda x: x, "bf16": bf16, "int8": int8, "fp8": e4m3}
current = {"round": ROUNDINGS["f32"]}


def wrap_attention(model):
    mod = importlib.import_module(type(model).__module__)
    orig = mod.eager_attention_forward

    def rounded(module, query, key, value, *a, **k):
        r = current["round"]
        return orig(module, query, r(key), r(value), *a, **k)

    mod.eager_attention_forward = rounded


def fixtures(names):
    for name in names:
        d = f"tests/fixtures/{name}"
        o = json.load(open(f"{d}/oracle.json"))
        m = AutoModelForCausalLM.from_pretrained(f"{d}/model_bf16", dtype=torch.float32, attn_implementation="eager")
        wrap_attention(m)
        seq, p = o["full_sequence"], len(o["prompt_ids"])
        out = {}
        for r in ("bf16", "int8", "fp8"):
            current["round"] = ROUNDINGS[r]
            with torch.no_grad():
                out[r] = m(torch.tensor([seq])).logits[0, p - 1 : len(seq)]
        for r in ("int8", "fp8"):
            e = ((out[r] - out["bf16"]).norm(dim=-1) / out["bf16"].norm(dim=-1)).tolist()
            print(f"{name:12s} {r:5s} mean {sum(e) / len(e):.4f} per step " + " ".join(f"{x:.4f}" for x in e))


def perplexity(gguf, text_path, ctx=512, tokens=1024):
    folder, _, file = gguf.rpartition("/")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32, attn_implementation="eager")
    wrap_attention(m)
    ids = tok(open(text_path).read(), add_special_tokens=False)["input_ids"][: (tokens // ctx) * ctx]
    for r, f in ROUNDINGS.items():
        current["round"] = f
        nll, n = 0.0, 0
        for w in range(0, len(ids), ctx):
            x = torch.tensor([ids[w : w + ctx]])
            with torch.no_grad():
                lp = torch.log_softmax(m(x).logits[0, :-1].double(), -1)
            nll -= lp.gather(1, x[0, 1:, None]).sum().item()
            n += x.shape[1] - 1
        print(f"KV {r:5s} perplexity {torch.tensor(nll / n).exp().item():.4f} (mean NLL {nll / n:.5f} over {n} tokens)", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "fixtures":
        fixtures(sys.argv[2:])
    else:
        perplexity(sys.argv[2], sys.argv[3])
