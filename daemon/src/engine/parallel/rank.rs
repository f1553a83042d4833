//! What one GPU of a tensor-parallel group knows about its share ([`RankCtx`], held by its
//! `GpuModel`), and the few points where a step differs from a single GPU's:
//!
//! - the residual stream `x` is whole on every rank between blocks; each attention block and MLP /
//!   MoE block adds this rank's partial sum into it. So that the all-reduce after the block adds the
//!   residual once, ranks other than 0 write their attention output projection over `x` instead of
//!   adding to it ([`GpuModel::tp_attention_accumulates`]: `x` stays whole inside the attention
//!   block, where the sparse-attention indexer reads it) and zero their copy right after the FFN
//!   block's norm has read it ([`GpuModel::tp_keep_residual_on_rank0`]); then
//!   [`GpuModel::tp_all_reduce`] sums;
//! - attention runs this rank's heads ([`GpuModel::tp_heads`]), lm_head its vocabulary rows;
//! - a MoE layer's experts resident on another GPU are that GPU's work, and DRAM experts are rank
//!   0's (the one CPU hand-off of the layer): [`tp_expert_homes`].
//!
//! Without a `RankCtx` (one GPU) none of this runs: the step is today's, bit for bit.
use super::comm::Communicator;
use crate::engine::gpu::dispatch::ExpertHome;
use crate::engine::gpu::{GpuAttention, GpuFfn, GpuMlaQuery, GpuModel};
use crate::model::ModelConfig;
use cudarc::driver::CudaSlice;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

/// Per layer and expert, the rank whose GPU holds the expert (`None`: DRAM).
pub type ExpertOwners = Vec<Vec<Option<usize>>>;

/// Whether the group is inside a step of all its ranks ([`super::TpGroup::forward`]); shared by the
/// ranks. A rank's step outside one would wait at its first all-reduce for ranks that never come, so
/// it is refused before it starts.
#[derive(Default)]
pub struct GroupStep(AtomicBool);

impl GroupStep {
    /// Marks the group stepping until the guard is dropped.
    pub fn enter(&self) -> GroupStepGuard<'_> {
        self.0.store(true, Ordering::Release);
        GroupStepGuard(self)
    }

    pub fn active(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

pub struct GroupStepGuard<'a>(&'a GroupStep);

impl Drop for GroupStepGuard<'_> {
    fn drop(&mut self) {
        self.0 .0.store(false, Ordering::Release);
    }
}

/// One rank of a tensor-parallel group.
pub struct RankCtx {
    pub rank: usize,
    pub comm: Arc<dyn Communicator>,
    /// Query and KV heads this rank's attention computes.
    pub heads: (usize, usize),
    /// lm_head rows (logits) this rank computes.
    pub vocab: usize,
    /// Per layer and expert, the rank whose GPU holds the expert (`None`: DRAM); shared by the
    /// ranks, changed only between steps (live re-placement's swaps).
    pub expert_owner: Arc<RwLock<ExpertOwners>>,
    /// Set while the group steps (shared by the ranks).
    pub group_step: Arc<GroupStep>,
}

/// A layer's expert homes as rank `rank` computes them: experts on another GPU are skipped
/// ([`ExpertHome::Peer`]), and so are the DRAM experts on every rank but 0.
pub fn tp_expert_homes(
    homes: Vec<ExpertHome>,
    rank: usize,
    owners: &[Option<usize>],
) -> Vec<ExpertHome> {
    homes
        .into_iter()
        .enumerate()
        .map(|(e, h)| match (owners.get(e).copied().flatten(), h) {
            (Some(o), ExpertHome::Resident) if o == rank => h,
            (Some(_), _) => ExpertHome::Peer,
            (None, _) if rank == 0 => h,
            (None, _) => ExpertHome::Peer,
        })
        .collect()
}

/// What one GPU's uploaded model holds (read back from its device weights: the start-up log and tests
/// check the split against the plan with it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSummary {
    pub rank: usize,
    /// Output rows of the first attention layer's query projection (GQA's q, MLA's q_b or q), input
    /// columns of its o projection.
    pub q_rows: usize,
    pub o_cols: usize,
    /// Row width of the K cache.
    pub kv_width: usize,
    /// Intermediate units of the first dense MLP (0: none).
    pub dense_units: usize,
    /// lm_head rows (0: tied to the embedding table).
    pub lm_head_rows: usize,
    /// Routed experts resident on this GPU, all layers.
    pub gpu_experts: usize,
}

impl GpuModel {
    /// This GPU's share as uploaded.
    pub fn shard_summary(&self) -> ShardSummary {
        let gqa = self.layers.iter().find_map(|l| match &l.attn {
            GpuAttention::Gqa(w) => Some((w.q.out_dim, w.o.in_dim)),
            GpuAttention::Mla(w) => match &w.q {
                GpuMlaQuery::Direct(q) | GpuMlaQuery::LowRank { b: q, .. } => {
                    Some((q.out_dim, w.o.in_dim))
                }
            },
            GpuAttention::Linear(_) => None,
        });
        let dense = self.layers.iter().find_map(|l| match &l.ffn {
            GpuFfn::Dense(m) => Some(m.down.in_dim),
            GpuFfn::Moe(_) => None,
        });
        let experts = self
            .layers
            .iter()
            .map(|l| match &l.ffn {
                GpuFfn::Moe(m) => m.experts.resident().iter().filter(|&&r| r).count(),
                GpuFfn::Dense(_) => 0,
            })
            .sum();
        ShardSummary {
            rank: self.shard.as_ref().map_or(0, |s| s.rank),
            q_rows: gqa.map_or(0, |g| g.0),
            o_cols: gqa.map_or(0, |g| g.1),
            kv_width: self.kv.lock().unwrap_or_else(|e| e.into_inner()).width,
            dense_units: dense.unwrap_or(0),
            lm_head_rows: self.lm_head.as_ref().map_or(0, |l| l.out_dim),
            gpu_experts: experts,
        }
    }

