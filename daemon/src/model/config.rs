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

pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

fn parse_rope(
    v: &Value,
    arch: Arch,
    head_dim: usize,
    mla: Option<&MlaConfig>,
) -> Result<RopeConfig, ConfigError> {
    // Newer form: everything inside `rope_parameters`; classic: top-level theta + `rope_scaling`.
    let params = v.get("rope_parameters").filter(|p| p.is_object());
    let scaling_obj = params.or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
    let theta = params
        .and_then(|p| opt_f64(p, "rope_theta"))
        .or_else(|| opt_f64(v, "rope_theta"))
        .unwrap_or(if arch == Arch::SmallThinker {
            1e6
        } else {
            10000.0
        });
    let partial = params
        .and_then(|p| opt_f64(p, "partial_rotary_factor"))
        .or_else(|| opt_f64(v, "partial_rotary_factor"))
        .unwrap_or(1.0);
    let rotary_dim = match mla {
        Some(m) => m.qk_rope_head_dim,
        None => (head_dim as f64 * partial) as usize,
    };
    let interleave = match arch {
        Arch::DeepseekV3 | Arch::Glm4MoeLite => opt_bool(v, "rope_interleave").unwrap_or(true),
        // glm_moe_dsa's attention and indexer always rotate interleaved pairs (no `rope_interleave`).
        Arch::GlmMoeDsa => true,
        _ => false,
    };
    let style = if interleave {
        RopeStyle::Interleaved
    } else {
        RopeStyle::Neox
    };
    let max_pos = opt_f64(v, "max_position_embeddings").unwrap_or(4096.0);
    let scaling = match scaling_obj {
        None => RopeScaling::None,
        Some(s) => {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            let factor = opt_f64(s, "factor");
            let need_factor = || factor.ok_or(ConfigError::Field("rope_scaling.factor"));
            match kind {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear {
                    factor: need_factor()?,
                },
                "llama3" => RopeScaling::Llama3 {
                    factor: need_factor()?,
                    low_freq_factor: opt_f64(s, "low_freq_factor").unwrap_or(1.0),
                    high_freq_factor: opt_f64(s, "high_freq_factor").unwrap_or(4.0),
                    original_max_position_embeddings: opt_f64(
                        s,
                        "original_max_position_embeddings",
                    )
                    .ok_or(ConfigError::Field(
                        "rope_scaling.original_max_position_embeddings",
                    ))?,
                },
                "yarn" => {
                    let orig = opt_f64(s, "original_max_position_embeddings").unwrap_or(max_pos);
                    RopeScaling::Yarn {
                        factor: factor.unwrap_or(max_pos / orig),
                        original_max_position_embeddings: orig,
                        beta_fast: opt_f64(s, "beta_fast")
                            .filter(|x| *x != 0.0)
                            .unwrap_or(32.0),
                        beta_slow: opt_f64(s, "beta_slow").filter(|x| *x != 0.0).unwrap_or(1.0),
                        mscale: opt_f64(s, "mscale"),
                        mscale_all_dim: opt_f64(s, "mscale_all_dim"),
                        attention_factor: opt_f64(s, "attention_factor"),
                        truncate: opt_bool(s, "truncate").unwrap_or(true),
                    }
                }
                other => {
                    return Err(ConfigError::Invalid(format!(
                        "rope type `{other}` is not supported (default, linear, llama3, yarn)"
                    )))
                }
            }
        }
    };
    // GLM-5.3's MLA has no rotary part at all (rotary_dim 0).
    let nope_allowed = arch == Arch::Glm5Next && rotary_dim == 0;
    if !nope_allowed && (rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim) {
        return Err(ConfigError::Invalid(format!(
            "rotary dimension {rotary_dim} must be even and within head_dim {head_dim}"
        )));
    }
    Ok(RopeConfig {
        theta,
        rotary_dim,
        style,
        scaling,
    })
}

