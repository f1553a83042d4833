//! The MoE block: router (softmax top-k, or sigmoid + correction bias + group-limited top-k), routed
//! experts with tokens grouped per expert, and the always-on shared expert. The router reads the FFN
//! input, or (SmallThinker) the layer input, in which case the engine routes before attention.
use super::linear::dot;
use super::ops::{add_assign, gelu_tanh, sigmoid, silu, softmax, top_k};
use crate::model::config::{Activation, ModelConfig, MoeConfig, RouterKind};
use crate::model::{Mlp, MoeBlock};
use moe_kernels::cpu::WorkerPool;
use rayon::prelude::*;

/// Marks a routing slot whose expert is computed elsewhere.
pub const NOT_HERE: u32 = u32::MAX;

/// Routing decision for a batch: `top_k` expert ids and weights per token.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub top_k: usize,
}

/// Routes every token of `x`; tokens in parallel on `pool` when given (its workers spin between
/// regions, so rayon threads woken now would fight them for the cores), else on rayon.
pub fn route(
    block: &MoeBlock,
    cfg: &MoeConfig,
    x: &[f32],
    hidden: usize,
    pool: Option<&WorkerPool>,
) -> Routing {
    let n = x.len() / hidden;
    let e = cfg.num_experts;
    let k = cfg.top_k;
    let per_token: Vec<(Vec<u32>, Vec<f32>)> = map_tokens(pool, n, |t| {
        let xt = &x[t * hidden..(t + 1) * hidden];
        let mut logits: Vec<f32> = (0..e)
            .map(|j| dot(&block.router[j * hidden..(j + 1) * hidden], xt))
            .collect();
        match cfg.router {
            RouterKind::Softmax { renormalize } => {
                softmax(&mut logits);
                let ids = top_k(&logits, k);
                let mut w: Vec<f32> = ids.iter().map(|&i| logits[i]).collect();
                if renormalize {
                    let s: f32 = w.iter().sum();
                    w.iter_mut().for_each(|v| *v /= s);
                }
                (ids.into_iter().map(|i| i as u32).collect(), w)
            }
            RouterKind::SigmoidGrouped {
                n_group,
                topk_group,
                renormalize,
            } => {
                let scores: Vec<f32> = logits.iter().map(|&v| sigmoid(v)).collect();
                let mut choice: Vec<f32> = match &block.correction_bias {
                    Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                    None => scores.clone(),
                };
                if n_group > 1 {
                    let per = e / n_group;
                    let group_score: Vec<f32> = choice
                        .chunks(per)
                        .map(|g| top_k(g, 2.min(per)).iter().map(|&i| g[i]).sum())
                        .collect();
                    let keep = top_k(&group_score, topk_group);
                    for (g, chunk) in choice.chunks_mut(per).enumerate() {
                        if !keep.contains(&g) {
                            chunk.fill(f32::NEG_INFINITY);
                        }
                    }
                }
                let ids = top_k(&choice, k);
                let mut w: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
                if renormalize {
                    let s: f32 = w.iter().sum::<f32>() + 1e-20;
                    w.iter_mut().for_each(|v| *v /= s);
                }
                w.iter_mut().for_each(|v| *v *= cfg.routed_scaling_factor);
                (ids.into_iter().map(|i| i as u32).collect(), w)
            }
        }
    });
    let mut ids = Vec::with_capacity(n * k);
    let mut weights = Vec::with_capacity(n * k);
    for (i, w) in per_token {
        ids.extend(i);
        weights.extend(w);
    }
    Routing {
        ids,
        weights,
        top_k: k,
    }
}

/// `f(t)` for `t` in `0..n`, in order, computed in parallel on `pool` (or rayon).
fn map_tokens<T: Send + Sync>(
    pool: Option<&WorkerPool>,
    n: usize,
    f: impl Fn(usize) -> T + Sync + Send,
) -> Vec<T> {
    let Some(pool) = pool else {
        return (0..n).into_par_iter().map(f).collect();
    };
    let cells: Vec<std::sync::OnceLock<T>> = (0..n).map(|_| std::sync::OnceLock::new()).collect();
    let groups = pool.groups();
    let per_group: Vec<usize> = (0..groups).map(|g| (n + groups - 1 - g) / groups).collect();
    pool.run(&per_group, &|g, i, _| {
        let t = i * groups + g;
        let _ = cells[t].set(f(t));
    });
    cells
        .into_iter()
        .map(|c| c.into_inner().expect("every token was routed"))
        .collect()
}

/// The gate nonlinearity of a gated MLP.
#[inline]
pub fn activate(act: Activation, g: f32) -> f32 {
    match act {
        Activation::Silu => silu(g),
        Activation::GeluTanh => gelu_tanh(g),
        Activation::Relu => g.max(0.0),
    }
}

/// `act(gate) · up` of every gated MLP and expert of a model, with GLM-5's optional SwiGLU clamp
/// (gate ≤ limit, up within ±limit, before the activation; the CPU kernels' `gated` and the GPU's
/// `gated_mul` do the same).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GatedAct {
    pub act: Activation,
    pub swiglu_limit: Option<f32>,
}

