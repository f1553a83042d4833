//! Packs a model's dense projections for the CPU kernels after loading: attention (GQA and MLA),
//! dense MLPs, shared experts, the embedding table and lm_head. Routed experts are packed per layer
//! by `engine::cpu::experts`; weights no packed format holds exactly (f32 that bf16 would round, FP8
//! with other block sizes) stay on the reference path.
use crate::engine::linear::Linear;
use crate::model::{Attention, Ffn, MlaQuery, Mlp, Model};
use anyhow::Context;
use moe_kernels::cpu::{CpuMoeOptions, WorkerPool};
use rayon::prelude::*;
use std::sync::Arc;

/// How many projections were packed, and how many stayed on the reference path.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PackSummary {
    pub packed: usize,
    pub reference: usize,
    /// Bytes of the packed weights (tiles and scales).
    pub bytes: usize,
}

impl std::ops::AddAssign for PackSummary {
    fn add_assign(&mut self, o: Self) {
        self.packed += o.packed;
        self.reference += o.reference;
        self.bytes += o.bytes;
    }
}

/// Packs every dense projection of `model` onto `pool` (layers in parallel), with the tier cap and
/// the dense input of `opts`.
pub fn pack_dense(
    model: &mut Model,
    pool: &Arc<WorkerPool>,
    opts: &CpuMoeOptions,
) -> anyhow::Result<PackSummary> {
    let pack = |name: String, l: &mut Linear| -> anyhow::Result<PackSummary> {
        let packed = l
            .pack(pool, opts)
            .with_context(|| format!("packing {name} for the CPU kernels"))?;
        Ok(match &l.w {
            crate::engine::linear::WeightData::Packed(p) if packed => PackSummary {
                packed: 1,
                reference: 0,
                bytes: p.mat.bytes(),
            },
            _ => PackSummary {
                packed: 0,
                reference: 1,
                bytes: 0,
            },
        })
    };
    let mut total = pack("the embedding".into(), &mut model.embed)?;
    if let Some(head) = &mut model.lm_head {
        total += pack("lm_head".into(), head)?;
    }
    let per_layer = model
        .layers
        .par_iter_mut()
        .enumerate()
        .map(|(i, layer)| {
            let mut s = PackSummary::default();
            let mut one = |what: &str, l: &mut Linear| -> anyhow::Result<()> {
                s += pack(format!("layer {i} {what}"), l)?;
                Ok(())
            };
            match &mut layer.attn {
                Attention::Gqa(a) => {
                    for (what, l) in [
                        ("q", &mut a.q),
                        ("k", &mut a.k),
                        ("v", &mut a.v),
                        ("o", &mut a.o),
                    ] {
                        one(what, l)?;
                    }
                }
                Attention::Mla(a) => {
                    match &mut a.q {
                        MlaQuery::Direct(l) => one("q", l)?,
                        MlaQuery::LowRank { a, b, .. } => {
                            one("q_a", a)?;
                            one("q_b", b)?;
                        }
                    }
                    one("kv_a", &mut a.kv_a)?;
                    one("o", &mut a.o)?;
                }
                Attention::Linear(a) => {
                    for (what, l) in [
                        ("q", &mut a.q),
                        ("k", &mut a.k),
                        ("v", &mut a.v),
                        ("f_a", &mut a.f_a),
                        ("f_b", &mut a.f_b),
                        ("b", &mut a.b),
                        ("g_a", &mut a.g_a),
                        ("g_b", &mut a.g_b),
                        ("o", &mut a.o),
                    ] {
                        one(what, l)?;
                    }
                }
            }
            let mlp: Option<&mut Mlp> = match &mut layer.ffn {
                Ffn::Dense(m) => Some(m),
                Ffn::Moe(b) => b.shared.as_mut(),
            };
            if let Some(m) = mlp {
                one("gate", &mut m.gate)?;
                one("up", &mut m.up)?;
                one("down", &mut m.down)?;
            }
            Ok(s)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for s in per_layer {
        total += s;
    }
    Ok(total)
}
