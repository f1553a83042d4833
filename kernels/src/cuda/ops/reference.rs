//! Slow host versions of ops whose numerics matter beyond "same kernel, same order": the GPU tests run
//! the kernels and these on the same inputs (`daemon/tests/gpu_tests.rs`), and the unit tests below pin
//! these down on small cases worked by hand. Plain loops, f32 throughout; bf16 outputs are returned
//! as f32 before rounding (the tests compare within bf16's precision).
use super::{GateActivation, RouterKind};

/// RMSNorm of each `dim`-wide row of `x` with weights `w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, w)| v * inv * w));
    }
    out
}

/// `f(gate) · up` of each `[gate; up]` row (`2 · inter` wide) after the optional SwiGLU clamp.
pub fn gated_mul(
    gate_up: &[f32],
    inter: usize,
    act: GateActivation,
    limit: Option<f32>,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(gate_up.len() / 2);
    for row in gate_up.chunks(2 * inter) {
        for c in 0..inter {
            let (mut g, mut u) = (row[c], row[inter + c]);
            if let Some(l) = limit {
                g = g.min(l);
                u = u.clamp(-l, l);
            }
            let a = match act {
                GateActivation::Silu => g / (1.0 + (-g).exp()),
                GateActivation::GeluTanh => {
                    0.5 * g * (1.0 + (0.797_884_6 * (g + 0.044_715 * g * g * g)).tanh())
                }
                GateActivation::Relu => g.max(0.0),
            };
            out.push(a * u);
        }
    }
    out
}

/// Top-`k` expert ids and weights per row of `logits` (`experts` wide), as the router kernels define
/// them: ties go to the lower expert id.
pub fn router_topk(
    logits: &[f32],
    experts: usize,
    k: usize,
    kind: &RouterKind,
    bias: Option<&[f32]>,
) -> (Vec<i32>, Vec<f32>) {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for l in logits.chunks(experts) {
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        // selection score and weight before renormalisation of each expert
        let (mut sel, val): (Vec<f32>, Vec<f32>) = match kind {
            RouterKind::Softmax { .. } => {
                let mx = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let sum: f32 = l.iter().map(|&v| (v - mx).exp()).sum();
                (
                    l.to_vec(),
                    l.iter().map(|&v| (v - mx).exp() / sum).collect(),
                )
            }
            RouterKind::SigmoidGrouped { .. } => {
                let b = |e: usize| bias.map_or(0.0, |b| b[e]);
                let s: Vec<f32> = l.iter().map(|&v| sigmoid(v)).collect();
                ((0..experts).map(|e| s[e] + b(e)).collect(), s)
            }
        };
        if let RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            ..
        } = *kind
        {
            if n_group > 1 {
                mask_groups(&mut sel, n_group, topk_group);
            }
        }
        let mut chosen: Vec<usize> = Vec::with_capacity(k);
        for _ in 0..k {
            let best = (0..experts)
                .filter(|e| !chosen.contains(e))
                .fold(None, |best: Option<usize>, e| match best {
                    Some(b) if sel[b] >= sel[e] => Some(b),
                    _ => Some(e),
                })
                .expect("k ≤ experts");
            chosen.push(best);
        }
        let sum: f32 = chosen.iter().map(|&e| val[e]).sum();
        for &e in &chosen {
            let w = match *kind {
                RouterKind::Softmax { renormalize } => {
                    if renormalize {
                        val[e] / sum
                    } else {
                        val[e]
                    }
                }
                RouterKind::SigmoidGrouped {
                    renormalize,
                    scaling,
                    ..
                } => {
                    let w = if renormalize {
                        val[e] / (sum + 1e-20)
                    } else {
                        val[e]
                    };
                    w * scaling
                }
            };
            ids.push(e as i32);
            weights.push(w);
        }
    }
    (ids, weights)
}