impl GatedAct {
    pub fn of(cfg: &ModelConfig) -> Self {
        Self {
            act: cfg.activation,
            swiglu_limit: cfg.swiglu_limit,
        }
    }

    /// The same activation as the CPU kernels name it.
    pub fn kernel_activation(self) -> moe_kernels::cpu::moe::Activation {
        use moe_kernels::cpu::moe::Activation as K;
        match self.act {
            Activation::Silu => K::Silu,
            Activation::GeluTanh => K::GeluTanh,
            Activation::Relu => K::Relu,
        }
    }

    #[inline]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self.swiglu_limit {
            Some(l) => activate(self.act, g.min(l)) * u.clamp(-l, l),
            None => activate(self.act, g) * u,
        }
    }
}

/// down(act(gate(x)) · up(x)) for `tokens` rows of `x`.
pub fn mlp_forward(mlp: &Mlp, act: GatedAct, x: &[f32], tokens: usize) -> Vec<f32> {
    let [g, u] = crate::engine::linear::forward_many([&mlp.gate, &mlp.up], x, tokens);
    let inter = g.len() / tokens.max(1);
    // Each token's gated activation is made where the down projection converts its input (in
    // parallel for several tokens): elementwise, so the same values as one call over every row.
    let gated = |t: usize, row: &mut [f32]| {
        let (g, u) = (
            &g[t * inter..(t + 1) * inter],
            &u[t * inter..(t + 1) * inter],
        );
        moe_kernels::cpu::moe::gated_rows(act.kernel_activation(), act.swiglu_limit, g, u, row);
    };
    mlp.down.forward_made(&gated, tokens)
}

/// Reference CPU path for routed experts: gathers each expert's tokens, runs its MLP on them, and adds
/// the weighted outputs into `out`. Experts run one after another; each MLP is parallel inside.
/// Ids equal to [`NOT_HERE`], or of experts not held in DRAM, are skipped (another device owns them).
pub fn experts_forward(
    experts: &[Option<Mlp>],
    act: GatedAct,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    out: &mut [f32],
) {
    let n = x.len() / hidden;
    let mut per_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts.len()];
    for t in 0..n {
        for j in 0..routing.top_k {
            let e = routing.ids[t * routing.top_k + j];
            if e != NOT_HERE {
                per_expert[e as usize].push((t, routing.weights[t * routing.top_k + j]));
            }
        }
    }
    for (e, assigned) in per_expert.iter().enumerate() {
        let Some(expert) = &experts[e] else { continue };
        if assigned.is_empty() {
            continue;
        }
        let mut xs = Vec::with_capacity(assigned.len() * hidden);
        for &(t, _) in assigned {
            xs.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
        }
        let y = mlp_forward(expert, act, &xs, assigned.len());
        for (i, &(t, w)) in assigned.iter().enumerate() {
            for (o, v) in out[t * hidden..(t + 1) * hidden]
                .iter_mut()
                .zip(&y[i * hidden..(i + 1) * hidden])
            {
                *o += w * v;
            }
        }
    }
}

/// Routed experts held in DRAM: the packed kernel set when there is one, else the reference path.
pub fn dram_experts_forward(
    block: &MoeBlock,
    pool: Option<&WorkerPool>,
    act: GatedAct,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    out: &mut [f32],
) {
    dram_experts_forward_timed(block, pool, act, x, hidden, routing, out, None)
}

/// [`dram_experts_forward`], adding the packed kernels' time per region to `regions` when given.
#[allow(clippy::too_many_arguments)]
pub fn dram_experts_forward_timed(
    block: &MoeBlock,
    pool: Option<&WorkerPool>,
    act: GatedAct,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    out: &mut [f32],
    regions: Option<&mut moe_kernels::cpu::moe::RegionTimes>,
) {
    match (&block.cpu_set, pool) {
        (Some(set), Some(pool)) => set
            .forward_timed(
                pool,
                x,
                &routing.ids,
                &routing.weights,
                routing.top_k,
                out,
                regions,
            )
            .expect("expert kernel inputs are sized by the engine"),
        _ => experts_forward(&block.experts, act, x, hidden, routing, out),
    }
}

/// The whole MoE block for normalised hidden states `x` (`[n, hidden]`), given its routing (from
/// [`route`] over the router's input).
pub fn moe_forward(
    block: &MoeBlock,
    pool: Option<&WorkerPool>,
    act: GatedAct,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
) -> Vec<f32> {
    let n = x.len() / hidden;
    let mut out = vec![0f32; n * hidden];
    dram_experts_forward(block, pool, act, x, hidden, routing, &mut out);
    if let Some(shared) = &block.shared {
        let mut s = mlp_forward(shared, act, x, n);
        if let Some(gate) = &block.shared_gate {
            for t in 0..n {
                let g = sigmoid(dot(gate, &x[t * hidden..(t + 1) * hidden]));
                s[t * hidden..(t + 1) * hidden]
                    .iter_mut()
                    .for_each(|v| *v *= g);
            }
        }
        add_assign(&mut out, &s);
    }
    out
}