/// Per-layer RoPE / NoPE and sliding-window layout (SmallThinker's `rope_layout`,
/// `sliding_window_layout`: one 0 or 1 per layer; `sliding_window_size`). Other architectures: every
/// layer rotates and attends to every earlier position. llama.cpp's SMALLTHINKER loader does not read the
/// layouts (it fixes a 4096 window on three layers of every four and NoPE on the fourth whenever a window
/// is present); the model repository's file reads them per layer, and it decides here.
fn parse_layer_attention(
    v: &Value,
    arch: Arch,
    num_layers: usize,
) -> Result<Vec<LayerAttention>, ConfigError> {
    if arch == Arch::Glm5Next {
        // Its indexed layers are NoPE MLA (linear-attention layers do not read a layout).
        return Ok(vec![
            LayerAttention {
                rope: false,
                window: None
            };
            num_layers
        ]);
    }
    if arch != Arch::SmallThinker {
        return Ok(vec![LayerAttention::FULL; num_layers]);
    }
    let layout = |key: &'static str, absent: bool| -> Result<Vec<bool>, ConfigError> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(vec![absent; num_layers]),
            Some(Value::Array(a)) if a.len() == num_layers => a
                .iter()
                .map(|x| match x.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(ConfigError::Invalid(format!(
                        "`{key}` holds {x}; each entry must be 0 or 1"
                    ))),
                })
                .collect(),
            Some(_) => Err(ConfigError::Invalid(format!(
                "`{key}` must be a list of {num_layers} entries (one per layer)"
            ))),
        }
    };
    let rope = layout("rope_layout", true)?;
    let sliding = layout("sliding_window_layout", false)?;
    let size = opt_usize(v, "sliding_window_size").unwrap_or(4096);
    if size == 0 && sliding.iter().any(|&s| s) {
        return Err(ConfigError::Invalid(
            "sliding_window_size must be positive when sliding_window_layout marks a layer".into(),
        ));
    }
    Ok(rope
        .into_iter()
        .zip(sliding)
        .map(|(rope, sliding)| LayerAttention {
            rope,
            window: sliding.then_some(size),
        })
        .collect())
}

