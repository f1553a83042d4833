#!/usr/bin/env python3
"""Router near-ties of a fixture, in transformers (f32): per step, each MoE layer's margin between the
last group kept and the first left out (group-limited routing) and between the k-th and (k+1)-th
expert; then, at one step, how far the logits move when a layer takes the other side of its tie.

A tensor-parallel group adds its partial sums in another order than one GPU, which moves the bf16
GEMM inputs by a rounding step; where a margin is that small the expert choice can flip. DeepSeek-V3's
fixture, step 3: layer 1's groups are 1.1e-3 apart and the other group moves the logits by rel-L2
0.381 (what the H200 saw when its MLA group left one GPU at that step).

Usage: python scripts/tp_router_near_tie.py [FIXTURE] [STEP]   (defaults: deepseek_v3 3; needs torch
and transformers; DeepSeek-V3-style routers: sigmoid scores, correction bias, group-limited top-k).
"""
import json
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "deepseek_v3"
    at = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    o = json.loads((ROOT / name / "oracle.json").read_text())
    m = AutoModelForCausalLM.from_pretrained(ROOT / name / "model_bf16", dtype=torch.float32).eval()
    ids = torch.tensor([o["prompt_ids"] + o["greedy_tokens"]])
    first = len(o["prompt_ids"]) - 1  # position of step 0's logits
    gates = [(i, l.mlp.gate) for i, l in enumerate(m.model.layers) if hasattr(l.mlp, "gate")]
    margins, flip = {}, {}

    def routed(li, g):
        def forward(h):
            h = h.view(-1, g.hidden_dim).float()
            logits = torch.nn.functional.linear(h, g.weight.float())
            scores = logits.sigmoid()
            choice = scores + g.e_score_correction_bias
            per = g.num_experts // g.num_group
            groups = choice.view(-1, g.num_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
            gs = groups.sort(-1, descending=True)
            keep = torch.zeros_like(groups).scatter_(1, gs.indices[:, : g.topk_group], 1)
            if li in flip and g.topk_group < g.num_group:  # the other side of the group tie
                p = flip[li]
                keep[p, gs.indices[p, g.topk_group - 1]] = 0
                keep[p, gs.indices[p, g.topk_group]] = 1
            mask = keep.unsqueeze(-1).expand(-1, g.num_group, per).reshape(-1, g.num_experts)
            es = choice.masked_fill(~mask.bool(), float("-inf")).sort(-1, descending=True)
            top = es.indices[:, : g.top_k]
            group_margin = (
                gs.values[:, g.topk_group - 1] - gs.values[:, g.topk_group]
                if g.topk_group < g.num_group
                else torch.full_like(gs.values[:, 0], float("inf"))
            )
            margins[li] = (group_margin.tolist(), (es.values[:, g.top_k - 1] - es.values[:, g.top_k]).tolist())
            w = scores.gather(1, top)
            if g.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return logits, w * g.routed_scaling_factor, top

        g.forward = forward

    for li, g in gates:
        routed(li, g)
    with torch.no_grad():
        base = m(ids).logits[0]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    for s, step in enumerate(o["steps"]):
        p = first + s
        cells = ", ".join(f"layer {li}: group {margins[li][0][p]:.2e} expert {margins[li][1][p]:.2e}" for li, _ in gates)
        print(f"step {s} (vs oracle {rel(base[p], torch.tensor(step['logits'])):.1e}): {cells}")
    p = first + at
    for li, _ in gates:
        flip.clear()
        flip[li] = p
        with torch.no_grad():
            moved = m(ids).logits[0][p]
        print(f"step {at}: layer {li} takes the other group: logits rel-L2 {rel(moved, base[p]):.3f}")


if __name__ == "__main__":
    main()
