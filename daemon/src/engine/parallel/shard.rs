//! Host-side slicing by the sharding plan: a rank's rows or columns of a [`Linear`] (FP8 checkpoint
//! blocks kept whole), and a rank's [`Model`] — its slices of the dense weights plus the routed
//! experts it holds, moved out of the full model — which `GpuModel::upload` then uploads as it
//! uploads a whole model. The rank model lives only while it is uploaded.
use super::plan::{AttentionShard, RankShard, ShardError, ShardPlan};
use crate::engine::indexer::{IndexerWeights, KeyPoolWeights};
use crate::engine::linear::{Linear, WeightData};
use crate::model::{
    Attention, Ffn, GqaAttention, HyperConnection, Layer, LayerHyper, LinearAttention,
    MlaAttention, MlaQuery, Mlp, Model, ModelConfig, MoeBlock, SparseAttention,
};
use std::ops::Range;

fn slice_err(what: &str, detail: String) -> ShardError {
    ShardError::Slice {
        what: what.to_string(),
        detail,
    }
}

/// Rows `r` of `l` (its output units), with their biases.
pub fn rows(l: &Linear, r: Range<usize>, what: &str) -> Result<Linear, ShardError> {
    if r.end > l.out_dim || r.start > r.end {
        return Err(slice_err(what, format!("rows {r:?} of {}", l.out_dim)));
    }
    let n = l.in_dim;
    let w = match &l.w {
        WeightData::F32(v) => WeightData::F32(v[r.start * n..r.end * n].to_vec()),
        WeightData::Bf16(v) => WeightData::Bf16(v[r.start * n..r.end * n].to_vec()),
        WeightData::F8 {
            bytes,
            scale_inv,
            block,
        } => {
            let b = *block;
            if b == 0 {
                return Err(slice_err(what, "FP8 weights without a block size".into()));
            }
            if !r.start.is_multiple_of(b) || !(r.end.is_multiple_of(b) || r.end == l.out_dim) {
                return Err(slice_err(
                    what,
                    format!("rows {r:?}: not on the checkpoint's {b}-row FP8 blocks"),
                ));
            }
            let scale_cols = n.div_ceil(b);
            WeightData::F8 {
                bytes: bytes[r.start * n..r.end * n].to_vec(),
                scale_inv: scale_inv[r.start / b * scale_cols..r.end.div_ceil(b) * scale_cols]
                    .to_vec(),
                block: b,
            }
        }
        WeightData::Ggml { kind, bytes } => {
            let row = bytes.len() / l.out_dim.max(1);
            WeightData::Ggml {
                kind: *kind,
                bytes: bytes[r.start * row..r.end * row].to_vec(),
            }
        }
        WeightData::Packed(_) => {
            return Err(slice_err(what, "weights already packed for the CPU".into()))
        }
    };
    Ok(Linear {
        out_dim: r.len(),
        in_dim: n,
        w,
        bias: l.bias.as_ref().map(|b| b[r.clone()].to_vec()),
    })
}

/// Columns `c` of `l` (a slice of its inputs); the bias, added once to the reduced sum, is kept only
/// when `keep_bias` (rank 0).
pub fn cols(
    l: &Linear,
    c: Range<usize>,
    keep_bias: bool,
    what: &str,
) -> Result<Linear, ShardError> {
    if c.end > l.in_dim || c.start > c.end {
        return Err(slice_err(what, format!("columns {c:?} of {}", l.in_dim)));
    }
    let (out, n) = (l.out_dim, l.in_dim);
    fn take<T: Copy>(v: &[T], n: usize, c: &Range<usize>) -> Vec<T> {
        v.chunks(n)
            .flat_map(|row| row[c.clone()].iter().copied())
            .collect()
    }
    let w = match &l.w {
        WeightData::F32(v) => WeightData::F32(take(v, n, &c)),
        WeightData::Bf16(v) => WeightData::Bf16(take(v, n, &c)),
        WeightData::F8 {
            bytes,
            scale_inv,
            block,
        } => {
            let b = *block;
            if b == 0 {
                return Err(slice_err(what, "FP8 weights without a block size".into()));
            }
            if !c.start.is_multiple_of(b) || !(c.end.is_multiple_of(b) || c.end == n) {
                return Err(slice_err(
                    what,
                    format!("columns {c:?}: not on the checkpoint's {b}-column FP8 blocks"),
                ));
            }
            let scale_c = c.start / b..c.end.div_ceil(b);
            WeightData::F8 {
                bytes: take(bytes, n, &c),
                scale_inv: take(scale_inv, n.div_ceil(b), &scale_c),
                block: b,
            }
        }
        WeightData::Ggml { .. } | WeightData::Packed(_) => {
            return Err(slice_err(
                what,
                "columns of GGML-block or CPU-packed weights".into(),
            ))
        }
    };
    Ok(Linear {
        out_dim: out,
        in_dim: c.len(),
        w,
        bias: if keep_bias { l.bias.clone() } else { None },
    })
}

