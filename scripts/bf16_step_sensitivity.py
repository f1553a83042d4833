#!/usr/bin/env python3
"""How far one bf16 rounding step moves a SmallThinker fixture's logits, on the CPU (torch, f32 with the
GPU engine's bf16 rounding points: normalised rows, K/V cache, attention output, expert activations).

Two GPU paths that sum the same f32 values in another order (the device-routed experts' combine against
the host-planned one) differ by an ulp of a residual element. Where that element's next norm output lies
within an ulp of a bf16 rounding boundary, the ulp becomes a whole bf16 step (2^-8 relative) of one
element of a GEMM input. This prints, for the device-routed GPU test's batch (prompts of 3, 14 and 1
tokens, then 8 decode steps of tokens 5+i, 40+3i, 90+i):
  1. each MoE layer's router margin (k-th minus (k+1)-th logit) at every decode position of sequence 1:
     no near-tie, so no expert choice can flip;
  2. the logits' rel-L2 at logits index 7 (sequence 1, second decode step) when one element of one
     layer's FFN input at position 14 or 15 moves by one bf16 step: smallthinker_softmax 3–5e-3, the
     size of the 4.1e-3 the H200 measured there while the device combine summed in slot order.

Usage: python scripts/bf16_step_sensitivity.py [FIXTURE]   (default smallthinker_softmax; needs torch and
safetensors; SmallThinker fixtures only: ReGLU experts, router on the layer input).
"""
import json
import pathlib
import sys

import torch
from safetensors.torch import load_file

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
PROMPTS = [[1, 2, 3], list(range(10, 24)), [7]]
FEED = [[5 + i, 40 + 3 * i, 90 + i] for i in range(8)]


def bf(t):
    return t.to(torch.bfloat16).to(torch.float32)


class Fixture:
    def __init__(self, name):
        d = ROOT / name / "model_bf16"
        self.cfg = json.loads((d / "config.json").read_text())
        self.w = {k: v.to(torch.float32) for k, v in load_file(d / "model.safetensors").items()}
        c = self.cfg
        self.h, self.nh, self.nkv, self.hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.k = c["moe_num_active_primary_experts"]

    def rms(self, x, w):
        return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]))

    def rope(self, x, pos):
        hd = self.hd
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        f = pos[:, None].float() * inv[None]
        emb = torch.cat([f, f], -1)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * emb.cos()[:, None] + torch.cat([-x2, x1], -1) * emb.sin()[:, None]

    def forward(self, toks, nudge=None):
        """Logits of every position; `nudge` = (layer, position, element): that FFN input element one
        bf16 step up. Also returns each layer's router margins per position."""
        c, W = self.cfg, self.w
        T = len(toks)
        pos = torch.arange(T)
        x = W["model.embed_tokens.weight"][toks].clone()
        margins = []
        for l in range(c["num_hidden_layers"]):
            p = f"model.layers.{l}."
            router_in = x.clone()
            h = bf(self.rms(x, W[p + "input_layernorm.weight"]))
            q = (h @ W[p + "self_attn.q_proj.weight"].T).view(T, self.nh, self.hd)
            k = (h @ W[p + "self_attn.k_proj.weight"].T).view(T, self.nkv, self.hd)
            v = (h @ W[p + "self_attn.v_proj.weight"].T).view(T, self.nkv, self.hd)
            if c["rope_layout"][l]:
                q, k = self.rope(q, pos), self.rope(k, pos)
            rep = self.nh // self.nkv
            k, v = bf(k).repeat_interleave(rep, 1), bf(v).repeat_interleave(rep, 1)
            sc = torch.einsum("qhd,khd->hqk", q, k) * self.hd**-0.5
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            if c["sliding_window_layout"][l]:
                mask &= pos[None, :] > pos[:, None] - c["sliding_window_size"]
            sc = sc.masked_fill(~mask, float("-inf"))
            a = bf(torch.einsum("hqk,khd->qhd", sc.softmax(-1), v).reshape(T, -1))
            x = x + a @ W[p + "self_attn.o_proj.weight"].T
            h = bf(self.rms(x, W[p + "post_attention_layernorm.weight"]))
            if nudge is not None and nudge[0] == l and nudge[1] < T:
                up = torch.tensor(float("inf"), dtype=torch.bfloat16)
                h[nudge[1], nudge[2]] = torch.nextafter(h[nudge[1], nudge[2]].to(torch.bfloat16), up).float()
            logits = router_in @ W[p + "block_sparse_moe.primary_router.weight"].T
            srt, _ = logits.sort(-1, descending=True)
            margins.append(srt[:, self.k - 1] - srt[:, self.k])
            top, sel = logits.topk(self.k, -1)
            if c.get("moe_primary_router_apply_softmax", False):
                wts = top.softmax(-1)
            else:
                wts = torch.sigmoid(top) / torch.sigmoid(top).sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for t in range(T):
                for s in range(self.k):
                    pe = p + f"block_sparse_moe.experts.{sel[t, s].item()}."
                    g, u = h[t] @ W[pe + "gate.weight"].T, h[t] @ W[pe + "up.weight"].T
                    out[t] += wts[t, s] * (bf(torch.relu(g) * u) @ W[pe + "down.weight"].T)
            x = x + out
        lm = W.get("lm_head.weight", W["model.embed_tokens.weight"])
        return bf(self.rms(x, W["model.norm.weight"])) @ lm.T, margins


def rel_l2(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "smallthinker_softmax"
    f = Fixture(name)
    seq = PROMPTS[1] + [step[1] for step in FEED]
    base, margins = f.forward(seq)
    first = len(PROMPTS[1])
    for t in range(first, len(seq)):
        m = " ".join(f"{float(m[t]):.2e}" for m in margins)
        print(f"sequence 1, position {t}: router top-{f.k} margins per layer {m}")
    at = first + 1  # logits index 7: sequence 1's second decode step
    for l in range(f.cfg["num_hidden_layers"]):
        moved = sorted(
            (rel_l2(f.forward(seq, (l, t, e))[0][at], base[at]), t, e)
            for t in (at - 1, at)
            for e in range(0, f.h, 4)
        )
        worst, median = moved[-1], moved[len(moved) // 2]
        print(
            f"layer {l}: one bf16 step of one FFN input element at position {at - 1} or {at} moves the logits "
            f"at position {at} by up to {worst[0]:.2e} (position {worst[1]}, element {worst[2]}), median {median[0]:.2e}"
        )


if __name__ == "__main__":
    main()
