//! The sharding plan of a tensor-parallel group: for a model and N GPUs of one node, which part of
//! every dense weight each GPU (rank) holds, and which GPU holds each GPU-resident routed expert.
//! Pure (no device, no weights): the loader slices by it (`shard`), the memory plan counts by it.
//!
//! The split is Megatron's, as vLLM applies it:
//! - attention: query heads split evenly; GQA KV heads split with them, or, when the group is larger
//!   than the KV heads, each KV head replicated on `N / kv_heads` consecutive ranks (every rank then
//!   holds the one KV head its query heads read); MLA: heads split (`q_b`, `kv_b`, `o`), the latent
//!   projections (`q_a`, `kv_a` and their norms) replicated;
//! - dense MLP and shared experts: gate / up column-parallel (a range of intermediate units), down
//!   row-parallel over the same range;
//! - q/k/v column-parallel, o row-parallel: each rank's o and down produce partial sums of the full
//!   hidden width, so a layer needs two all-reduces (after attention, after the MLP or MoE block);
//! - lm_head split by vocabulary rows (the logits are gathered on the host); the embedding table is
//!   replicated (a lookup, no all-reduce);
//! - routed experts are not split: each GPU-resident expert lives whole on one GPU (expert parallel),
//!   spread evenly; the CPU expert pool serves the DRAM experts for all of them, once per layer;
//! - linear attention (KDA, GLM-5.3-Flash): heads split as attention heads are (q / k / v, their
//!   convolution channels, the forget gate's and output gate's second projections, β, `dt_bias`,
//!   `A_log` by head; o row-parallel), so each head's recurrent state lives on its rank; the gates'
//!   low-rank first projections and the per-head norm weight are replicated (as vLLM splits Kimi
//!   Linear's KDA);
//! - hyper-connections and the sparse-attention indexer are replicated: every rank computes them on
//!   the whole residual (between the all-reduces), so every rank mixes the same streams and attends
//!   the same positions.
use crate::model::ModelConfig;
use std::ops::Range;

/// Why a model does not split over the group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    #[error("--tensor-parallel must be at least 1")]
    Zero,
    #[error("{heads} attention heads do not split over {world} GPUs (tensor parallelism needs the heads to be a multiple of the GPU count)")]
    Heads { heads: usize, world: usize },
    #[error("{kv_heads} KV heads and {world} GPUs: one must divide the other (KV heads are split, or replicated when the GPUs outnumber them)")]
    KvHeads { kv_heads: usize, world: usize },
    #[error("{what}: intermediate size {size} does not split over {world} GPUs")]
    Intermediate {
        what: &'static str,
        size: usize,
        world: usize,
    },
    #[error("{what}: {width} {axis} per GPU is not a multiple of the {group}-wide quantization group ({format}); use fewer GPUs or --dense-dtype bf16")]
    QuantGroup {
        what: &'static str,
        width: usize,
        axis: &'static str,
        group: usize,
        format: &'static str,
    },
    #[error("{heads} linear-attention (KDA) heads do not split over {world} GPUs (their heads are split like attention heads)")]
    LinearHeads { heads: usize, world: usize },
    #[error("{0} has no tensor-parallel split yet: run it with --tensor-parallel 1")]
    Unsupported(&'static str),
    #[error("{what}: cannot slice {detail}")]
    Slice { what: String, detail: String },
}

/// One rank's attention weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttentionShard {
    /// Query heads `q_heads` and KV heads `kv_heads` (each KV head is held by `kv_replicas` ranks).
    Gqa {
        q_heads: Range<usize>,
        kv_heads: Range<usize>,
        kv_replicas: usize,
    },
    /// Heads `heads` of `q_b`, `kv_b` and `o`; the latent projections are replicated.
    Mla { heads: Range<usize> },
}

impl AttentionShard {
    /// Query heads of the rank.
    pub fn heads(&self) -> usize {
        match self {
            AttentionShard::Gqa { q_heads, .. } => q_heads.len(),
            AttentionShard::Mla { heads } => heads.len(),
        }
    }
}