fn parse_moe(
    v: &Value,
    arch: Arch,
    num_layers: usize,
) -> Result<(Option<MoeConfig>, Vec<bool>), ConfigError> {
    let norm = opt_bool(v, "norm_topk_prob");
    let top_k = opt_usize(v, "num_experts_per_tok");
    let (moe, layers): (MoeConfig, Vec<bool>) = match arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => return Ok((None, vec![false; num_layers])),
        Arch::Mixtral => (
            MoeConfig {
                num_experts: get_usize(v, "num_local_experts")?,
                top_k: top_k.ok_or(ConfigError::Field("num_experts_per_tok"))?,
                expert_intermediate: get_usize(v, "intermediate_size")?,
                router: RouterKind::Softmax { renormalize: true },
                routed_scaling_factor: 1.0,
                shared_intermediate: None,
                shared_gate: false,
                router_input: RouterInput::FfnInput,
            },
            vec![true; num_layers],
        ),
        Arch::Qwen2Moe | Arch::Qwen3Moe => {
            let num_experts = opt_usize(v, "num_experts")
                .or_else(|| opt_usize(v, "num_local_experts"))
                .ok_or(ConfigError::Field("num_experts"))?;
            let step = opt_usize(v, "decoder_sparse_step").unwrap_or(1).max(1);
            let dense: Vec<usize> = v
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64())
                        .map(|x| x as usize)
                        .collect()
                })
                .unwrap_or_default();
            let layers = (0..num_layers)
                .map(|i| !dense.contains(&i) && num_experts > 0 && (i + 1) % step == 0)
                .collect();
            let qwen2 = arch == Arch::Qwen2Moe;
            (
                MoeConfig {
                    num_experts,
                    top_k: top_k.ok_or(ConfigError::Field("num_experts_per_tok"))?,
                    expert_intermediate: get_usize(v, "moe_intermediate_size")?,
                    router: RouterKind::Softmax {
                        renormalize: norm.unwrap_or(!qwen2),
                    },
                    routed_scaling_factor: 1.0,
                    shared_intermediate: if qwen2 {
                        opt_usize(v, "shared_expert_intermediate_size").filter(|&w| w > 0)
                    } else {
                        None
                    },
                    shared_gate: qwen2,
                    router_input: RouterInput::FfnInput,
                },
                layers,
            )
        }
        Arch::Glm4Moe | Arch::DeepseekV3 | Arch::Glm4MoeLite | Arch::GlmMoeDsa | Arch::Glm5Next => {
            let num_experts = get_usize(v, "n_routed_experts")?;
            let inter = get_usize(v, "moe_intermediate_size")?;
            let first_dense = opt_usize(v, "first_k_dense_replace").unwrap_or(0);
            let freq = opt_usize(v, "moe_layer_freq").unwrap_or(1).max(1);
            let n_group = opt_usize(v, "n_group").unwrap_or(1).max(1);
            let topk_group = opt_usize(v, "topk_group").unwrap_or(1).max(1);
            if num_experts % n_group != 0 || topk_group > n_group {
                return Err(ConfigError::Invalid(format!(
                    "n_routed_experts {num_experts} must split into n_group {n_group} groups with topk_group {topk_group} <= n_group"
                )));
            }
            let shared = opt_usize(v, "n_shared_experts").unwrap_or(0);
            let layers = match glm::mlp_layer_types(v, arch, num_layers)? {
                Some(sparse) => sparse,
                None => (0..num_layers)
                    .map(|i| i >= first_dense && i % freq == 0)
                    .collect(),
            };
            (
                MoeConfig {
                    num_experts,
                    top_k: top_k.ok_or(ConfigError::Field("num_experts_per_tok"))?,
                    expert_intermediate: inter,
                    router: RouterKind::SigmoidGrouped {
                        n_group,
                        topk_group,
                        renormalize: norm.unwrap_or(true),
                    },
                    routed_scaling_factor: opt_f64(v, "routed_scaling_factor")
                        .unwrap_or(if arch == Arch::Glm5Next { 2.5 } else { 1.0 })
                        as f32,
                    shared_intermediate: (shared > 0).then_some(inter * shared),
                    shared_gate: false,
                    router_input: RouterInput::FfnInput,
                },
                layers,
            )
        }
        Arch::SmallThinker => {
            // The model file takes the top-k of the raw router logits, then either a softmax over those
            // k (`moe_primary_router_apply_softmax`) or their sigmoids divided by their sum. The first
            // equals softmax over all experts → top-k → renormalise (softmax is monotonic and its
            // normaliser cancels); the second equals sigmoid scores → top-k → renormalise with one
            // group and no correction bias. `norm_topk_prob`, present in some of its configs, is not
            // read by the model file and is ignored here too.
            let softmax = opt_bool(v, "moe_primary_router_apply_softmax").unwrap_or(false);
            (
                MoeConfig {
                    num_experts: get_usize(v, "moe_num_primary_experts")?,
                    top_k: get_usize(v, "moe_num_active_primary_experts")?,
                    expert_intermediate: get_usize(v, "moe_ffn_hidden_size")?,
                    router: if softmax {
                        RouterKind::Softmax { renormalize: true }
                    } else {
                        RouterKind::SigmoidGrouped {
                            n_group: 1,
                            topk_group: 1,
                            renormalize: true,
                        }
                    },
                    routed_scaling_factor: 1.0,
                    shared_intermediate: None,
                    shared_gate: false,
                    // The model repository's `SmallThinkerDecoderLayer` always routes from the layer
                    // input (llama.cpp, vLLM and SGLang agree). KTransformers' copy has a
                    // `moe_enable_early_router` switch that the model repository's file does not
                    // read; where they disagree the model repository's file decides.
                    router_input: RouterInput::LayerInput,
                },
                vec![true; num_layers],
            )
        }
    };
    if moe.top_k == 0 || moe.top_k > moe.num_experts {
        return Err(ConfigError::Invalid(format!(
            "num_experts_per_tok {} must be within 1..={}",
            moe.top_k, moe.num_experts
        )));
    }
    Ok((Some(moe), layers))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 100, "head_dim": 32,
               "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
               "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
               "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "eos_token_id": [2, 3]})
    }

    #[test]
    fn classic_and_rope_parameters_forms_agree() {
        let classic = ModelConfig::from_json(&base()).unwrap();
        let mut v = base();
        let o = v.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.remove("partial_rotary_factor");
        o.insert(
            "rope_parameters".into(),
            json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        );
        let newer = ModelConfig::from_json(&v).unwrap();
        assert_eq!(classic.rope, newer.rope);
        assert_eq!(classic.rope.rotary_dim, 16);
        assert_eq!(classic.moe_layers, vec![false, true, true]);
        assert_eq!(classic.eos_token_ids, vec![2, 3]);
        assert_eq!(classic.moe.as_ref().unwrap().shared_intermediate, Some(16));
    }

    #[test]
    fn unknown_architecture_lists_supported() {
        let mut v = base();
        v["architectures"] = json!(["FancyForCausalLM"]);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(
            e.contains("FancyForCausalLM") && e.contains("Qwen3MoeForCausalLM"),
            "{e}"
        );
    }

    fn smallthinker() -> Value {
        json!({"architectures": ["SmallThinkerForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 100,
               "moe_num_primary_experts": 8, "moe_num_active_primary_experts": 2, "moe_ffn_hidden_size": 16,
               "rope_layout": [0, 1, 1, 1], "sliding_window_layout": [0, 1, 1, 1], "sliding_window_size": 5})
    }

    #[test]
    fn smallthinker_layouts_router_and_class_defaults() {
        let c = ModelConfig::from_json(&smallthinker()).unwrap();
        assert_eq!(c.arch, Arch::SmallThinker);
        assert_eq!(c.activation, Activation::Relu);
        assert_eq!(
            c.head_dim, 128,
            "the config class default, not hidden/heads"
        );
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.eos_token_ids, vec![151643, 151645]);
        let full = LayerAttention {
            rope: false,
            window: None,
        };
        let swa = LayerAttention {
            rope: true,
            window: Some(5),
        };
        assert_eq!(c.layer_attention, vec![full, swa, swa, swa]);
        assert_eq!(swa.first_attended(3), 0);
        assert_eq!(swa.first_attended(9), 5);
        let m = c.moe.unwrap();
        assert_eq!(m.router_input, RouterInput::LayerInput);
        assert_eq!(c.moe_layers, vec![true; 4]);
        assert!(matches!(
            m.router,
            RouterKind::SigmoidGrouped {
                n_group: 1,
                renormalize: true,
                ..
            }
        ));
        let mut v = smallthinker();
        v["moe_primary_router_apply_softmax"] = json!(true);
        v["tie_word_embeddings"] = json!(false);
        let c = ModelConfig::from_json(&v).unwrap();
        assert!(!c.tie_word_embeddings);
        assert_eq!(
            c.moe.unwrap().router,
            RouterKind::Softmax { renormalize: true }
        );
    }

    #[test]
    fn smallthinker_bad_layouts_are_errors() {
        for (key, bad) in [
            ("rope_layout", json!([1, 1])),
            ("sliding_window_layout", json!([0, 2, 0, 0])),
            ("rope_layout", json!("all")),
        ] {
            let mut v = smallthinker();
            v[key] = bad;
            let e = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
        let mut v = smallthinker();
        v["sliding_window_size"] = json!(0);
        assert!(ModelConfig::from_json(&v).is_err());
        // other architectures: every layer full attention with RoPE
        let c = ModelConfig::from_json(&base()).unwrap();
        assert_eq!(c.layer_attention, vec![LayerAttention::FULL; 3]);
    }

    #[test]
    fn bad_fields_are_errors_not_panics() {
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&v).is_err());
        let mut v = base();
        v["num_experts_per_tok"] = json!(9);
        assert!(ModelConfig::from_json(&v).is_err());
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(matches!(
            ModelConfig::from_json(&v),
            Err(ConfigError::Field("hidden_size"))
        ));
    }
}