/// A gated MLP's intermediate units `u` (gate / up rows, down columns).
fn mlp(m: &Mlp, u: Range<usize>, rank: usize, what: &str) -> Result<Mlp, ShardError> {
    Ok(Mlp {
        gate: rows(&m.gate, u.clone(), what)?,
        up: rows(&m.up, u.clone(), what)?,
        down: cols(&m.down, u, rank == 0, what)?,
    })
}

/// A whole copy of `l` (replicated weights).
fn whole(l: &Linear, what: &str) -> Result<Linear, ShardError> {
    rows(l, 0..l.out_dim, what)
}

/// A whole copy of a routed expert (any stored format).
fn copy_mlp(m: &Mlp) -> Result<Mlp, ShardError> {
    let all = |l: &Linear| whole(l, "routed expert");
    Ok(Mlp {
        gate: all(&m.gate)?,
        up: all(&m.up)?,
        down: all(&m.down)?,
    })
}

/// A whole copy of a layer's sparse-attention indexer (replicated: every rank selects the same
/// positions from the same inputs).
fn copy_indexer(ix: &SparseAttention) -> Result<SparseAttention, ShardError> {
    Ok(match ix {
        SparseAttention::Shared => SparseAttention::Shared,
        SparseAttention::Own(w) => SparseAttention::Own(Box::new(IndexerWeights {
            wq_b: whole(&w.wq_b, "indexer wq_b")?,
            wk: whole(&w.wk, "indexer wk")?,
            k_norm_weight: w.k_norm_weight.clone(),
            k_norm_bias: w.k_norm_bias.clone(),
            weights_proj: whole(&w.weights_proj, "indexer weights_proj")?,
            pool: match &w.pool {
                Some(p) => Some(KeyPoolWeights {
                    ape: p.ape.clone(),
                    gate: whole(&p.gate, "indexer key-pool gate")?,
                }),
                None => None,
            },
        })),
    })
}

/// A whole copy of a layer's hyper-connections (replicated: every rank keeps the whole streams).
fn copy_hyper(h: &LayerHyper) -> LayerHyper {
    let one = |c: &HyperConnection| HyperConnection {
        proj: c.proj.clone(),
        base: c.base.clone(),
        scale: c.scale,
    };
    LayerHyper {
        attn: one(&h.attn),
        ffn: one(&h.ffn),
    }
}

/// Elements `r` of each of the `parts` consecutive equal parts of `v` (per-channel values of q, k
/// and v stacked: a rank's channels of each).
fn ranges_of<T: Copy>(v: &[T], parts: usize, r: &Range<usize>) -> Vec<T> {
    let each = v.len() / parts.max(1);
    (0..parts)
        .flat_map(|p| v[p * each + r.start..p * each + r.end].iter().copied())
        .collect()
}