/// What one GPU of the group holds of the dense weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankShard {
    pub rank: usize,
    pub attention: AttentionShard,
    /// Intermediate units of the dense MLP layers (gate / up rows, down columns).
    pub dense_mlp: Range<usize>,
    /// Intermediate units of the shared expert (`None`: the model has none).
    pub shared_expert: Option<Range<usize>>,
    /// Rows of lm_head (vocabulary ids whose logits this rank computes).
    pub vocab: Range<usize>,
    /// Heads of the linear-attention (KDA) layers (`None`: the model has none).
    pub linear_heads: Option<Range<usize>>,
}

/// The whole group's split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    pub world: usize,
    pub ranks: Vec<RankShard>,
}

/// `i`-th of `world` equal parts of `0..size` (the caller checked divisibility).
fn part(size: usize, world: usize, i: usize) -> Range<usize> {
    let each = size / world;
    i * each..(i + 1) * each
}

/// `i`-th of `world` parts of `0..size` whose sizes differ by at most one (vocabularies need not
/// divide: the logits are gathered, not reduced).
fn part_uneven(size: usize, world: usize, i: usize) -> Range<usize> {
    let (each, extra) = (size / world, size % world);
    let start = i * each + i.min(extra);
    start..start + each + usize::from(i < extra)
}

fn split(what: &'static str, size: usize, world: usize) -> Result<(), ShardError> {
    if size.is_multiple_of(world) {
        Ok(())
    } else {
        Err(ShardError::Intermediate { what, size, world })
    }
}

impl ShardPlan {
    /// The plan for `cfg` over `world` GPUs; refuses what does not divide (heads, KV heads,
    /// intermediate sizes) and attention kinds without a split.
    pub fn new(cfg: &ModelConfig, world: usize) -> Result<Self, ShardError> {
        if world == 0 {
            return Err(ShardError::Zero);
        }
        if !cfg.num_heads.is_multiple_of(world) {
            return Err(ShardError::Heads {
                heads: cfg.num_heads,
                world,
            });
        }
        let kv = cfg.num_kv_heads;
        if cfg.mla.is_none() && !(kv.is_multiple_of(world) || (kv > 0 && world.is_multiple_of(kv)))
        {
            return Err(ShardError::KvHeads {
                kv_heads: kv,
                world,
            });
        }
        let has_dense_layers = cfg.moe_layers.iter().any(|&m| !m) || cfg.moe.is_none();
        if has_dense_layers {
            split("dense MLP", cfg.intermediate_size, world)?;
        }
        let shared = cfg.moe.as_ref().and_then(|m| m.shared_intermediate);
        if let Some(s) = shared {
            split("shared expert", s, world)?;
        }
        let linear_heads = cfg.linear_attention.map(|la| la.num_heads);
        if let Some(heads) = linear_heads.filter(|h| !h.is_multiple_of(world)) {
            return Err(ShardError::LinearHeads { heads, world });
        }
        let ranks = (0..world)
            .map(|r| RankShard {
                rank: r,
                attention: match &cfg.mla {
                    Some(_) => AttentionShard::Mla {
                        heads: part(cfg.num_heads, world, r),
                    },
                    None if kv >= world => AttentionShard::Gqa {
                        q_heads: part(cfg.num_heads, world, r),
                        kv_heads: part(kv, world, r),
                        kv_replicas: 1,
                    },
                    None => {
                        let replicas = world / kv;
                        AttentionShard::Gqa {
                            q_heads: part(cfg.num_heads, world, r),
                            kv_heads: r / replicas..r / replicas + 1,
                            kv_replicas: replicas,
                        }
                    }
                },
                dense_mlp: if has_dense_layers {
                    part(cfg.intermediate_size, world, r)
                } else {
                    0..0
                },
                shared_expert: shared.map(|s| part(s, world, r)),
                vocab: part_uneven(cfg.vocab_size, world, r),
                linear_heads: linear_heads.map(|h| part(h, world, r)),
            })
            .collect();
        Ok(Self { world, ranks })
    }