    /// Refuses a step of one rank of a group outside the group's step (its all-reduces would wait for
    /// ranks that are not stepping). Nothing to check on one GPU.
    pub fn tp_check_group_step(&self) -> anyhow::Result<()> {
        match &self.shard {
            Some(s) if s.comm.world() > 1 && !s.group_step.active() => anyhow::bail!(
                "tensor-parallel rank {}: a step must run on every rank of the group together \
                 (through the engine's step), not on one GPU's model alone",
                s.rank
            ),
            _ => Ok(()),
        }
    }

    /// (query heads, KV heads) this GPU's attention computes.
    pub fn tp_heads(&self, cfg: &ModelConfig) -> (usize, usize) {
        self.shard
            .as_ref()
            .map_or((cfg.num_heads, cfg.num_kv_heads), |s| s.heads)
    }

    /// Logits (lm_head rows) this GPU computes.
    pub fn tp_vocab(&self, cfg: &ModelConfig) -> usize {
        self.shard.as_ref().map_or(cfg.vocab_size, |s| s.vocab)
    }

    /// Whether an attention block's output projection adds into `x` (one GPU, and rank 0, whose `x`
    /// carries the residual) or writes over it (the other ranks: their partial sum alone, so the
    /// all-reduce counts the residual once). Writing instead of zeroing `x` after the norm keeps it
    /// whole through the block for what reads the layer input there (the sparse-attention indexer).
    pub fn tp_attention_accumulates(&self) -> bool {
        self.shard.as_ref().is_none_or(|s| s.rank == 0)
    }

    /// After the FFN block's norm read `x[..len]`: ranks other than 0 zero their copy, so the
    /// reduction after the block (several partial sums add into `x`) counts the residual once.
    pub fn tp_keep_residual_on_rank0(
        &self,
        x: &mut CudaSlice<f32>,
        len: usize,
    ) -> anyhow::Result<()> {
        match &self.shard {
            Some(s) if s.rank > 0 => {
                self.dev.stream.memset_zeros(&mut x.slice_mut(..len))?;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Sums the ranks' `x[..len]` after a block (nothing on one GPU).
    pub fn tp_all_reduce(&self, x: &mut CudaSlice<f32>, len: usize) -> anyhow::Result<()> {
        match &self.shard {
            Some(s) => s.comm.all_reduce_sum(s.rank, &self.dev, x, len),
            None => Ok(()),
        }
    }

    /// Layer `li`'s expert homes for this GPU (unchanged on one GPU).
    pub fn tp_homes(&self, li: usize, homes: Vec<ExpertHome>) -> Vec<ExpertHome> {
        match &self.shard {
            Some(s) => {
                let owners = s.expert_owner.read().unwrap_or_else(|e| e.into_inner());
                let row = owners.get(li).map_or(&[][..], Vec::as_slice);
                tp_expert_homes(homes, s.rank, row)
            }
            None => homes,
        }
    }

    /// After this GPU swapped `admit` of `layer` in for `evict` (live re-placement, between steps):
    /// every rank of the group now sees `admit` on this GPU and `evict` in DRAM (rank 0's).
    pub fn tp_expert_moved(&self, layer: usize, admit: usize, evict: usize) {
        let Some(s) = &self.shard else { return };
        let mut owners = s.expert_owner.write().unwrap_or_else(|e| e.into_inner());
        if let Some(row) = owners.get_mut(layer) {
            if let Some(o) = row.get_mut(admit) {
                *o = Some(s.rank);
            }
            if let Some(o) = row.get_mut(evict) {
                *o = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ExpertHome::*;

    #[test]
    fn the_group_steps_only_while_its_guard_lives() {
        let g = GroupStep::default();
        assert!(!g.active());
        {
            let _inside = g.enter();
            assert!(g.active());
        }
        assert!(!g.active());
    }

    #[test]
    fn each_expert_is_computed_by_exactly_one_rank() {
        // experts 0, 1 on GPU 0 and 1; 2 and 3 in DRAM (CPU in decode, streamed in a long prompt)
        let owners = [Some(0), Some(1), None, None];
        let homes = |r: usize| {
            vec![
                if r == 0 { Resident } else { Cpu },
                if r == 1 { Resident } else { Cpu },
                Cpu,
                Streamed,
            ]
        };
        let r0 = tp_expert_homes(homes(0), 0, &owners);
        let r1 = tp_expert_homes(homes(1), 1, &owners);
        assert_eq!(r0, vec![Resident, Peer, Cpu, Streamed]);
        assert_eq!(r1, vec![Peer, Resident, Peer, Peer]);
        for e in 0..owners.len() {
            let doers = [r0[e], r1[e]].iter().filter(|h| **h != Peer).count();
            assert_eq!(doers, 1, "expert {e}");
        }
    }
}
