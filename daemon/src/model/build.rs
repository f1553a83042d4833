//! Builds a [`Model`] from a [`TensorSource`], checking every tensor's shape against the config so a
//! mismatched checkpoint fails at load with the tensor's name, never later in a kernel.
use super::config::ModelConfig;
use super::names::{layer_in, MoeNames};
use super::*;
use crate::engine::linear::Linear;
use crate::weights::{HostTensor, TensorSource, WeightError};
use rayon::prelude::*;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error("tensor `{name}`: shape {found:?}, expected {expected:?} from config.json")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("unsupported: {0}")]
    Unsupported(String),
}

pub(super) struct Loader<'a> {
    pub(super) src: &'a dyn TensorSource,
}

impl Loader<'_> {
    pub(super) fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor, BuildError> {
        let t = self.src.load(name)?;
        if t.shape != shape {
            return Err(BuildError::Shape {
                name: name.to_owned(),
                expected: shape.to_vec(),
                found: t.shape,
            });
        }
        Ok(t)
    }

    pub(super) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, BuildError> {
        Ok(self.tensor(name, &[len])?.to_f32())
    }

    /// `prefix.weight` `[out, in]` and `prefix.bias` `[out]` if the checkpoint has one.
    pub(super) fn linear(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<Linear, BuildError> {
        let w = self.tensor(&format!("{prefix}.weight"), &[out, inp])?;
        let bias_name = format!("{prefix}.bias");
        let bias = if self.src.contains(&bias_name) {
            Some(self.vector(&bias_name, out)?)
        } else {
            None
        };
        Ok(Linear::new(w, bias))
    }

    fn opt_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>, BuildError> {
        if self.src.contains(name) {
            Ok(Some(self.vector(name, len)?))
        } else {
            Ok(None)
        }
    }

    fn mlp(&self, prefix: &str, hidden: usize, inter: usize) -> Result<Mlp, BuildError> {
        Ok(Mlp {
            gate: self.linear(&format!("{prefix}.gate_proj"), inter, hidden)?,
            up: self.linear(&format!("{prefix}.up_proj"), inter, hidden)?,
            down: self.linear(&format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }
}

/// Loads every tensor the config calls for. Layers load in parallel.
pub fn build_model(cfg: ModelConfig, src: &dyn TensorSource) -> Result<Model, BuildError> {
    let ld = Loader { src };
    let h = cfg.hidden_size;
    let prefix = text_prefix(src);
    if cfg.arch == super::Arch::Glm5Next {
        tracing::info!(
            "text model only: the vision tower (model.visual.*) and the MTP layer are not loaded"
        );
    }
    let embed = Linear::new(
        ld.tensor(
            &format!("{prefix}.embed_tokens.weight"),
            &[cfg.vocab_size, h],
        )?,
        None,
    );
    // Tied as transformers ties: the table serves as lm_head unless the checkpoint holds an lm_head of
    // its own; a name that reads the table itself (a GGUF without `output.weight`) is not one, so
    // the table is held once.
    let own_head = src.contains("lm_head.weight")
        && !src.same_tensor("lm_head.weight", &format!("{prefix}.embed_tokens.weight"));
    let lm_head = if cfg.tie_word_embeddings && !own_head {
        None
    } else {
        Some(ld.linear("lm_head", cfg.vocab_size, h)?)
    };
    let final_norm = ld.vector(&format!("{prefix}.norm.weight"), h)?;
    let layers = (0..cfg.num_layers)
        .into_par_iter()
        .map(|i| build_layer(&ld, &cfg, prefix, i))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Model {
        config: cfg,
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

/// Where the text model's tensors live: `model.language_model.*` in multimodal checkpoints (GLM-5.3-Flash
/// as transformers saves it), `model.*` everywhere else.
fn text_prefix(src: &dyn TensorSource) -> &'static str {
    if !src.contains("model.embed_tokens.weight")
        && src.contains("model.language_model.embed_tokens.weight")
    {
        "model.language_model"
    } else {
        "model"
    }
}

/// Layer `i`'s sparse-attention indexer (tensors under layer prefix `p`), if the config gives the model
/// one.
fn build_indexer(
    ld: &Loader,
    cfg: &ModelConfig,
    p: &str,
    i: usize,
    m: &super::config::MlaConfig,
) -> Result<Option<SparseAttention>, BuildError> {
    use super::config::{IndexerLayer, IndexerPooling};
    use crate::engine::indexer::{IndexerWeights, KeyPoolWeights};
    let Some(ix) = &cfg.indexer else {
        return Ok(None);
    };
    match ix.layers.get(i) {
        Some(IndexerLayer::Own) => {}
        Some(IndexerLayer::Shared) => return Ok(Some(SparseAttention::Shared)),
        None => return Ok(None),
    }
    let Some(rank) = m.q_lora_rank else {
        return Err(BuildError::Unsupported(
            "a sparse-attention indexer without q-LoRA".into(),
        ));
    };
    let p = super::names::indexer(p);
    let (h, d) = (cfg.hidden_size, ix.head_dim);
    let pool = match ix.pooling {
        IndexerPooling::PerToken => None,
        IndexerPooling::KeyPool { pool } => Some(KeyPoolWeights {
            ape: ld
                .tensor(&format!("{p}.index_kpool_compress_ape"), &[pool, d])?
                .to_f32(),
            gate: Linear::new(
                ld.tensor(&format!("{p}.index_kpool_compress_gate"), &[d, h])?,
                None,
            ),
        }),
    };
    Ok(Some(SparseAttention::Own(Box::new(IndexerWeights {
        wq_b: ld.linear(&format!("{p}.wq_b"), ix.n_heads * d, rank)?,
        wk: ld.linear(&format!("{p}.wk"), d, h)?,
        k_norm_weight: ld.vector(&format!("{p}.k_norm.weight"), d)?,
        k_norm_bias: ld.vector(&format!("{p}.k_norm.bias"), d)?,
        weights_proj: ld.linear(&format!("{p}.weights_proj"), ix.n_heads, h)?,
        pool,
    }))))
}

fn build_layer(
    ld: &Loader,
    cfg: &ModelConfig,
    prefix: &str,
    i: usize,
) -> Result<Layer, BuildError> {
    let p = layer_in(prefix, i);
    let h = cfg.hidden_size;
    let linear = cfg.mixers.get(i) == Some(&super::hybrid::Mixer::Linear);
    let attn = match &cfg.mla {
        _ if linear => Attention::Linear(super::build_hybrid::linear_attention(ld, cfg, &p)?),
        None => {
            let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
            let a = format!("{p}.self_attn");
            Attention::Gqa(GqaAttention {
                q: ld.linear(&format!("{a}.q_proj"), nh * hd, h)?,
                k: ld.linear(&format!("{a}.k_proj"), nkv * hd, h)?,
                v: ld.linear(&format!("{a}.v_proj"), nkv * hd, h)?,
                o: ld.linear(&format!("{a}.o_proj"), h, nh * hd)?,
                q_norm: ld.opt_vector(&format!("{a}.q_norm.weight"), hd)?,
                k_norm: ld.opt_vector(&format!("{a}.k_norm.weight"), hd)?,
            })
        }
        Some(m) => {
            let a = format!("{p}.self_attn");
            let nh = cfg.num_heads;
            let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
            let q = match m.q_lora_rank {
                None => MlaQuery::Direct(ld.linear(&format!("{a}.q_proj"), nh * qk, h)?),
                Some(r) => MlaQuery::LowRank {
                    a: ld.linear(&format!("{a}.q_a_proj"), r, h)?,
                    norm: ld.vector(&format!("{a}.q_a_layernorm.weight"), r)?,
                    b: ld.linear(&format!("{a}.q_b_proj"), nh * qk, r)?,
                },
            };
            let kv_b = ld.linear(
                &format!("{a}.kv_b_proj"),
                nh * (m.qk_nope_head_dim + m.v_head_dim),
                m.kv_lora_rank,
            )?;
            if kv_b.bias.is_some() {
                return Err(BuildError::Unsupported(format!("{a}.kv_b_proj.bias")));
            }
            Attention::Mla(MlaAttention {
                q,
                kv_a: ld.linear(
                    &format!("{a}.kv_a_proj_with_mqa"),
                    m.kv_lora_rank + m.qk_rope_head_dim,
                    h,
                )?,
                kv_a_norm: ld.vector(&format!("{a}.kv_a_layernorm.weight"), m.kv_lora_rank)?,
                kv_b: kv_b.to_f32(),
                o: ld.linear(&format!("{a}.o_proj"), h, nh * m.v_head_dim)?,
                indexer: build_indexer(ld, cfg, &p, i, m)?,
            })
        }
    };
    let ffn = match (&cfg.moe, cfg.is_moe_layer(i)) {
        (Some(moe), true) => {
            let n = MoeNames::in_model(cfg.arch, prefix, i);
            let e = moe.num_experts;
            let router = ld.tensor(&n.router, &[e, h])?.to_f32();
            let correction_bias = ld.opt_vector(&n.correction_bias, e)?;
            let experts = (0..e)
                .map(|x| {
                    let [g, u, d] = n.expert(x);
                    let strip = |s: &str| s.trim_end_matches(".weight").to_owned();
                    let inter = moe.expert_intermediate;
                    Ok(Some(Mlp {
                        gate: ld.linear(&strip(&g), inter, h)?,
                        up: ld.linear(&strip(&u), inter, h)?,
                        down: ld.linear(&strip(&d), h, inter)?,
                    }))
                })
                .collect::<Result<Vec<_>, BuildError>>()?;
            let shared = match (&n.shared, moe.shared_intermediate) {
                (Some(prefix), Some(w)) => Some(ld.mlp(prefix, h, w)?),
                _ => None,
            };
            let shared_gate = match (&n.shared_gate, moe.shared_gate && shared.is_some()) {
                (Some(name), true) => Some(ld.tensor(name, &[1, h])?.to_f32()),
                _ => None,
            };
            Ffn::Moe(MoeBlock {
                router,
                correction_bias,
                experts,
                shared,
                shared_gate,
                cpu_set: None,
            })
        }
        _ => Ffn::Dense(ld.mlp(&format!("{p}.mlp"), h, cfg.intermediate_size)?),
    };
    Ok(Layer {
        attn_norm: ld.vector(&format!("{p}.input_layernorm.weight"), h)?,
        attn,
        ffn_norm: ld.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
        ffn,
        hyper: match &cfg.hyper {
            Some(hc) => Some(super::build_hybrid::layer_hyper(ld, cfg, hc, &p)?),
            None => None,
        },
    })
}