    /// Checks that each rank's slice of every quantized weight is a whole number of quantization
    /// groups: the row-parallel inputs (o's heads × head dim, down's intermediate units) against the
    /// `group` of the dense format the GPU computes in (`format` names it; 1 for bf16), and, when the
    /// checkpoint's FP8 blocks are kept as stored (`fp8_block`), the column-parallel output rows too.
    pub fn check_groups(
        &self,
        cfg: &ModelConfig,
        (group, format): (usize, &'static str),
        fp8_block: Option<usize>,
    ) -> Result<(), ShardError> {
        let Some(r0) = self.ranks.first().filter(|_| self.world > 1) else {
            return Ok(());
        };
        let (v_dim, q_dim) = match &cfg.mla {
            Some(m) => (m.v_head_dim, m.qk_nope_head_dim + m.qk_rope_head_dim),
            None => (cfg.head_dim, cfg.head_dim),
        };
        let heads = r0.attention.heads();
        // (weight, slice width along the split axis)
        let mut inputs = vec![("o_proj", heads * v_dim)];
        let mut outputs = vec![("q_proj", heads * q_dim)];
        if let AttentionShard::Gqa { kv_heads, .. } = &r0.attention {
            outputs.push(("k_proj / v_proj", kv_heads.len() * cfg.head_dim));
        }
        if !r0.dense_mlp.is_empty() {
            inputs.push(("dense MLP down_proj", r0.dense_mlp.len()));
            outputs.push(("dense MLP gate_proj / up_proj", r0.dense_mlp.len()));
        }
        if let Some(s) = &r0.shared_expert {
            inputs.push(("shared expert down_proj", s.len()));
            outputs.push(("shared expert gate_proj / up_proj", s.len()));
        }
        if let (Some(h), Some(la)) = (&r0.linear_heads, &cfg.linear_attention) {
            inputs.push(("linear attention o_proj", h.len() * la.head_dim));
            outputs.push(("linear attention q / k / v", h.len() * la.head_dim));
        }
        let check = |what, width: usize, axis, group: usize, format| {
            if group > 1 && !width.is_multiple_of(group) {
                return Err(ShardError::QuantGroup {
                    what,
                    width,
                    axis,
                    group,
                    format,
                });
            }
            Ok(())
        };
        for &(what, width) in &inputs {
            check(what, width, "input columns", group, format)?;
        }
        if let Some(b) = fp8_block {
            let kept = "the checkpoint's FP8 blocks";
            for &(what, width) in &inputs {
                check(what, width, "input columns", b, kept)?;
            }
            for &(what, width) in &outputs {
                check(what, width, "output rows", b, kept)?;
            }
        }
        Ok(())
    }

    /// The model configuration rank `r` computes with: its heads, intermediate sizes and vocabulary
    /// rows (what the GPU buffers and KV pool of that rank are sized from).
    pub fn rank_config(&self, cfg: &ModelConfig, r: usize) -> ModelConfig {
        let s = &self.ranks[r];
        let mut c = cfg.clone();
        c.num_heads = s.attention.heads();
        if let AttentionShard::Gqa { kv_heads, .. } = &s.attention {
            c.num_kv_heads = kv_heads.len();
        }
        if !s.dense_mlp.is_empty() {
            c.intermediate_size = s.dense_mlp.len();
        }
        if let (Some(m), Some(sh)) = (c.moe.as_mut(), &s.shared_expert) {
            m.shared_intermediate = Some(sh.len());
        }
        c.vocab_size = s.vocab.len();
        if let (Some(la), Some(h)) = (c.linear_attention.as_mut(), &s.linear_heads) {
            la.num_heads = h.len();
        }
        c
    }
}

/// Which GPU holds each GPU-resident routed expert: per layer, the experts `placement` puts on the
/// GPUs, dealt round-robin over the ranks in expert order, each layer starting one rank further so
/// that layers with a count that does not divide do not all load rank 0. `None`: in DRAM.
pub fn spread_experts(placement: &[Vec<bool>], world: usize) -> Vec<Vec<Option<usize>>> {
    let world = world.max(1);
    placement
        .iter()
        .enumerate()
        .map(|(li, row)| {
            let mut next = li % world;
            row.iter()
                .map(|&on_gpu| {
                    on_gpu.then(|| {
                        let r = next;
                        next = (next + 1) % world;
                        r
                    })
                })
                .collect()
        })
        .collect()
}

/// Rank `r`'s share of `homes`: `true` where the expert lives on that GPU.
pub fn rank_placement(homes: &[Vec<Option<usize>>], r: usize) -> Vec<Vec<bool>> {
    homes
        .iter()
        .map(|row| row.iter().map(|&h| h == Some(r)).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(key: &str) -> ModelConfig {
        ModelConfig::from_json(&moe_sizing::known::config_json(key).unwrap()).unwrap()
    }

    /// Every query head on exactly one rank, in order, and the KV head it reads on that rank.
    fn check_heads(cfg: &ModelConfig, plan: &ShardPlan) {
        let group = cfg.num_heads / cfg.num_kv_heads;
        let mut next = 0;
        for s in &plan.ranks {
            let AttentionShard::Gqa {
                q_heads,
                kv_heads,
                kv_replicas,
            } = &s.attention
            else {
                panic!("GQA model planned as MLA");
            };
            assert_eq!(q_heads.start, next);
            next = q_heads.end;
            for h in q_heads.clone() {
                assert!(kv_heads.contains(&(h / group)), "rank {} head {h}", s.rank);
            }
            assert_eq!(*kv_replicas, (plan.world / cfg.num_kv_heads).max(1));
        }
        assert_eq!(next, cfg.num_heads);
    }

    #[test]
    fn gqa_heads_split_and_kv_heads_replicate_past_their_count() {
        let cfg = config("qwen3-30b-a3b"); // 32 query heads, 4 KV heads, vocab 151936
        for world in [1, 2, 4, 8, 16, 32] {
            let plan = ShardPlan::new(&cfg, world).unwrap();
            check_heads(&cfg, &plan);
            let kv: Vec<usize> = plan
                .ranks
                .iter()
                .map(|s| match &s.attention {
                    AttentionShard::Gqa { kv_heads, .. } => kv_heads.len(),
                    _ => 0,
                })
                .collect();
            assert!(
                kv.iter().all(|&k| k == (4 / world).max(1)),
                "{world}: {kv:?}"
            );
            // vocabulary rows: contiguous, covering, sizes within one
            let mut end = 0;
            for s in &plan.ranks {
                assert_eq!(s.vocab.start, end);
                end = s.vocab.end;
            }
            assert_eq!(end, cfg.vocab_size);
        }
        // 8 GPUs: KV head 2 is on ranks 4 and 5, which hold query heads 16..24
        let plan = ShardPlan::new(&cfg, 8).unwrap();
        assert_eq!(
            plan.ranks[5].attention,
            AttentionShard::Gqa {
                q_heads: 20..24,
                kv_heads: 2..3,
                kv_replicas: 2
            }
        );
        let c5 = plan.rank_config(&cfg, 5);
        assert_eq!(
            (c5.num_heads, c5.num_kv_heads, c5.vocab_size),
            (4, 1, 18992)
        );
    }

    #[test]
    fn uneven_vocabularies_split_within_one_row() {
        let parts: Vec<_> = (0..3).map(|i| part_uneven(10, 3, i)).collect();
        assert_eq!(parts, vec![0..4, 4..7, 7..10]);
    }

    #[test]
    fn dense_and_shared_experts_split_by_intermediate_units() {
        let cfg = config("glm-4.5-air"); // 96 heads, 8 KV, dense 10944, shared 1408
        let plan = ShardPlan::new(&cfg, 4).unwrap();
        assert_eq!(plan.ranks[1].dense_mlp, 2736..5472);
        assert_eq!(plan.ranks[3].shared_expert, Some(1056..1408));
        let c = plan.rank_config(&cfg, 3);
        assert_eq!(c.intermediate_size, 2736);
        assert_eq!(c.moe.as_ref().unwrap().shared_intermediate, Some(352));
        // routed experts are not split
        assert_eq!(
            c.moe.as_ref().unwrap().expert_intermediate,
            cfg.moe.as_ref().unwrap().expert_intermediate
        );
    }

    fn fixture_config(name: &str) -> ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name)
            .join("model_bf16");
        ModelConfig::from_dir(&dir).unwrap()
    }

