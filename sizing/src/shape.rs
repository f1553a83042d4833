//! The numbers of a checkpoint that GPU memory depends on, read from its `config.json`.
//!
//! The daemon builds the same [`ModelShape`] from the configuration it actually loaded (its
//! `ModelConfig`), and a daemon test checks that both readings agree for every fixture and every
//! [`crate::known`] model, so the operator sizes with the shapes the engine allocates.
use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attention {
    /// Grouped-query attention (K and V caches of `kv_heads × head_dim` each).
    Gqa {
        heads: u64,
        kv_heads: u64,
        head_dim: u64,
        /// q, k and v projections carry biases (Qwen2, GLM-4.5).
        qkv_bias: bool,
    },
    /// Multi-head latent attention (caches: latent + shared rope key).
    Mla {
        heads: u64,
        q_lora_rank: Option<u64>,
        kv_lora_rank: u64,
        qk_nope_head_dim: u64,
        qk_rope_head_dim: u64,
        v_head_dim: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moe {
    /// Routed experts per MoE layer.
    pub experts: u64,
    pub top_k: u64,
    pub expert_intermediate: u64,
    /// Width of the shared expert(s) of each MoE layer (0: none).
    pub shared_intermediate: u64,
    /// Qwen2-MoE's sigmoid gate on the shared expert (one f32 row of `hidden`).
    pub shared_gate: bool,
    /// How many of the layers are MoE layers.
    pub moe_layers: u64,
}

/// How the checkpoint stores projection weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointFormat {
    Bf16,
    /// E4M3 with one f32 scale per `block × block` tile (DeepSeek-V3, Qwen3-FP8).
    Fp8 {
        block: u64,
    },
}

/// What hybrid-attention models (GLM-5.3-Flash, GLM-5) keep beyond the KV rows of their attention
/// layers: linear-attention layers have no KV rows but a fixed recurrent state per running sequence,
/// and layers with a sparse-attention indexer keep its key rows (f32) per position.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HybridShape {
    /// Linear-attention layers (no KV rows).
    pub linear_layers: u64,
    /// f32 values of one sequence's recurrent state in one linear layer (matrices and convolution tail).
    pub state_floats: u64,
    /// Layers that run their own indexer, and the f32 values of one position's indexer row.
    pub indexer_layers: u64,
    pub indexer_row_floats: u64,
    /// Positions per indexer candidate (the key pool; 1 for per-token keys, 0 without an indexer).
    pub indexer_unit: u64,
    /// f32-sized values per step row of the hybrid step buffers (residual streams, linear-attention
    /// intermediates, indexer projections and selection), score rows not included.
    pub step_row_values: u64,
    /// Heads and head width of the linear-attention layers (their projections replace the attention
    /// shape's in those layers), and the convolution's taps.
    pub linear_heads: u64,
    pub linear_head_dim: u64,
    pub conv_kernel: u64,
    /// f32 weights of one layer's own indexer, and of one layer's hyper-connections (0 without).
    pub indexer_weight_floats: u64,
    pub hyper_weight_floats: u64,
}

impl HybridShape {
    /// Bytes of every running sequence's recurrent state, `seqs` sequences.
    pub fn state_bytes(&self, seqs: u64) -> u64 {
        seqs * self.linear_layers * self.state_floats * 4
    }

    /// Bytes of indexer score rows for `rows` query rows over a context of `positions` positions.
    pub fn score_bytes(&self, rows: u64, positions: u64) -> u64 {
        if self.indexer_unit == 0 {
            return 0;
        }
        rows * (positions / self.indexer_unit) * 4
    }
}

/// Values per f32 scale in an 8-bit KV cache row with heads `head_dim` wide: the largest of 32, 16 and
/// 8 dividing it, else the whole head (the rule of `moe_kernels::cuda::kv_q8::scale_group`, which
/// allocates what this plans; a daemon test keeps the two equal).
pub fn kv_scale_group(head_dim: u64) -> u64 {
    [32, 16, 8]
        .into_iter()
        .find(|g| head_dim.is_multiple_of(*g))
        .unwrap_or(head_dim.max(1))
}

/// Element type of the GPU KV cache (`--kv-cache-dtype`, vLLM's name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    #[default]
    Bf16,
    /// E4M3 with one scale per 32 values of a cached position (vLLM's name).
    Fp8,
    /// int8 with one scale per 32 values of a cached position (llama.cpp's q8_0); the bytes of `Fp8`,
    /// about five times more accurate per value.
    Int8,
}

