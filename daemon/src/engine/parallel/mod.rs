//! Tensor parallelism over the GPUs of one node (`--tensor-parallel N`), driven from one process:
//! attention heads and dense / shared-expert projections split across the GPUs with two all-reduces
//! per layer, lm_head split by vocabulary, GPU-resident routed experts spread whole over the GPUs
//! (expert parallel), and one CPU expert pool serving the DRAM experts for all of them with one
//! hand-off per layer (on rank 0). See docs/MULTI-GPU.md.
//!
//! Files: `plan` (the pure sharding plan), `shard` (slicing the host weights by it), `comm` (NCCL and
//! the one-GPU loopback all-reduce), `rank` (a GPU's share and the step's few tensor-parallel
//! points), `group` (a step over all ranks), `setup` (bring-up).
pub mod comm;
pub mod group;
pub mod plan;
pub mod probe;
pub mod rank;
pub mod setup;
pub mod shard;

pub use comm::CommKind;
pub use group::TpGroup;
pub use plan::{ShardError, ShardPlan};
pub use rank::{RankCtx, ShardSummary};
pub use setup::TensorParallel;
