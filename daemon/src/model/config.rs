//! `config.json` → [`ModelConfig`]: one normalised description of every supported architecture.
//!
//! Reads both the classic layout (`rope_theta`, `rope_scaling`, `partial_rotary_factor` at top level) and
//! the newer `rope_parameters` object. Which optional tensors exist (biases, q/k norms) is decided from the
//! checkpoint itself when the layers are built, not from config flags that differ per family.
use super::hybrid::{self, HyperConfig, LinearAttentionConfig, Mixer};
use serde_json::Value;

#[path = "config_glm.rs"]
mod glm;
#[path = "config_limits.rs"]
mod limits;
pub use glm::{IndexerConfig, IndexerLayer, IndexerPooling};

/// Architectures the engine implements (the `architectures[0]` string of config.json).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    Glm4Moe,
    DeepseekV3,
    /// PowerInfer SmallThinker (remote code `modeling_smallthinker.py`): ReGLU experts routed from the
    /// layer input, per-layer sliding-window and RoPE / NoPE layouts.
    SmallThinker,
    /// GLM-5.3-Flash's text model: linear-attention (KDA) and indexed MLA layers, hyper-connections
    /// (`model/hybrid.rs`); the vision tower is not loaded.
    Glm5Next,
    /// GLM-4.7-Flash: DeepSeek-style MLA (interleaved RoPE by default) with GLM-4.5's sigmoid router;
    /// dense / MoE per layer from `mlp_layer_types`.
    Glm4MoeLite,
    /// GLM-5 (`glm_moe_dsa`): MLA with q-LoRA plus the DeepSeek sparse-attention indexer, which picks
    /// `index_topk` earlier positions per query ([`IndexerConfig`]).
    GlmMoeDsa,
}

pub const SUPPORTED_ARCHITECTURES: &[(&str, Arch)] = &[
    ("LlamaForCausalLM", Arch::Llama),
    ("MistralForCausalLM", Arch::Llama),
    ("Qwen2ForCausalLM", Arch::Qwen2),
    ("Qwen3ForCausalLM", Arch::Qwen3),
    ("MixtralForCausalLM", Arch::Mixtral),
    ("Qwen2MoeForCausalLM", Arch::Qwen2Moe),
    ("Qwen3MoeForCausalLM", Arch::Qwen3Moe),
    ("Glm4MoeForCausalLM", Arch::Glm4Moe),
    ("DeepseekV3ForCausalLM", Arch::DeepseekV3),
    ("SmallThinkerForCausalLM", Arch::SmallThinker),
    ("Glm5NextForConditionalGeneration", Arch::Glm5Next),
    ("Glm4MoeLiteForCausalLM", Arch::Glm4MoeLite),
    ("GlmMoeDsaForCausalLM", Arch::GlmMoeDsa),
];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config.json: unknown architecture `{0}`; supported: {1}")]
    UnknownArch(String, String),
    #[error("config.json: missing or invalid field `{0}`")]
    Field(&'static str),
    #[error("config.json: {0}")]
    Invalid(String),
}

/// How position is rotated into q/k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// rotate_half over the two halves of the rotary dims (Llama, Qwen, GLM).
    Neox,
    /// adjacent pairs (x0,x1),(x2,x3)… (DeepSeek MLA with `rope_interleave`).
    Interleaved,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Number of leading head dims that are rotated (head_dim × partial_rotary_factor; MLA: qk_rope_head_dim).
    pub rotary_dim: usize,
    pub style: RopeStyle,
    pub scaling: RopeScaling,
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// eps of the q-LoRA and latent RMSNorms: transformers builds them with the norm class default
    /// (1e-6) in DeepSeek-V3, GLM-4.7-Flash and GLM-5, not with `rms_norm_eps`.
    pub latent_norm_eps: f32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterKind {
    /// softmax over all experts → top-k (Mixtral, Qwen-MoE); `renormalize` = norm_topk_prob.
    Softmax { renormalize: bool },
    /// sigmoid scores; selection on scores + e_score_correction_bias, group-limited (GLM-4.5, DeepSeek-V3);
    /// weights are the unbiased scores, optionally renormalised, times the routed scaling factor.
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
    },
}

