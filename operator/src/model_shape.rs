//! Model shapes placement sizes against: an explicit `spec.model.shape`, else a small built-in table
//! of well-known MoE checkpoints (numbers from their `config.json`, bytes as published on the Hub).

use crate::crd::{ModelShape, ModelSpec};

/// A well-known checkpoint, matched case-insensitively against the repo id or served name.
struct KnownModel {
    key: &'static str,
    shape: ModelShape,
}

const MIB: u64 = 1024 * 1024;

fn known_models() -> [KnownModel; 3] {
    [
        // Qwen3-30B-A3B (bf16): 48 MoE layers, 128 experts, hidden 2048, moe_intermediate 768,
        // 4 KV heads x 128 dims. Expert = 3 x 2048 x 768 x 2 bytes.
        KnownModel {
            key: "qwen3-30b-a3b",
            shape: ModelShape {
                moe_layers: 48,
                experts_per_layer: 128,
                expert_bytes: 3 * 2048 * 768 * 2,
                dense_bytes: 3_100 * MIB,
                kv_bytes_per_token: Some(2 * 48 * 4 * 128 * 2),
            },
        },
        // GLM-4.5-Air (bf16): 46 layers of which 45 MoE, 128 routed + 1 shared expert, hidden 4096,
        // moe_intermediate 1408, 8 KV heads x 128 dims.
        KnownModel {
            key: "glm-4.5-air",
            shape: ModelShape {
                moe_layers: 45,
                experts_per_layer: 128,
                expert_bytes: 3 * 4096 * 1408 * 2,
                dense_bytes: 12_000 * MIB,
                kv_bytes_per_token: Some(2 * 46 * 8 * 128 * 2),
            },
        },
        // DeepSeek-V3 (fp8 block-quantised): 61 layers of which 58 MoE, 256 routed experts,
        // hidden 7168, moe_intermediate 2048; MLA cache of 512 + 64 values per layer.
        KnownModel {
            key: "deepseek-v3",
            shape: ModelShape {
                moe_layers: 58,
                experts_per_layer: 256,
                expert_bytes: 3 * 7168 * 2048 + 3 * 56 * 16 * 4,
                dense_bytes: 17_000 * MIB,
                kv_bytes_per_token: Some(61 * (512 + 64) * 2),
            },
        },
    ]
}

/// The shape placement uses: the spec's own, else the built-in entry whose key appears in the
/// Hugging Face repo id, the PVC/host path, or the served name.
pub fn resolve_shape(model: &ModelSpec, resource_name: &str) -> Option<ModelShape> {
    if let Some(shape) = &model.shape {
        return Some(shape.clone());
    }
    let source = &model.source;
    let haystacks = [
        source.hugging_face.as_ref().map(|h| h.repo.as_str()),
        source.pvc.as_ref().and_then(|p| p.path.as_deref()),
        source.host_path.as_ref().map(|h| h.path.as_str()),
        source.url.as_ref().map(|u| u.url.as_str()),
        model.served_name.as_deref(),
        Some(resource_name),
    ];
    let haystacks: Vec<String> = haystacks
        .iter()
        .flatten()
        .map(|s| s.to_lowercase())
        .collect();
    known_models()
        .into_iter()
        .find(|known| haystacks.iter().any(|h| h.contains(known.key)))
        .map(|known| known.shape)
}

impl ModelShape {
    pub fn expert_bytes_total(&self) -> u64 {
        self.moe_layers as u64 * self.experts_per_layer as u64 * self.expert_bytes
    }

    pub fn checkpoint_bytes(&self) -> u64 {
        self.expert_bytes_total() + self.dense_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{HuggingFaceSource, ModelSource, PvcSource};

    fn hf_model(repo: &str) -> ModelSpec {
        ModelSpec {
            source: ModelSource {
                hugging_face: Some(HuggingFaceSource {
                    repo: repo.into(),
                    revision: None,
                    token_secret: None,
                }),
                ..Default::default()
            },
            served_name: None,
            weight_format: Default::default(),
            shape: None,
            cache: None,
        }
    }

    #[test]
    fn known_checkpoints_have_plausible_sizes() {
        let gb = |repo: &str| {
            resolve_shape(&hf_model(repo), "x")
                .unwrap()
                .checkpoint_bytes()
                / 1_000_000_000
        };
        // Published sizes: ~61 GB, ~221 GB, ~690 GB.
        assert!(
            (58..=64).contains(&gb("Qwen/Qwen3-30B-A3B")),
            "{}",
            gb("Qwen/Qwen3-30B-A3B")
        );
        assert!((200..=230).contains(&gb("zai-org/GLM-4.5-Air")));
        assert!((650..=700).contains(&gb("deepseek-ai/DeepSeek-V3-0324")));
    }

    #[test]
    fn explicit_shape_wins_and_unknown_models_have_none() {
        let mut model = hf_model("someone/unknown-moe");
        assert_eq!(resolve_shape(&model, "unknown"), None);
        let shape = ModelShape {
            moe_layers: 2,
            experts_per_layer: 4,
            expert_bytes: 10,
            dense_bytes: 5,
            kv_bytes_per_token: None,
        };
        model.shape = Some(shape.clone());
        assert_eq!(resolve_shape(&model, "unknown"), Some(shape));
    }

    #[test]
    fn matches_pvc_path_and_resource_name() {
        let mut model = hf_model("x");
        model.source = ModelSource {
            pvc: Some(PvcSource {
                claim_name: "models".into(),
                path: Some("/models/GLM-4.5-Air".into()),
            }),
            ..Default::default()
        };
        assert_eq!(resolve_shape(&model, "chat").unwrap().moe_layers, 45);
        model.source.pvc.as_mut().unwrap().path = None;
        assert_eq!(
            resolve_shape(&model, "qwen3-30b-a3b").unwrap().moe_layers,
            48
        );
    }
}
