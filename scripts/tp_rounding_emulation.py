#!/usr/bin/env python3
"""How a tensor-parallel group's f32 all-reduce order reaches the logits of a DeepSeek-V3-style fixture:
the engine's numerics emulated on the CPU (torch; f32, with bf16 where the GPU engine rounds: the
normalised layer inputs, the q-LoRA output, the latent cache, attention output, MLP activations),
one GPU against N ranks whose row-parallel projections (o, MLP down, shared-expert down) are summed
as the group sums them (rank 0's partial with the residual, then the others'), the column-parallel
ones computed per rank. Prints, per layer, how many values differ from one GPU's and by how much,
and whether the routing changes; then the same for one bf16 step in one value of layer 0's input.

DeepSeek-V3's fixture at 4 ranks: after layer 0's attention 241 of 768 residual values differ
(rel-L2 5e-8); one of layer 0's FFN-norm outputs moves by a bf16 step; then 1.1e-4 after layer 0,
1.5e-3 and 3.2e-3 after layers 1 and 2's attention, and layer 2's routing changes (what the H200
measured at 2 and 4 ranks). Not the GPU's summation order itself: the same kind of difference.

Usage: python scripts/tp_rounding_emulation.py [FIXTURE_DIR]   (default tests/fixtures/deepseek_v3/
model_bf16; needs torch and transformers).
"""
import json
import random
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as M

torch.set_grad_enabled(False)
d = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/deepseek_v3/model_bf16"
cfg = AutoConfig.from_pretrained(d)
W = {k: v.float() for k, v in load_file(d + "/model.safetensors").items()}
ids = torch.tensor(json.load(open(d + "/../oracle.json"))["prompt_ids"])
T = len(ids)
nh, nope, rp = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
lora, vd, eps = cfg.kv_lora_rank, cfg.v_head_dim, cfg.rms_norm_eps
cos, sin = M.DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1, T, 8), torch.arange(T)[None])
scale = M.yarn_apply_mscale(cfg.rope_parameters, (nope + rp) ** -0.5)


def bf(t):
    return t.to(torch.bfloat16).float()


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(t):  # [T, heads, rp]
    q, _ = M.apply_rotary_pos_emb_interleave(t.transpose(0, 1)[None], t.transpose(0, 1)[None][:, :1], cos, sin)
    return q[0].transpose(0, 1)


def rows_of(w, world):  # column-parallel: each rank's output rows, concatenated
    k = w.shape[0] // world
    return lambda x: torch.cat([x @ w[r * k:(r + 1) * k].T for r in range(world)], -1)


def add_row_parallel(x, inp, w, world):  # x + inp @ w.T as the group sums it
    k = w.shape[1] // world
    for r in range(world):
        x = x + inp[:, r * k:(r + 1) * k] @ w[:, r * k:(r + 1) * k].T
    return x


def mlp(pre, inp, world):  # (activations, down weight)
    g, u = rows_of(W[pre + "gate_proj.weight"], world)(inp), rows_of(W[pre + "up_proj.weight"], world)(inp)
    return bf(torch.nn.functional.silu(g) * u), W[pre + "down_proj.weight"]


def forward(world, flip=None):
    x, seen = W["model.embed_tokens.weight"][ids].clone(), []
    for li in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{li}.", f"model.layers.{li}.self_attn."
        hb = bf(rms(x, W[p + "input_layernorm.weight"]))
        if flip is not None and li == 0:
            t, i = flip
            hb[t, i] = (hb[t, i].to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()
        qa = bf(rms(hb @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"]))
        q = rows_of(W[a + "q_b_proj.weight"], world)(qa).view(T, nh, nope + rp)
        qn, qr = q[..., :nope], rope(q[..., nope:])
        ckv = hb @ W[a + "kv_a_proj_with_mqa.weight"].T
        lat = bf(rms(ckv[:, :lora], W[a + "kv_a_layernorm.weight"]))
        kr = bf(rope(ckv[:, None, lora:])[:, 0])
        kvb = W[a + "kv_b_proj.weight"].view(nh, nope + vd, lora)
        ql = torch.einsum("thd,hdc->thc", qn, kvb[:, :nope])
        s = (torch.einsum("thc,sc->hts", ql, lat) + torch.einsum("thr,sr->hts", qr, kr)) * scale
        pr = torch.softmax(s + torch.triu(torch.full((T, T), float("-inf")), 1), -1)
        att = bf(torch.einsum("hts,sc,hvc->thv", pr, lat, kvb[:, nope:])).reshape(T, nh * vd)
        x = add_row_parallel(x, att, W[a + "o_proj.weight"], world)
        seen.append((f"layer {li} after attention", x.clone()))
        hf = rms(x, W[p + "post_attention_layernorm.weight"])
        hb = bf(hf)
        seen.append((f"layer {li} FFN norm (bf16)", hb.clone()))
        if li < cfg.first_k_dense_replace:
            act, down = mlp(p + "mlp.", hb, world)
            seen.append((f"layer {li} MLP activations (bf16)", act.clone()))
            x = add_row_parallel(x, act, down, world)
        else:
            sc = (hf @ W[p + "mlp.gate.weight"].T).sigmoid()
            sb = sc + W[p + "mlp.gate.e_score_correction_bias"]
            groups = sb.view(T, cfg.n_group, -1).topk(2, -1)[0].sum(-1).topk(cfg.topk_group, -1)[1]
            mask = torch.zeros(T, cfg.n_group).scatter(1, groups, 1).repeat_interleave(sb.shape[1] // cfg.n_group, 1)
            top = sb.masked_fill(mask == 0, float("-inf")).topk(cfg.num_experts_per_tok, -1)[1]
            tw = sc.gather(1, top)
            tw = tw / tw.sum(-1, keepdim=True) * cfg.routed_scaling_factor
            seen.append((f"layer {li} routing", top.sort(-1)[0]))
            routed = torch.zeros_like(x)
            for t in range(T):
                for e, wt in zip(top[t].tolist(), tw[t]):
                    act, down = mlp(p + f"mlp.experts.{e}.", hb[t:t + 1], 1)
                    routed[t] += wt * (act @ down.T)[0]
            act, down = mlp(p + "mlp.shared_experts.", hb, world)
            x = add_row_parallel(x + routed, act, down, world)
        seen.append((f"layer {li} output", x.clone()))
    return seen


def report(tag, one, other):
    for (what, a), (_, b) in zip(one, other):
        if "routing" in what:
            print(f"{tag} {what}: {'same' if torch.equal(a, b) else 'CHANGED'}")
        else:
            rel = float((a - b).norm() / a.norm())
            print(f"{tag} {what}: {int((a != b).sum())} of {a.numel()} differ, rel-L2 {rel:.1e}")


one = forward(1)
for world in (2, 4):
    report(f"{world} ranks,", one, forward(world))
random.seed(1)
for _ in range(3):
    f = (random.randrange(T), random.randrange(cfg.hidden_size))
    report(f"one GPU, layer 0 input value {f} one bf16 step up,", one, forward(1, flip=f))
