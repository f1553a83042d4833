//! Host-side slicing by the sharding plan: a rank's rows or columns of a [`Linear`] (FP8 checkpoint
//! blocks kept whole), and a rank's [`Model`] — its slices of the dense weights plus the routed
//! experts it holds, moved out of the full model — which `GpuModel::upload` then uploads as it
//! uploads a whole model. The rank model lives only while it is uploaded.
use super::plan::{AttentionShard, RankShard, ShardError, ShardPlan};
use crate::engine::linear::{Linear, WeightData};
use crate::model::{
    Attention, Ffn, GqaAttention, Layer, MlaAttention, MlaQuery, Mlp, Model, ModelConfig, MoeBlock,
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

/// A whole copy of a routed expert (any stored format).
fn copy_mlp(m: &Mlp) -> Result<Mlp, ShardError> {
    let all = |l: &Linear| rows(l, 0..l.out_dim, "routed expert");
    Ok(Mlp {
        gate: all(&m.gate)?,
        up: all(&m.up)?,
        down: all(&m.down)?,
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
    if a.indexer.is_some() {
        return Err(ShardError::Unsupported(
            "sparse attention (the MLA indexer)",
        ));
    }
    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    let q_rows = heads.start * qk..heads.end * qk;
    let q = match &a.q {
        MlaQuery::Direct(l) => MlaQuery::Direct(rows(l, q_rows, "q_proj")?),
        MlaQuery::LowRank { a: qa, norm, b } => MlaQuery::LowRank {
            a: rows(qa, 0..qa.out_dim, "q_a_proj")?,
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
        kv_a: rows(&a.kv_a, 0..a.kv_a.out_dim, "kv_a_proj_with_mqa")?,
        kv_a_norm: a.kv_a_norm.clone(),
        kv_b,
        o: cols(
            &a.o,
            heads.start * vd..heads.end * vd,
            s.rank == 0,
            "o_proj",
        )?,
        indexer: None,
    })
}

/// Rank `r`'s model: its slices of the dense weights, with the routed experts `mine[layer][expert]`
/// marks moved out of `full` (they leave the host when the rank uploads them), or copied when
/// `keep_host_copies` (live re-placement: DRAM keeps every expert). Executes GQA and MLA
/// models (linear attention and hyper-connections have no split yet).
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
            Attention::Linear(_) => return Err(ShardError::Unsupported("linear attention (KDA)")),
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
            hyper: None,
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