/// What the router of an MoE layer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RouterInput {
    /// The FFN input: the post-attention-normalised hidden state (every architecture but one).
    #[default]
    FfnInput,
    /// The layer input, before the attention norm (SmallThinker): routing is known before attention
    /// runs, so the chosen experts can be fetched while it does.
    LayerInput,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub router: RouterKind,
    pub routed_scaling_factor: f32,
    /// Width of the always-on shared expert MLP, if any.
    pub shared_intermediate: Option<usize>,
    /// Qwen2-MoE: shared expert output is scaled by sigmoid(shared_expert_gate · x).
    pub shared_gate: bool,
    pub router_input: RouterInput,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
    /// ReGLU: relu(gate) · up (SmallThinker).
    Relu,
}

/// Position encoding and attended range of one layer's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerAttention {
    /// false: a NoPE layer (q and k are not rotated).
    pub rope: bool,
    /// Sliding window: a query at position p attends to positions p-w+1 ..= p (transformers'
    /// `kv_idx > q_idx - sliding_window`). None: every earlier position.
    pub window: Option<usize>,
}

impl LayerAttention {
    pub const FULL: Self = Self {
        rope: true,
        window: None,
    };

    /// First position a query at `pos` attends to.
    pub fn first_attended(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub arch_name: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub activation: Activation,
    pub rope: RopeConfig,
    pub mla: Option<MlaConfig>,
    pub moe: Option<MoeConfig>,
    /// Per layer: true when its FFN is the MoE block.
    pub moe_layers: Vec<bool>,
    /// Per layer: RoPE or NoPE, full or sliding-window attention.
    pub layer_attention: Vec<LayerAttention>,
    /// Per layer: softmax attention or linear attention (every layer attends but GLM-5.3-Flash's).
    pub mixers: Vec<Mixer>,
    /// Shape of the linear-attention layers, when any layer is one.
    pub linear_attention: Option<LinearAttentionConfig>,
    /// Hyper-connection residual streams (GLM-5.3-Flash); None: one plain residual stream.
    pub hyper: Option<HyperConfig>,
    /// SwiGLU clamp of every MLP and expert: gate ≤ limit, up within ±limit, before the activation.
    pub swiglu_limit: Option<f32>,
    /// The sparse-attention indexer of MLA layers (GLM-5 per token, GLM-5.3-Flash key pools), if the
    /// model has one.
    pub indexer: Option<IndexerConfig>,
}

fn get_usize(v: &Value, key: &'static str) -> Result<usize, ConfigError> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or(ConfigError::Field(key))
}

fn opt_usize(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(Value::as_u64).map(|x| x as usize)
}

fn opt_f64(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

fn opt_bool(v: &Value, key: &str) -> Option<bool> {
    v.get(key).and_then(Value::as_bool)
}

/// `eos_token_id` may be a number or a list.
fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => vec![],
    }
}