    /// GLM-5's sparse attention: the MLA heads split, the indexer replicated (nothing to plan).
    #[test]
    fn sparse_attention_splits_its_heads_and_replicates_the_indexer() {
        let cfg = fixture_config("glm_moe_dsa");
        assert!(cfg.indexer.is_some());
        let plan = ShardPlan::new(&cfg, 2).unwrap();
        let heads = cfg.num_heads / 2;
        assert_eq!(
            plan.ranks[1].attention,
            AttentionShard::Mla {
                heads: heads..2 * heads
            }
        );
        assert_eq!(plan.rank_config(&cfg, 1).indexer, cfg.indexer);
    }

    /// GLM-5.3-Flash: KDA heads split like attention heads (each rank's config holds its heads, which
    /// size its recurrent state), hyper-connections and the indexer replicated; KDA heads that do not
    /// divide are refused with the reason.
    #[test]
    fn linear_attention_heads_split_and_hyper_connections_replicate() {
        let mut cfg = fixture_config("glm5_next"); // 4 MLA heads, 4 KDA heads of 16
        assert!(cfg.linear_attention.is_some() && cfg.hyper.is_some() && cfg.indexer.is_some());
        for world in [1, 2, 4] {
            let plan = ShardPlan::new(&cfg, world).unwrap();
            let mut next = 0;
            for s in &plan.ranks {
                let h = s.linear_heads.clone().unwrap();
                assert_eq!((h.start, h.len()), (next, 4 / world));
                next = h.end;
                let c = plan.rank_config(&cfg, s.rank);
                assert_eq!(c.linear_attention.unwrap().num_heads, 4 / world);
                assert_eq!(c.hyper, cfg.hyper);
                // the state of a sequence on a rank: its heads' matrices and convolution tail
                let whole = cfg.linear_attention.unwrap().state_floats();
                assert_eq!(c.linear_attention.unwrap().state_floats() * world, whole);
            }
            assert_eq!(next, 4);
        }
        // GLM-5.3-Flash's shape: 64 KDA heads of 128 over 2 GPUs, 32 each
        let glm = ModelConfig::from_json(&moe_sizing::known::config_json("glm-5.3-flash").unwrap())
            .unwrap();
        let plan = ShardPlan::new(&glm, 2).unwrap();
        assert_eq!(plan.ranks[1].linear_heads, Some(32..64));
        assert!(plan.check_groups(&glm, (32, "int4"), None).is_ok());
        // 6 KDA heads over 4 GPUs (the 4 attention heads would split)
        cfg.linear_attention.as_mut().unwrap().num_heads = 6;
        let e = ShardPlan::new(&cfg, 4).unwrap_err();
        assert_eq!(e, ShardError::LinearHeads { heads: 6, world: 4 });
        assert!(
            e.to_string()
                .starts_with("6 linear-attention (KDA) heads do not split over 4 GPUs"),
            "{e}"
        );
    }

