//! Model shapes placement sizes against: an explicit `spec.model.shape` (byte counts only), else a
//! well-known checkpoint matched by name, whose `config.json` the shared sizing crate (`moe_sizing`,
//! the daemon's own plan) turns into a full shape.
use std::ops::Deref;

use crate::crd::{ModelShape, ModelSpec};

/// KV bytes per cached value on the GPU (the daemon caches K/V in bf16).
const KV_ELEM_BYTES: u64 = moe_sizing::plan::KV_ELEM_BYTES;

/// The shape placement uses. Dereferences to the byte summary every sizing reads; `detail` is the
/// full shape of a known model, with which the daemon's memory plan is computed.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedShape {
    pub summary: ModelShape,
    pub detail: Option<moe_sizing::ModelShape>,
}

impl Deref for ResolvedShape {
    type Target = ModelShape;
    fn deref(&self) -> &ModelShape {
        &self.summary
    }
}

impl From<ModelShape> for ResolvedShape {
    fn from(summary: ModelShape) -> Self {
        Self {
            summary,
            detail: None,
        }
    }
}

impl ResolvedShape {
    /// A known model's shape, with its byte summary (experts as the checkpoint stores them; dense
    /// weights at bf16; KV as the daemon caches it).
    pub fn known(detail: moe_sizing::ModelShape) -> Self {
        let dense = moe_sizing::dense_bytes(&detail, moe_sizing::DenseDtype::Bf16, false);
        let summary = ModelShape {
            moe_layers: detail.moe_layers() as u32,
            experts_per_layer: detail.experts_per_layer() as u32,
            expert_bytes: detail.checkpoint_expert_bytes(),
            dense_bytes: dense.total(),
            kv_bytes_per_token: Some(detail.kv_bytes_per_token(KV_ELEM_BYTES)),
        };
        Self {
            summary,
            detail: Some(detail),
        }
    }
}

/// The shape placement uses: the spec's own, else the known model whose key appears in the Hugging
/// Face repo id, the PVC/host path, the URL, the served name or the resource name (an `fp8` in one of
/// them selects the FP8 checkpoint's sizes).
pub fn resolve_shape(model: &ModelSpec, resource_name: &str) -> Option<ResolvedShape> {
    if let Some(shape) = &model.shape {
        return Some(shape.clone().into());
    }
    let source = &model.source;
    let names = [
        source.hugging_face.as_ref().map(|h| h.repo.as_str()),
        source.pvc.as_ref().and_then(|p| p.path.as_deref()),
        source.host_path.as_ref().map(|h| h.path.as_str()),
        source.url.as_ref().map(|u| u.url.as_str()),
        model.served_name.as_deref(),
        Some(resource_name),
    ];
    let names: Vec<&str> = names.into_iter().flatten().collect();
    let (_, config) = moe_sizing::known::match_known(names.iter().copied())?;
    // The table's configs are tested to parse; a failure here would be a bug in the table.
    let mut detail = moe_sizing::ModelShape::from_config_json(&config).ok()?;
    // A GGUF keeps its block types on the GPU (the daemon reads them from the file): a file type named
    // in the source (`…-Q4_K_M.gguf`) gives llama-quantize's per-tensor types, so both plan the same bytes.
    if model.weight_format == crate::crd::WeightFormat::Gguf {
        detail.stored = names
            .iter()
            .find_map(|n| moe_sizing::LlamaFileType::from_name(n))
            .and_then(|t| moe_sizing::StoredDense::llama_cpp(t, &detail));
    }
    Some(ResolvedShape::known(detail))
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
        // Published sizes: ~61 GB, ~221 GB with the MTP layer the engine does not load, ~690 GB.
        assert!(
            (58..=64).contains(&gb("Qwen/Qwen3-30B-A3B")),
            "{}",
            gb("Qwen/Qwen3-30B-A3B")
        );
        assert!((200..=230).contains(&gb("zai-org/GLM-4.5-Air")));
        assert!((650..=700).contains(&gb("deepseek-ai/DeepSeek-V3-0324")));
        // An FP8 checkpoint of a bf16 model gets FP8 expert sizes.
        assert!(
            gb("Qwen/Qwen3-30B-A3B-FP8") < 35,
            "{}",
            gb("Qwen/Qwen3-30B-A3B-FP8")
        );
        assert!((40..=46).contains(&gb("PowerInfer/SmallThinker-21BA3B-Instruct")));
    }

    /// A GGUF source naming its file type is sized with llama-quantize's types for it (the daemon reads
    /// the same types from the file); a safetensors source, or a GGUF without a named type, as values.
    #[test]
    fn gguf_sources_are_sized_with_their_file_types() {
        let url = |u: &str, format| ModelSpec {
            source: ModelSource {
                url: Some(crate::crd::UrlSource { url: u.into() }),
                ..Default::default()
            },
            weight_format: format,
            ..hf_model("x")
        };
        let q4km = resolve_shape(
            &url(
                "https://host/SmallThinker-21BA3B-Instruct-Q4_K_M.gguf",
                crate::crd::WeightFormat::Gguf,
            ),
            "st",
        )
        .unwrap();
        let stored = q4km.detail.as_ref().unwrap().stored.clone().unwrap();
        assert_eq!(stored.lm_head, moe_sizing::StoredFormat::Q6K);
        assert_eq!(stored.attention.len(), 52);
        let plain = resolve_shape(
            &url(
                "https://host/SmallThinker-21BA3B-Instruct-Q4_K_M.gguf",
                crate::crd::WeightFormat::Safetensors,
            ),
            "st",
        )
        .unwrap();
        assert!(plain.detail.as_ref().unwrap().stored.is_none());
        let unnamed = resolve_shape(
            &url(
                "https://host/SmallThinker-21BA3B-Instruct.gguf",
                crate::crd::WeightFormat::Gguf,
            ),
            "st",
        )
        .unwrap();
        assert!(unnamed.detail.unwrap().stored.is_none());
        // under int4 the Q4_K_M file's dense weights take more than the values plan counts
        let d = |r: &ResolvedShape| {
            moe_sizing::dense_bytes(
                r.detail.as_ref().unwrap(),
                moe_sizing::DenseDtype::Int4,
                true,
            )
            .total()
        };
        assert!(
            d(&q4km) > d(&plain) * 6 / 5,
            "{} vs {}",
            d(&q4km),
            d(&plain)
        );
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
        let resolved = resolve_shape(&model, "unknown").unwrap();
        assert_eq!(resolved.summary, shape);
        assert!(resolved.detail.is_none());
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