impl KvCacheDtype {
    pub fn as_str(self) -> &'static str {
        match self {
            KvCacheDtype::Bf16 => "bf16",
            KvCacheDtype::Fp8 => "fp8",
            KvCacheDtype::Int8 => "int8",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    pub hidden: u64,
    pub layers: u64,
    pub vocab: u64,
    pub tied_embeddings: bool,
    pub attention: Attention,
    /// `intermediate_size` of the dense (non-MoE) MLP layers.
    pub dense_intermediate: u64,
    pub moe: Option<Moe>,
    pub checkpoint: CheckpointFormat,
    /// Linear attention and the indexer's rows (hybrid-attention models); `None` for the others.
    pub hybrid: Option<HybridShape>,
    /// How a GGUF file stores the dense projections (the GPU keeps their codes); `None`: values or
    /// FP8 blocks, and any shape read from `config.json` alone.
    pub stored: Option<crate::stored::StoredDense>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("config.json: `{0}` is missing or not a positive integer")]
    Field(&'static str),
    #[error("config.json: architecture `{0}` is not one the engine runs")]
    Architecture(String),
    #[error("config.json: {0}")]
    Invalid(String),
}

fn num(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

fn need(v: &Value, key: &'static str) -> Result<u64, ShapeError> {
    num(v, key).filter(|&n| n > 0).ok_or(ShapeError::Field(key))
}

impl ModelShape {
    /// Reads a Hugging Face `config.json` of an architecture the engine runs.
    pub fn from_config_json(v: &Value) -> Result<Self, ShapeError> {
        // Multimodal checkpoints (GLM-5.3-Flash) nest the text model's fields in `text_config`.
        let text = crate::glm::text_fields(v);
        let v = &text;
        let arch = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or(ShapeError::Field("architectures"))?;
        let hidden = need(v, "hidden_size")?;
        let layers = need(v, "num_hidden_layers")?;
        let heads = need(v, "num_attention_heads")?;
        let smallthinker = arch == "SmallThinkerForCausalLM";
        let glm = match crate::glm::GlmArch::from_name(arch) {
            Some(a) => Some(crate::glm::read(v, a, layers)?),
            None => None,
        };
        let attention = if let Some(g) = &glm {
            g.attention.clone()
        } else if arch == "DeepseekV3ForCausalLM" {
            Attention::Mla {
                heads,
                q_lora_rank: num(v, "q_lora_rank").filter(|&r| r > 0),
                kv_lora_rank: need(v, "kv_lora_rank")?,
                qk_nope_head_dim: need(v, "qk_nope_head_dim")?,
                qk_rope_head_dim: need(v, "qk_rope_head_dim")?,
                v_head_dim: need(v, "v_head_dim")?,
            }
        } else {
            let default_head_dim = if smallthinker { 128 } else { hidden / heads };
            Attention::Gqa {
                heads,
                kv_heads: num(v, "num_key_value_heads").unwrap_or(heads),
                head_dim: num(v, "head_dim").unwrap_or(default_head_dim),
                qkv_bias: match arch {
                    "Qwen2ForCausalLM" | "Qwen2MoeForCausalLM" => true,
                    _ => v
                        .get("attention_bias")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                },
            }
        };
        let moe = match &glm {
            Some(g) => Some(g.moe.clone()),
            None => parse_moe(v, arch, layers)?,
        };
        let checkpoint = match v.get("quantization_config") {
            Some(q) if q.get("quant_method").and_then(Value::as_str) == Some("fp8") => {
                let block = q
                    .get("weight_block_size")
                    .and_then(|b| b.get(0))
                    .and_then(Value::as_u64)
                    .unwrap_or(128);
                CheckpointFormat::Fp8 { block }
            }
            _ => CheckpointFormat::Bf16,
        };
        Ok(Self {
            hidden,
            layers,
            vocab: need(v, "vocab_size")?,
            tied_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(smallthinker),
            attention,
            dense_intermediate: num(v, "intermediate_size").unwrap_or(0),
            moe,
            checkpoint,
            hybrid: glm.and_then(|g| g.hybrid).map(|h| h.shape()),
            stored: None,
        })
    }

    /// Width of the two per-layer caches (K and V, or MLA's latent and rope key).
    pub fn kv_widths(&self) -> (u64, u64) {
        match &self.attention {
            Attention::Gqa {
                kv_heads, head_dim, ..
            } => (kv_heads * head_dim, kv_heads * head_dim),
            Attention::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
                ..
            } => (*kv_lora_rank, *qk_rope_head_dim),
        }
    }

    /// What a sequence's context costs by layer kind at `elem_bytes` per cached K/V value: K and V
    /// (or MLA's latent and rope key) rows of every layer that keeps rows, the indexer's f32 key rows
    /// of the layers running their own indexer, and the linear layers' f32 recurrent state.
    pub fn context_footprint(&self, elem_bytes: u64) -> crate::hybrid::ContextFootprint {
        let (k, v) = self.kv_widths();
        let hy = self.hybrid.clone().unwrap_or_default();
        let linear = hy.linear_layers.min(self.layers);
        crate::hybrid::ContextFootprint {
            kv_per_position: (self.layers - linear) * (k + v) * elem_bytes,
            indexer_per_position: hy.indexer_layers * hy.indexer_row_floats * 4,
            state_per_sequence: hy.state_bytes(1),
        }
    }

    /// KV cache bytes per token of context, all layers, at `elem_bytes` per cached value: K and V (or
    /// MLA's latent and rope key) of every layer that keeps rows, plus the indexer's f32 key rows.
    pub fn kv_bytes_per_token(&self, elem_bytes: u64) -> u64 {
        let f = self.context_footprint(elem_bytes);
        f.kv_per_position + f.indexer_per_position
    }

    /// KV cache bytes per token of context, all layers, with the cache in `dtype`: bf16 values, or
    /// 8-bit codes (E4M3 or int8) plus one f32 scale per [`kv_scale_group`] values of K and of V (MLA's
    /// latent rows, refused for 8-bit caches, count as one group).
    pub fn kv_cache_bytes_per_token(&self, dtype: KvCacheDtype) -> u64 {
        match dtype {
            KvCacheDtype::Bf16 => self.kv_bytes_per_token(2),
            KvCacheDtype::Fp8 | KvCacheDtype::Int8 => {
                let (k, v) = self.kv_widths();
                let scales = match &self.attention {
                    Attention::Gqa { head_dim, .. } => (k + v) / kv_scale_group(*head_dim),
                    Attention::Mla { .. } => 2,
                };
                let (linear, indexer) = self.hybrid.as_ref().map_or((0, 0), |h| {
                    (h.linear_layers, h.indexer_layers * h.indexer_row_floats * 4)
                });
                (self.layers - linear.min(self.layers)) * (k + v + 4 * scales) + indexer
            }
        }
    }

    pub fn moe_layers(&self) -> u64 {
        self.moe.as_ref().map_or(0, |m| m.moe_layers)
    }

    pub fn experts_per_layer(&self) -> u64 {
        self.moe.as_ref().map_or(0, |m| m.experts)
    }

    /// Bytes of one routed expert on the GPU (gate, up, down in bf16).
    pub fn gpu_expert_bytes(&self) -> u64 {
        self.moe
            .as_ref()
            .map_or(0, |m| 3 * self.hidden * m.expert_intermediate * 2)
    }

    /// Bytes of one routed expert as the checkpoint stores it.
    pub fn checkpoint_expert_bytes(&self) -> u64 {
        let Some(m) = &self.moe else { return 0 };
        let (h, i) = (self.hidden, m.expert_intermediate);
        match self.checkpoint {
            CheckpointFormat::Bf16 => 3 * h * i * 2,
            CheckpointFormat::Fp8 { block } => {
                3 * h * i
                    + 4 * (2 * i.div_ceil(block) * h.div_ceil(block)
                        + h.div_ceil(block) * i.div_ceil(block))
            }
        }
    }
}

fn parse_moe(v: &Value, arch: &str, layers: u64) -> Result<Option<Moe>, ShapeError> {
    let top_k = || need(v, "num_experts_per_tok");
    let moe = match arch {
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" | "Qwen3ForCausalLM" => {
            return Ok(None)
        }
        "MixtralForCausalLM" => Moe {
            experts: need(v, "num_local_experts")?,
            top_k: top_k()?,
            expert_intermediate: need(v, "intermediate_size")?,
            shared_intermediate: 0,
            shared_gate: false,
            moe_layers: layers,
        },
        "Qwen2MoeForCausalLM" | "Qwen3MoeForCausalLM" => {
            let experts = num(v, "num_experts")
                .or_else(|| num(v, "num_local_experts"))
                .ok_or(ShapeError::Field("num_experts"))?;
            let step = num(v, "decoder_sparse_step").unwrap_or(1).max(1);
            let dense: Vec<u64> = v
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            let moe_layers = (0..layers)
                .filter(|i| !dense.contains(i) && experts > 0 && (i + 1) % step == 0)
                .count() as u64;
            let qwen2 = arch == "Qwen2MoeForCausalLM";
            Moe {
                experts,
                top_k: top_k()?,
                expert_intermediate: need(v, "moe_intermediate_size")?,
                shared_intermediate: if qwen2 {
                    num(v, "shared_expert_intermediate_size").unwrap_or(0)
                } else {
                    0
                },
                shared_gate: qwen2,
                moe_layers,
            }
        }
        "Glm4MoeForCausalLM" | "DeepseekV3ForCausalLM" => {
            let inter = need(v, "moe_intermediate_size")?;
            let first_dense = num(v, "first_k_dense_replace").unwrap_or(0);
            let freq = num(v, "moe_layer_freq").unwrap_or(1).max(1);
            Moe {
                experts: need(v, "n_routed_experts")?,
                top_k: top_k()?,
                expert_intermediate: inter,
                shared_intermediate: inter * num(v, "n_shared_experts").unwrap_or(0),
                shared_gate: false,
                moe_layers: (0..layers)
                    .filter(|&i| i >= first_dense && i % freq == 0)
                    .count() as u64,
            }
        }
        "SmallThinkerForCausalLM" => Moe {
            experts: need(v, "moe_num_primary_experts")?,
            top_k: need(v, "moe_num_active_primary_experts")?,
            expert_intermediate: need(v, "moe_ffn_hidden_size")?,
            shared_intermediate: 0,
            shared_gate: false,
            moe_layers: layers,
        },
        other => return Err(ShapeError::Architecture(other.to_string())),
    };
    Ok(Some(moe))
}
