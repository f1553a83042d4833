//! One sizing model for the daemon and the operator: `config.json` → [`ModelShape`] → [`MemoryPlan`].
//!
//! The daemon plans its GPU memory with [`choose`] at start (and prints the plan); the operator calls
//! the same function with a node's GPU memory to decide whether the node qualifies and how many
//! experts per layer, which dense dtype and where the embeddings go, then passes those choices to
//! the daemon as flags, so both plans are the same plan. No heavy dependencies: serde_json only.
pub mod glm;
pub mod hybrid;
pub mod known;
pub mod parallel;
pub mod plan;
pub mod shape;
pub mod stored;
pub mod weights;

pub use hybrid::{ContextFootprint, HybridLayers, IndexerDims, IndexerKeys, LayerKind, LinearDims};
pub use plan::{
    choose, choose_devices, gpu_experts_total, plan_with, DenseChoice, EmbeddingChoice,
    ExpertsChoice, KvRequest, LayerPins, MemoryPlan, PlanError, PlanInputs, PlanItem,
    PrefillAttention,
};
pub use shape::{
    kv_scale_group, Attention, CheckpointFormat, HybridShape, KvCacheDtype, ModelShape, Moe,
    ShapeError,
};
pub use stored::{GpuLayout, LlamaFileType, StoredDense, StoredFormat};
pub use weights::{dense_bytes, DenseBytes, DenseDtype};

/// Parses a byte size: a plain number of bytes or a number with a binary (KiB, MiB, GiB, TiB;
/// also Ki, Mi, Gi, Ti) or decimal (KB, MB, GB, TB) unit: `24GiB`, `16Gi`, `25769803776`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "Ki" => 1 << 10,
        "MiB" | "Mi" => 1 << 20,
        "GiB" | "Gi" => 1 << 30,
        "TiB" | "Ti" => 1 << 40,
        "KB" | "K" => 1_000,
        "MB" | "M" => 1_000_000,
        "GB" | "G" => 1_000_000_000,
        "TB" | "T" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "`{text}`: unknown unit `{other}` (use bytes or KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ))
        }
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a byte size such as 24GiB"))?;
    let bytes = value * mult as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("`{text}`: out of range"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod stored_tests;
#[cfg(test)]
mod tests;