/// A KDA layer's split by heads `heads` (of width `d`): q / k / v rows and their convolution
/// channels, the forget gate's `f_b` rows with `dt_bias`, `A_log` and β's rows by head, the output
/// gate's `g_b` rows, and o's input columns (the bias on rank 0); the gates' low-rank `f_a` / `g_a`
/// and the per-head norm weight whole. Each head's recurrence then runs on its rank alone.
fn kda(
    a: &LinearAttention,
    heads: &Range<usize>,
    d: usize,
    rank: usize,
) -> Result<LinearAttention, ShardError> {
    let ch = heads.start * d..heads.end * d;
    let kernel = a.conv.len() / (3 * a.q.out_dim).max(1);
    // the convolution's rows are the q, k, v channels, `kernel` taps each
    let taps = ch.start * kernel..ch.end * kernel;
    if a.conv.len() != 3 * a.q.out_dim * kernel || a.dt_bias.len() != a.q.out_dim {
        return Err(slice_err(
            "linear attention",
            format!(
                "a convolution of {} values or dt_bias of {} for {} channels",
                a.conv.len(),
                a.dt_bias.len(),
                a.q.out_dim
            ),
        ));
    }
    Ok(LinearAttention {
        q: rows(&a.q, ch.clone(), "linear attention q_proj")?,
        k: rows(&a.k, ch.clone(), "linear attention k_proj")?,
        v: rows(&a.v, ch.clone(), "linear attention v_proj")?,
        conv: ranges_of(&a.conv, 3, &taps),
        f_a: whole(&a.f_a, "linear attention f_a_proj")?,
        f_b: rows(&a.f_b, ch.clone(), "linear attention f_b_proj")?,
        dt_bias: a.dt_bias[ch.clone()].to_vec(),
        a_log: a
            .a_log
            .get(heads.clone())
            .ok_or_else(|| slice_err("A_log", format!("heads {heads:?}")))?
            .to_vec(),
        b: rows(&a.b, heads.clone(), "linear attention b_proj")?,
        g_a: whole(&a.g_a, "linear attention g_a_proj")?,
        g_b: rows(&a.g_b, ch.clone(), "linear attention g_b_proj")?,
        o_norm: a.o_norm.clone(),
        o: cols(&a.o, ch, rank == 0, "linear attention o_proj")?,
    })
}

fn gqa(a: &GqaAttention, s: &RankShard, head_dim: usize) -> Result<GqaAttention, ShardError> {
    let AttentionShard::Gqa {
        q_heads, kv_heads, ..
    } = &s.attention
    else {
        return Err(ShardError::Unsupported("GQA weights in an MLA plan"));
    };
    let q = q_heads.start * head_dim..q_heads.end * head_dim;
    let kv = kv_heads.start * head_dim..kv_heads.end * head_dim;
    Ok(GqaAttention {
        q: rows(&a.q, q.clone(), "q_proj")?,
        k: rows(&a.k, kv.clone(), "k_proj")?,
        v: rows(&a.v, kv, "v_proj")?,
        o: cols(&a.o, q, s.rank == 0, "o_proj")?,
        q_norm: a.q_norm.clone(),
        k_norm: a.k_norm.clone(),
    })
}

/// MLA's split, as vLLM's: the rank's heads of the query's last projection (`q_b`, or `q` without a
/// q-LoRA), of `kv_b` (each head's nope-key and value rows) and of `o` (their value columns); the
/// latent projections (`q_a`, `kv_a`), their norms and so the latent KV cache are replicated, every
/// rank computing the same latent rows.
fn mla(a: &MlaAttention, s: &RankShard, cfg: &ModelConfig) -> Result<MlaAttention, ShardError> {
    let AttentionShard::Mla { heads } = &s.attention else {
        return Err(ShardError::Unsupported("MLA weights in a GQA plan"));
    };
    let m = cfg
        .mla
        .as_ref()
        .ok_or(ShardError::Unsupported("MLA weights without an MLA config"))?;
    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    let q_rows = heads.start * qk..heads.end * qk;
    let q = match &a.q {
        MlaQuery::Direct(l) => MlaQuery::Direct(rows(l, q_rows, "q_proj")?),
        MlaQuery::LowRank { a: qa, norm, b } => MlaQuery::LowRank {
            a: whole(qa, "q_a_proj")?,
            norm: norm.clone(),
            b: rows(b, q_rows, "q_b_proj")?,
        },
    };
    let (per_head, lora) = (m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank);
    let kv_b = a
        .kv_b
        .get(heads.start * per_head * lora..heads.end * per_head * lora)
        .ok_or_else(|| {
            slice_err(
                "kv_b_proj",
                format!("heads {heads:?} of {} values", a.kv_b.len()),
            )
        })?
        .to_vec();
    let vd = m.v_head_dim;
    Ok(MlaAttention {
        q,
        kv_a: whole(&a.kv_a, "kv_a_proj_with_mqa")?,
        kv_a_norm: a.kv_a_norm.clone(),
        kv_b,
        o: cols(
            &a.o,
            heads.start * vd..heads.end * vd,
            s.rank == 0,
            "o_proj",
        )?,
        indexer: a.indexer.as_ref().map(copy_indexer).transpose()?,
    })
}