    #[test]
    fn mla_splits_heads() {
        let cfg = config("deepseek-v3");
        let plan = ShardPlan::new(&cfg, 8).unwrap();
        assert_eq!(
            plan.ranks[7].attention,
            AttentionShard::Mla { heads: 112..128 }
        );
        assert_eq!(plan.rank_config(&cfg, 7).num_heads, 16);
    }

    #[test]
    fn what_does_not_divide_is_refused_with_the_reason() {
        let cfg = config("qwen3-30b-a3b");
        assert_eq!(
            ShardPlan::new(&cfg, 3),
            Err(ShardError::Heads {
                heads: 32,
                world: 3
            })
        );
        assert_eq!(ShardPlan::new(&cfg, 0), Err(ShardError::Zero));
        let mut kv = cfg.clone();
        (kv.num_heads, kv.num_kv_heads) = (24, 4);
        let e = ShardPlan::new(&kv, 6).unwrap_err();
        assert_eq!(
            e,
            ShardError::KvHeads {
                kv_heads: 4,
                world: 6
            }
        );
        assert!(e.to_string().contains("4 KV heads and 6 GPUs"), "{e}");
        let mut glm = config("glm-4.5-air");
        glm.intermediate_size = 10945;
        assert!(matches!(
            ShardPlan::new(&glm, 2),
            Err(ShardError::Intermediate {
                what: "dense MLP",
                ..
            })
        ));
    }

