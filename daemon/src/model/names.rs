//! Hugging Face tensor names per architecture (what is on disk). Everything else is shared.
use super::config::Arch;

/// Prefix of layer `i`'s MoE block and the names of one expert's three projections.
pub struct MoeNames {
    pub block: String,
    pub router: String,
    pub correction_bias: String,
    pub shared: Option<String>,
    pub shared_gate: Option<String>,
    arch: Arch,
}

impl MoeNames {
    pub fn new(arch: Arch, layer: usize) -> Self {
        Self::in_model(arch, "model", layer)
    }

    /// Names under another text-model prefix (`model.language_model` in multimodal checkpoints).
    pub fn in_model(arch: Arch, prefix: &str, layer: usize) -> Self {
        let (block, shared, shared_gate) = match arch {
            Arch::Mixtral | Arch::SmallThinker => (
                format!("{prefix}.layers.{layer}.block_sparse_moe"),
                None,
                None,
            ),
            Arch::Qwen2Moe => {
                let b = format!("{prefix}.layers.{layer}.mlp");
                (
                    b.clone(),
                    Some(format!("{b}.shared_expert")),
                    Some(format!("{b}.shared_expert_gate.weight")),
                )
            }
            _ => {
                let b = format!("{prefix}.layers.{layer}.mlp");
                (b.clone(), Some(format!("{b}.shared_experts")), None)
            }
        };
        let router = match arch {
            Arch::SmallThinker => format!("{block}.primary_router.weight"),
            _ => format!("{block}.gate.weight"),
        };
        Self {
            router,
            correction_bias: format!("{block}.gate.e_score_correction_bias"),
            block,
            shared,
            shared_gate,
            arch,
        }
    }

    /// (gate, up, down) weight names of expert `e`.
    pub fn expert(&self, e: usize) -> [String; 3] {
        let p = format!("{}.experts.{e}", self.block);
        match self.arch {
            Arch::Mixtral => [
                format!("{p}.w1.weight"),
                format!("{p}.w3.weight"),
                format!("{p}.w2.weight"),
            ],
            Arch::SmallThinker => [
                format!("{p}.gate.weight"),
                format!("{p}.up.weight"),
                format!("{p}.down.weight"),
            ],
            _ => [
                format!("{p}.gate_proj.weight"),
                format!("{p}.up_proj.weight"),
                format!("{p}.down_proj.weight"),
            ],
        }
    }
}

pub fn layer(i: usize) -> String {
    layer_in("model", i)
}

/// Prefix of layer `i` under a text-model prefix.
pub fn layer_in(prefix: &str, i: usize) -> String {
    format!("{prefix}.layers.{i}")
}

/// Tensor names of a layer's sparse-attention indexer (`{layer}.self_attn.indexer.*`, `layer` from
/// [`layer_in`]): `wq_b`, `wk`,
/// `k_norm` (LayerNorm weight and bias), `weights_proj`, and the key-pool parameters of the pooled
/// variant (`index_kpool_compress_ape`, `index_kpool_compress_gate`: plain parameters, no `.weight`).
pub fn indexer(layer: &str) -> String {
    format!("{layer}.self_attn.indexer")
}