/// Keeps the `topk_group` groups with the best top-2 selection scores (top-1 for one expert per
/// group); the others' scores become -inf.
fn mask_groups(sel: &mut [f32], n_group: usize, topk_group: usize) {
    let per = sel.len() / n_group;
    let score = |g: usize| {
        let mut s: Vec<f32> = sel[g * per..(g + 1) * per].to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        s.iter().take(2.min(per)).sum::<f32>()
    };
    let mut kept: Vec<usize> = Vec::new();
    for _ in 0..topk_group {
        let best = (0..n_group).filter(|g| !kept.contains(g)).fold(
            None,
            |best: Option<(usize, f32)>, g| {
                let s = score(g);
                match best {
                    Some((_, bs)) if bs >= s => best,
                    _ => Some((g, s)),
                }
            },
        );
        kept.extend(best.map(|b| b.0));
    }
    for (e, s) in sel.iter_mut().enumerate() {
        if !kept.contains(&(e / per)) {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// `out[t] += Σ w[r] · y[r]` over token t's rows `token_rows[offsets[t]..offsets[t + 1]]`.
pub fn scatter_add_weighted(
    y: &[f32],
    offsets: &[i32],
    token_rows: &[i32],
    w: &[f32],
    dim: usize,
    out: &mut [f32],
) {
    for (t, o) in out.chunks_mut(dim).enumerate().take(offsets.len() - 1) {
        for i in 0..dim {
            let mut acc = 0.0;
            for &r in &token_rows[offsets[t] as usize..offsets[t + 1] as usize] {
                acc += w[r as usize] * y[r as usize * dim + i];
            }
            o[i] += acc;
        }
    }
}

/// Causal GQA attention of `rows` queries at positions `pos0..pos0 + rows` (`q`: `[rows, heads · dh]`)
/// over keys `0..pos0 + rows` (`k`, `v`: `[keys, kv_heads · dh]`), query head h on KV head
/// `h / (heads / kv_heads)`; a `window` keeps keys `p - window + 1..=p`. Softmax of `scale · q · k`
/// in f64 per row. Returns `[rows, heads · dh]`.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (rows, pos0): (usize, usize),
    (heads, kv_heads, dh): (usize, usize, usize),
    scale: f32,
    window: Option<usize>,
) -> Vec<f32> {
    let (width, kv_width, group) = (heads * dh, kv_heads * dh, heads / kv_heads);
    let mut out = vec![0f32; rows * width];
    let mut p = Vec::new();
    for r in 0..rows {
        let pos = pos0 + r;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..heads {
            let qh = &q[r * width + h * dh..][..dh];
            let col = (h / group) * dh;
            p.clear();
            p.extend((lo..=pos).map(|key| {
                let kr = &k[key * kv_width + col..][..dh];
                scale as f64
                    * qh.iter()
                        .zip(kr)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
            }));
            let mx = p.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            p.iter_mut().for_each(|x| *x = (*x - mx).exp());
            let sum: f64 = p.iter().sum();
            let o = &mut out[r * width + h * dh..][..dh];
            for (i, key) in (lo..=pos).enumerate() {
                let vr = &v[key * kv_width + col..][..dh];
                for (o, &x) in o.iter_mut().zip(vr) {
                    *o += (p[i] / sum * x as f64) as f32;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_a_worked_row() {
        // rms of (3, 4) = sqrt(12.5)
        let got = rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0);
        let r = 12.5f32.sqrt();
        assert_eq!(got, vec![3.0 / r, 8.0 / r]);
    }

    #[test]
    fn gated_mul_clamps_before_the_activation() {
        let got = gated_mul(&[10.0, -1.0, 10.0, 3.0], 2, GateActivation::Relu, Some(7.0));
        // gate 10 → 7, up 10 → 7: 49; gate -1 → relu 0
        assert_eq!(got, vec![49.0, 0.0]);
        let free = gated_mul(&[10.0, 10.0], 1, GateActivation::Relu, None);
        assert_eq!(free, vec![100.0]);
    }

    #[test]
    fn softmax_router_picks_the_largest_and_renormalises() {
        let logits = [0.0, 2.0, 1.0, 2.0];
        let (ids, w) = router_topk(
            &logits,
            4,
            2,
            &RouterKind::Softmax { renormalize: true },
            None,
        );
        assert_eq!(ids, vec![1, 3], "a tie goes to the lower id first");
        assert!((w[0] - 0.5).abs() < 1e-6 && (w[1] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn grouped_router_selects_within_kept_groups_and_weights_unbiased_scores() {
        // 4 experts in 2 groups; the bias makes group 1 win the selection although expert 0 has the
        // largest logit, and the weights are the unbiased sigmoids times the scaling.
        let logits = [3.0, -3.0, 0.0, 0.5];
        let bias = [0.0, 0.0, 1.0, 1.0];
        let kind = RouterKind::SigmoidGrouped {
            n_group: 2,
            topk_group: 1,
            renormalize: false,
            scaling: 2.0,
        };
        let (ids, w) = router_topk(&logits, 4, 2, &kind, Some(&bias));
        assert_eq!(ids, vec![3, 2]);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert!((w[0] - 2.0 * s(0.5)).abs() < 1e-6 && (w[1] - 2.0 * s(0.0)).abs() < 1e-6);
    }

    #[test]
    fn scatter_adds_each_tokens_rows_in_order() {
        // rows 0 and 2 belong to token 1, row 1 to token 0
        let y = [1.0, 10.0, 100.0];
        let mut out = [5.0, 5.0];
        scatter_add_weighted(&y, &[0, 1, 3], &[1, 0, 2], &[1.0, 2.0, 0.5], 1, &mut out);
        assert_eq!(out, [5.0 + 20.0, 5.0 + 1.0 + 50.0]);
    }

    #[test]
    fn causal_attention_of_worked_rows() {
        // one head, dh 1; keys 0..3 with k = (0, 0, ln 3 / 1), v = (1, 2, 3), query at position 2
        // (row 1 of a prompt continuing one cached position) sees all three: weights 1, 1, 3 over 5
        let (k, v) = ([0.0, 0.0, 3f32.ln()], [1.0, 2.0, 3.0]);
        let got = causal_attention(&[0.0, 1.0], &k, &v, (2, 1), (1, 1, 1), 1.0, None);
        assert!((got[0] - 1.5).abs() < 1e-6, "position 1: mean of v0, v1");
        assert!((got[1] - 12.0 / 5.0).abs() < 1e-6, "{}", got[1]);
        // a window of 2 drops key 0: weights 1, 3 over 4
        let got = causal_attention(&[0.0, 1.0], &k, &v, (2, 1), (1, 1, 1), 1.0, Some(2));
        assert!((got[1] - 11.0 / 4.0).abs() < 1e-6, "{}", got[1]);
        // GQA: two query heads on one KV head give the same row for the same query
        let got = causal_attention(&[1.0, 1.0], &k[..1], &v[..1], (1, 0), (2, 1, 1), 1.0, None);
        assert_eq!(got, vec![1.0, 1.0]);
    }
}
