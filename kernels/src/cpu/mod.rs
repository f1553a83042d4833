//! CPU kernels: the grouped-expert FFN of MoE layers ([`moe`]) and what it stands on — feature
//! detection and tiers ([`features`]), the persistent pinned worker pool ([`pool`]), topology via hwloc
//! ([`topology`]), hugepage-backed memory ([`memory`]), CLI options ([`options`]), the dense
//! projections ([`dense`]), the flash-attention tile step over the paged KV cache ([`attention`]), the
//! f32 dot the engine's small reductions use ([`vector`]) and the benchmark ([`bench`](mod@bench)).

pub mod attention;
pub mod backing;
pub mod bench;
pub mod bench_dense;
pub mod bench_step;
pub mod dense;
#[cfg(target_arch = "x86_64")]
mod dense_amx_int;
#[cfg(target_arch = "x86_64")]
mod dense_widen;
pub mod features;
pub mod ggml;
pub mod memory;
pub mod moe;
pub mod options;
pub mod pool;
pub mod topology;
pub mod vector;

pub use backing::PageBacking;
pub use dense::{
    forward_group, AmxIntKernel, DenseCall, DenseError, DenseMatrix, GroupedInput, MakeRow,
};
pub use features::{detected_tier, CpuTier};
pub use ggml::GgmlBlock;
pub use memory::{HugepageMode, PageKind};
pub use options::{CpuMoeOptions, NumaMode, OptionsError};
pub use pool::WorkerPool;
pub use vector::{bf16_to_f32, dot_f32, f16_to_f32, rms_norm_rows};