impl ModelConfig {
    /// Parses a Hugging Face config.json value.
    pub fn from_json(v: &Value) -> Result<Self, ConfigError> {
        // Multimodal checkpoints nest the text model's fields in `text_config`.
        let mut text = hybrid::text_fields(v);
        if text["architectures"][0] == "Glm5NextForConditionalGeneration" {
            // Its config class overrides `head_dim` with the rotary width (0: NoPE); the engine
            // derives the head width from the MLA fields.
            if let Some(o) = text.as_object_mut() {
                o.remove("head_dim");
            }
        }
        let v = &text;
        limits::check_raw_sizes(v)?;
        let arch_name = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or(ConfigError::Field("architectures"))?
            .to_owned();
        let arch = SUPPORTED_ARCHITECTURES
            .iter()
            .find(|(n, _)| *n == arch_name)
            .map(|(_, a)| *a)
            .ok_or_else(|| {
                let names: Vec<&str> = SUPPORTED_ARCHITECTURES.iter().map(|(n, _)| *n).collect();
                ConfigError::UnknownArch(arch_name.clone(), names.join(", "))
            })?;

        let hidden_size = get_usize(v, "hidden_size")?;
        let num_heads = get_usize(v, "num_attention_heads")?;
        let num_kv_heads = opt_usize(v, "num_key_value_heads").unwrap_or(num_heads);
        let num_layers = get_usize(v, "num_hidden_layers")?;
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(ConfigError::Invalid(format!(
                "num_attention_heads ({num_heads}) must be a positive multiple of num_key_value_heads ({num_kv_heads})"
            )));
        }
        let glm5_next = arch == Arch::Glm5Next;
        let rms_norm_eps =
            opt_f64(v, "rms_norm_eps").unwrap_or(if glm5_next { 1e-5 } else { 1e-6 }) as f32;
        let hybrid = if glm5_next {
            Some(hybrid::parse(v, num_layers)?)
        } else {
            None
        };
        let mla = if glm5_next {
            // Indexed layers: MLA with q-LoRA and no rotary part (NoPE); the config class defaults.
            let rope = opt_usize(v, "qk_rope_head_dim").unwrap_or(0);
            if rope != 0 {
                return Err(ConfigError::Invalid(format!(
                    "qk_rope_head_dim is {rope}; GLM-5.3 indexed layers are NoPE (0)"
                )));
            }
            Some(MlaConfig {
                q_lora_rank: Some(opt_usize(v, "q_lora_rank").unwrap_or(1536)),
                kv_lora_rank: opt_usize(v, "kv_lora_rank").unwrap_or(512),
                qk_nope_head_dim: opt_usize(v, "qk_nope_head_dim").unwrap_or(256),
                qk_rope_head_dim: 0,
                v_head_dim: opt_usize(v, "v_head_dim").unwrap_or(256),
                // GLM-5.3's q-LoRA and latent norms are built with `rms_norm_eps`.
                latent_norm_eps: rms_norm_eps,
            })
        } else if matches!(arch, Arch::DeepseekV3 | Arch::Glm4MoeLite | Arch::GlmMoeDsa) {
            Some(MlaConfig {
                q_lora_rank: opt_usize(v, "q_lora_rank"),
                kv_lora_rank: get_usize(v, "kv_lora_rank")?,
                qk_nope_head_dim: get_usize(v, "qk_nope_head_dim")?,
                qk_rope_head_dim: get_usize(v, "qk_rope_head_dim")?,
                v_head_dim: get_usize(v, "v_head_dim")?,
                latent_norm_eps: 1e-6,
            })
        } else {
            None
        };
        glm::check_mla(v, arch, mla.as_ref())?;
        // SmallThinker's config class defaults (its config.json may leave these out).
        let smallthinker = arch == Arch::SmallThinker;
        let head_dim = match &mla {
            Some(m) => m.qk_nope_head_dim + m.qk_rope_head_dim,
            None if smallthinker => opt_usize(v, "head_dim").unwrap_or(128),
            None => opt_usize(v, "head_dim").unwrap_or(hidden_size / num_heads),
        };
        // SmallThinker has no `hidden_act`: its experts are ReGLU in the model code.
        let default_act = if smallthinker { "relu" } else { "silu" };
        let activation = match v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or(default_act)
        {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_tanh" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            other => {
                return Err(ConfigError::Invalid(format!(
                    "hidden_act `{other}` is not supported"
                )))
            }
        };
        let rope = parse_rope(v, arch, head_dim, mla.as_ref())?;
        let (moe, mut moe_layers) = parse_moe(v, arch, num_layers)?;
        if let Some(h) = &hybrid {
            moe_layers = h.moe_layers.clone();
        }
        let layer_attention = parse_layer_attention(v, arch, num_layers)?;
        let indexer = match &hybrid {
            Some(h) => Some(glm::parse_pooled_indexer(v, &h.mixers)?),
            None => glm::parse_indexer(v, arch, num_layers, mla.as_ref())?,
        };
        let mut eos = token_ids(v.get("eos_token_id"));
        let mut bos = token_ids(v.get("bos_token_id")).first().copied();
        if smallthinker && v.get("eos_token_id").is_none() {
            eos = vec![151643, 151645];
        }
        if smallthinker && v.get("bos_token_id").is_none() {
            bos = Some(151643);
        }
        let cfg = Self {
            arch,
            arch_name,
            vocab_size: get_usize(v, "vocab_size")?,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: opt_usize(v, "intermediate_size").unwrap_or(0),
            rms_norm_eps,
            tie_word_embeddings: opt_bool(v, "tie_word_embeddings").unwrap_or(smallthinker),
            max_position_embeddings: opt_usize(v, "max_position_embeddings").unwrap_or(
                match arch {
                    Arch::SmallThinker => 4096 * 32,
                    Arch::Glm5Next => 1 << 20,
                    Arch::Glm4MoeLite | Arch::GlmMoeDsa => 202752,
                    _ => 4096,
                },
            ),
            bos_token_id: bos,
            eos_token_ids: eos,
            activation,
            rope,
            mla,
            moe,
            moe_layers,
            layer_attention,
            mixers: hybrid
                .as_ref()
                .map_or_else(|| vec![Mixer::Attention; num_layers], |h| h.mixers.clone()),
            linear_attention: hybrid
                .as_ref()
                .filter(|h| h.mixers.contains(&Mixer::Linear))
                .map(|h| h.linear),
            hyper: hybrid.as_ref().map(|h| h.hyper),
            swiglu_limit: hybrid.as_ref().and_then(|h| h.swiglu_limit),
            indexer,
        };
        limits::check_parsed(&cfg)?;
        Ok(cfg)
    }

    /// Reads and parses `dir/config.json`, then merges `generation_config.json`'s eos ids if present.
    pub fn from_dir(dir: &std::path::Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let text = crate::weights::read_text_file(&path, crate::weights::JSON_FILE_LIMIT)
            .map_err(|e| ConfigError::Invalid(format!("cannot read {}: {e}", path.display())))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            ConfigError::Invalid(format!("{} is not valid JSON: {e}", path.display()))
        })?;
        let mut cfg = Self::from_json(&v)?;
        let generation = dir.join("generation_config.json");
        if let Ok(text) =
            crate::weights::read_text_file(&generation, crate::weights::JSON_FILE_LIMIT)
        {
            if let Ok(g) = serde_json::from_str::<Value>(&text) {
                for id in token_ids(g.get("eos_token_id")) {
                    if !cfg.eos_token_ids.contains(&id) {
                        cfg.eos_token_ids.push(id);
                    }
                }
            }
        }
        Ok(cfg)
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe_layers.get(layer).copied().unwrap_or(false)
    }

    /// Softmax scale of attention: 1/sqrt(qk head dim), times mscale² for YaRN with `mscale_all_dim`
    /// (DeepSeek-V3's `yarn_apply_mscale`).
    pub fn attention_scale(&self) -> f32 {
        let mut s = (self.head_dim as f64).powf(-0.5);
        if self.mla.is_some() {
            if let RopeScaling::Yarn {
                factor,
                mscale_all_dim: Some(m),
                ..
            } = self.rope.scaling
            {
                if m != 0.0 {
                    let ms = yarn_get_mscale(factor, m);
                    s *= ms * ms;
                }
            }
        }
        s as f32
    }
}

#[path = "config_rope.rs"]
mod rope;
pub use rope::yarn_get_mscale;
use rope::{parse_layer_attention, parse_rope};
#[path = "config_moe.rs"]
mod moe;
use moe::parse_moe;

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