/// Rank `r`'s model: its slices of the dense weights, with the routed experts `mine[layer][expert]`
/// marks moved out of `full` (they leave the host when the rank uploads them), or copied when
/// `keep_host_copies` (live re-placement: DRAM keeps every expert).
pub fn rank_model(
    full: &mut Model,
    plan: &ShardPlan,
    r: usize,
    mine: &[Vec<bool>],
    keep_host_copies: bool,
) -> Result<Model, ShardError> {
    let s = &plan.ranks[r];
    let cfg = &full.config;
    let head_dim = cfg.head_dim;
    let mut layers = Vec::with_capacity(full.layers.len());
    for (li, layer) in full.layers.iter_mut().enumerate() {
        let attn = match &layer.attn {
            Attention::Gqa(a) => Attention::Gqa(gqa(a, s, head_dim)?),
            Attention::Mla(a) => Attention::Mla(mla(a, s, cfg)?),
            Attention::Linear(a) => {
                let (Some(heads), Some(la)) = (&s.linear_heads, &cfg.linear_attention) else {
                    return Err(ShardError::Unsupported(
                        "a linear-attention layer without its config",
                    ));
                };
                Attention::Linear(kda(a, heads, la.head_dim, r)?)
            }
        };
        let ffn = match &mut layer.ffn {
            Ffn::Dense(m) => Ffn::Dense(mlp(m, s.dense_mlp.clone(), r, "dense MLP")?),
            Ffn::Moe(b) => {
                let on_rank = mine.get(li).map(Vec::as_slice).unwrap_or(&[]);
                let experts = b
                    .experts
                    .iter_mut()
                    .enumerate()
                    .map(
                        |(e, slot)| match (on_rank.get(e).copied().unwrap_or(false), &slot) {
                            (false, _) => Ok(None),
                            (true, Some(m)) if keep_host_copies => copy_mlp(m).map(Some),
                            (true, _) => Ok(slot.take()),
                        },
                    )
                    .collect::<Result<_, ShardError>>()?;
                let shared = match (&b.shared, &s.shared_expert) {
                    (Some(m), Some(u)) => Some(mlp(m, u.clone(), r, "shared expert")?),
                    _ => None,
                };
                Ffn::Moe(MoeBlock {
                    router: b.router.clone(),
                    correction_bias: b.correction_bias.clone(),
                    experts,
                    shared,
                    shared_gate: b.shared_gate.clone(),
                    cpu_set: None,
                })
            }
        };
        layers.push(Layer {
            attn_norm: layer.attn_norm.clone(),
            attn,
            ffn_norm: layer.ffn_norm.clone(),
            ffn,
            hyper: layer.hyper.as_ref().map(copy_hyper),
        });
    }
    Ok(Model {
        config: plan.rank_config(&full.config, r),
        embed: rows(&full.embed, 0..full.embed.out_dim, "embed_tokens")?,
        layers,
        final_norm: full.final_norm.clone(),
        lm_head: Some(rows(full.lm_head(), s.vocab.clone(), "lm_head")?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// A `[out, in]` bf16 linear with values from a small integer pattern (exact in bf16) and a bias.
    fn linear(out: usize, inp: usize) -> Linear {
        let w = (0..out * inp)
            .map(|i| bf16::from_f32(((i * 7 % 13) as f32 - 6.0) / 8.0))
            .collect();
        Linear {
            out_dim: out,
            in_dim: inp,
            w: WeightData::Bf16(w),
            bias: Some((0..out).map(|i| i as f32).collect()),
        }
    }

    fn apply(l: &Linear, x: &[f32]) -> Vec<f32> {
        let mut row = vec![0f32; l.in_dim];
        (0..l.out_dim)
            .map(|r| {
                l.row_f32(r, &mut row);
                let dot: f32 = row.iter().zip(x).map(|(a, b)| a * b).sum();
                dot + l.bias.as_ref().map_or(0.0, |b| b[r])
            })
            .collect()
    }

    #[test]
    fn row_slices_concatenate_and_column_slices_sum_to_the_whole() {
        let l = linear(6, 8);
        let x: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
        let full = apply(&l, &x);
        // column-parallel: rows 0..2 and 2..6
        let mut cat = apply(&rows(&l, 0..2, "t").unwrap(), &x);
        cat.extend(apply(&rows(&l, 2..6, "t").unwrap(), &x));
        assert_eq!(cat, full);
        // row-parallel: input columns 0..4 on rank 0 (with the bias) and 4..8 on rank 1
        let a = apply(&cols(&l, 0..4, true, "t").unwrap(), &x[..4]);
        let b = apply(&cols(&l, 4..8, false, "t").unwrap(), &x[4..]);
        for i in 0..6 {
            assert!((a[i] + b[i] - full[i]).abs() < 1e-5, "row {i}");
        }
    }

    /// MLA over 2 ranks: the rank's query heads (`q_b` rows), `kv_b` heads and `o` columns; the
    /// latent projections whole on both. Concatenating the ranks' head outputs gives the full
    /// projection's, and their `o` partial sums add up to the full `o` (its bias once).
    #[test]
    fn mla_heads_split_and_latent_projections_replicate() {
        use crate::model::config::MlaConfig;
        let mut cfg =
            ModelConfig::from_json(&moe_sizing::known::config_json("deepseek-v3").unwrap())
                .unwrap();
        let (nope, rope, vd, lora, heads) = (2, 1, 2, 4, 4);
        cfg.num_heads = heads;
        cfg.mla = Some(MlaConfig {
            q_lora_rank: Some(6),
            kv_lora_rank: lora,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rope,
            v_head_dim: vd,
            latent_norm_eps: 1e-6,
        });
        let plan = ShardPlan::new(&cfg, 2).unwrap();
        let qk = nope + rope;
        let full = MlaAttention {
            q: MlaQuery::LowRank {
                a: linear(6, 8),
                norm: vec![1.0; 6],
                b: linear(heads * qk, 6),
            },
            kv_a: linear(lora + rope, 8),
            kv_a_norm: vec![1.0; lora],
            kv_b: (0..heads * (nope + vd) * lora).map(|i| i as f32).collect(),
            o: linear(8, heads * vd),
            indexer: None,
        };
        let parts: Vec<MlaAttention> = (0..2)
            .map(|r| mla(&full, &plan.ranks[r], &cfg).unwrap())
            .collect();
        let x6: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        let x8: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
        let MlaQuery::LowRank { b: full_b, .. } = &full.q else {
            unreachable!()
        };
        let mut q = Vec::new();
        let mut kv_b = Vec::new();
        for p in &parts {
            let MlaQuery::LowRank { a, b, .. } = &p.q else {
                panic!("q-LoRA kept")
            };
            assert_eq!((a.out_dim, b.out_dim), (6, 2 * qk));
            assert_eq!(apply(&p.kv_a, &x8).len(), lora + rope);
            q.extend(apply(b, &x6));
            kv_b.extend_from_slice(&p.kv_b);
        }
        assert_eq!(q, apply(full_b, &x6));
        assert_eq!(kv_b, full.kv_b);
        // o: rank r reads the value columns of its heads
        let v: Vec<f32> = (0..heads * vd).map(|i| i as f32 * 0.125).collect();
        let want = apply(&full.o, &v);
        let a = apply(&parts[0].o, &v[..2 * vd]);
        let b = apply(&parts[1].o, &v[2 * vd..]);
        for i in 0..8 {
            assert!((a[i] + b[i] - want[i]).abs() < 1e-4, "o row {i}");
        }
        assert!(parts[1].o.bias.is_none() && parts[0].o.bias.is_some());
    }

    /// KDA over 2 ranks on the CPU backend (GLM-5.3-Flash's fixture, 4 heads of 16): each rank runs
    /// its heads' projections, convolution channels, gates and recurrence; the ranks' o partial sums
    /// add up to the whole layer's output and each rank's recurrent state is the whole state's slice
    /// of its heads, across two steps (the state carried from the first into the second).
    #[test]
    fn kda_heads_split_and_their_partial_sums_add_up_to_the_layer() {
        use crate::engine::cpu::linear_attention::linear_attention_forward;
        use crate::engine::kv::RecurrentState;
        use crate::engine::Segment;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/glm5_next/model_bf16");
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let src = crate::weights::safetensors::SafetensorsDir::open(&dir).unwrap();
        let model = crate::model::build::build_model(cfg.clone(), &src).unwrap();
        let (li, full) = model
            .layers
            .iter()
            .enumerate()
            .find_map(|(li, l)| match &l.attn {
                Attention::Linear(a) => Some((li, a)),
                _ => None,
            })
            .unwrap();
        let la = cfg.linear_attention.unwrap();
        let world = 2;
        let plan = ShardPlan::new(&cfg, world).unwrap();
        let parts: Vec<(LinearAttention, ModelConfig)> = (0..world)
            .map(|r| {
                let heads = plan.ranks[r].linear_heads.clone().unwrap();
                let a = kda(full, &heads, la.head_dim, r).unwrap();
                (a, plan.rank_config(&cfg, r))
            })
            .collect();
        let hd = cfg.hidden_size;
        // inputs in [-1, 1) from a small LCG
        let mut seed = 5u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let state = |c: &ModelConfig| RecurrentState::new(&c.mixers, &c.linear_attention.unwrap());
        let mut whole_state = state(&cfg);
        let mut rank_states: Vec<RecurrentState> = parts.iter().map(|(_, c)| state(c)).collect();
        let mut pos0 = 0;
        for len in [13, 5] {
            let h: Vec<f32> = (0..len * hd).map(|_| next()).collect();
            let seg = [Segment { row0: 0, len, pos0 }];
            let want = linear_attention_forward(full, &cfg, li, &h, &seg, &mut [&mut whole_state]);
            let mut sum = vec![0f32; want.len()];
            for ((a, c), st) in parts.iter().zip(rank_states.iter_mut()) {
                let got = linear_attention_forward(a, c, li, &h, &seg, &mut [st]);
                sum.iter_mut().zip(&got).for_each(|(s, g)| *s += g);
            }
            let err = sum
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f32>()
                .sqrt()
                / want.iter().map(|b| b * b).sum::<f32>().sqrt();
            assert!(err < 1e-5, "step at {pos0}: rel-L2 {err}");
            pos0 += len;
        }
        // each rank's state: its heads' matrices, its channels of the convolution tail
        let whole = whole_state.layer_mut(li).unwrap().clone();
        let (d, qkv) = (la.head_dim, la.qkv_dim());
        for (r, st) in rank_states.iter_mut().enumerate() {
            let heads = plan.ranks[r].linear_heads.clone().unwrap();
            let mine = st.layer_mut(li).unwrap();
            let m = &whole.matrix[heads.start * d * d..heads.end * d * d];
            let close = |a: &[f32], b: &[f32]| {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6)
            };
            assert!(close(&mine.matrix, m), "rank {r}: state matrices");
            let ch = heads.start * d..heads.end * d;
            let tail: Vec<f32> = whole
                .conv
                .chunks(qkv)
                .flat_map(|part| part[ch.clone()].iter().copied())
                .collect();
            assert!(close(&mine.conv, &tail), "rank {r}: convolution tail");
        }
    }

    /// A rank's GLM-5.3-Flash model: its KDA heads, its MLA heads, the hyper-connections and the
    /// indexers whole, the config its heads (what its GPU buffers and recurrent state are sized from).
    #[test]
    fn hybrid_rank_models_split_kda_and_mla_and_replicate_the_rest() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/glm5_next/model_bf16");
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let src = crate::weights::safetensors::SafetensorsDir::open(&dir).unwrap();
        let mut full = crate::model::build::build_model(cfg.clone(), &src).unwrap();
        let plan = ShardPlan::new(&cfg, 2).unwrap();
        let none: Vec<Vec<bool>> = Vec::new();
        let part = rank_model(&mut full, &plan, 1, &none, false).unwrap();
        assert_eq!(part.config.linear_attention.unwrap().num_heads, 2);
        assert_eq!(part.config.num_heads, 2);
        let (mut kda, mut mla) = (0, 0);
        for (a, b) in full.layers.iter().zip(&part.layers) {
            let (ha, hb) = (a.hyper.as_ref().unwrap(), b.hyper.as_ref().unwrap());
            assert_eq!((&ha.attn.proj, &ha.ffn.base), (&hb.attn.proj, &hb.ffn.base));
            match (&a.attn, &b.attn) {
                (Attention::Linear(x), Attention::Linear(y)) => {
                    kda += 1;
                    assert_eq!((y.q.out_dim, y.o.in_dim, y.b.out_dim), (32, 32, 2));
                    assert_eq!(
                        (y.f_a.out_dim, y.o_norm.len()),
                        (x.f_a.out_dim, x.o_norm.len())
                    );
                    assert_eq!(y.a_log, x.a_log[2..4].to_vec());
                    assert!(y.o.bias.is_none());
                }
                (Attention::Mla(x), Attention::Mla(y)) => {
                    mla += 1;
                    assert_eq!(y.o.in_dim * 2, x.o.in_dim);
                    match (&x.indexer, &y.indexer) {
                        (Some(SparseAttention::Own(i)), Some(SparseAttention::Own(j))) => {
                            assert_eq!(i.k_norm_weight, j.k_norm_weight);
                            assert_eq!(i.wq_b.out_dim, j.wq_b.out_dim);
                        }
                        (Some(SparseAttention::Shared), Some(SparseAttention::Shared)) => {}
                        _ => panic!("the indexer was not copied"),
                    }
                }
                _ => panic!("layer kinds differ"),
            }
        }
        assert!(kda > 0 && mla > 0, "{kda} KDA, {mla} MLA layers");
    }

    #[test]
    fn fp8_slices_keep_whole_blocks_and_their_scales() {
        // 4 × 4 FP8 weights in 2 × 2 blocks, each block with its own scale
        let bytes: Vec<u8> = (0..16u8).map(|i| 0x30 + i).collect();
        let l = Linear {
            out_dim: 4,
            in_dim: 4,
            w: WeightData::F8 {
                bytes,
                scale_inv: vec![1.0, 2.0, 3.0, 4.0],
                block: 2,
            },
            bias: None,
        };
        let whole = |l: &Linear| -> Vec<Vec<f32>> {
            (0..l.out_dim)
                .map(|r| {
                    let mut v = vec![0f32; l.in_dim];
                    l.row_f32(r, &mut v);
                    v
                })
                .collect()
        };
        let full = whole(&l);
        let bottom = whole(&rows(&l, 2..4, "t").unwrap());
        assert_eq!(bottom, full[2..4].to_vec());
        let right = whole(&cols(&l, 2..4, false, "t").unwrap());
        for r in 0..4 {
            assert_eq!(right[r], full[r][2..4].to_vec(), "row {r}");
        }
        let Err(e) = rows(&l, 1..3, "q_proj") else {
            panic!("rows 1..3 split a 2-row block")
        };
        assert!(e.to_string().contains("FP8 blocks"), "{e}");
        assert!(cols(&l, 1..4, false, "o_proj").is_err());
    }
}