    #[test]
    fn quantization_groups_must_divide_each_slice() {
        // GLM-4.5-Air over 4 GPUs: 2736 dense and 352 shared-expert units per GPU
        let cfg = config("glm-4.5-air");
        let plan = ShardPlan::new(&cfg, 4).unwrap();
        assert!(plan.check_groups(&cfg, (1, "bf16"), None).is_ok());
        assert!(plan.check_groups(&cfg, (16, "fp8"), None).is_ok());
        let e = plan.check_groups(&cfg, (32, "int4"), None).unwrap_err();
        assert!(
            matches!(
                e,
                ShardError::QuantGroup {
                    width: 2736,
                    group: 32,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("2736 input columns per GPU"), "{e}");
        // checkpoint FP8 blocks of 128 kept whole: 2736 dense units are not whole blocks
        let e = plan.check_groups(&cfg, (16, "fp8"), Some(128)).unwrap_err();
        assert!(
            matches!(
                e,
                ShardError::QuantGroup {
                    width: 2736,
                    group: 128,
                    ..
                }
            ),
            "{e}"
        );
        // over 8 GPUs even fp8's 16-wide groups do not divide 1368 units
        let eight = ShardPlan::new(&cfg, 8).unwrap();
        assert!(eight.check_groups(&cfg, (16, "fp8"), None).is_err());
        // Qwen3-30B-A3B-FP8 over 8 GPUs: 4 heads × 128 and one KV head per GPU, all whole blocks
        let q = config("qwen3-30b-a3b");
        let plan = ShardPlan::new(&q, 8).unwrap();
        assert!(plan.check_groups(&q, (16, "fp8"), Some(128)).is_ok());
        // one GPU never refuses
        let one = ShardPlan::new(&cfg, 1).unwrap();
        assert!(one.check_groups(&cfg, (32, "int4"), Some(128)).is_ok());
    }

    #[test]
    fn gpu_experts_are_spread_evenly_and_once() {
        // 3 layers of 8 experts: 4, 3 and 0 on the GPUs
        let placement = vec![
            vec![true, false, true, true, false, true, false, false],
            vec![false, true, true, false, false, false, true, false],
            vec![false; 8],
        ];
        let homes = spread_experts(&placement, 2);
        for (li, row) in homes.iter().enumerate() {
            for (e, h) in row.iter().enumerate() {
                assert_eq!(h.is_some(), placement[li][e], "layer {li} expert {e}");
            }
        }
        assert_eq!(
            homes[0],
            vec![Some(0), None, Some(1), Some(0), None, Some(1), None, None]
        );
        // odd counts alternate which rank takes the extra expert
        assert_eq!(
            homes[1],
            vec![None, Some(1), Some(0), None, None, None, Some(1), None]
        );
        let r1 = rank_placement(&homes, 1);
        let held: usize = r1.iter().flatten().filter(|&&b| b).count();
        assert_eq!(held, 4);
        let r0 = rank_placement(&homes, 0);
        assert_eq!(r0.iter().flatten().filter(|&&b| b).count(), 3);
    }
}
