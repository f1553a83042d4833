//! `moe-daemon bench synth-checkpoint`: random weights in the exact config and tensor layout of a real
//! model (full width, optionally fewer layers), written as sharded safetensors with a hub-style index.
//! Tensors are generated and written in streaming fashion: memory stays flat whatever the size.
use anyhow::{bail, Context};
use clap::Args;
use rayon::prelude::*;
use serde_json::{json, Value};
use std::io::{BufWriter, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Model shape: qwen3-30b-a3b, glm-4.5-air, deepseek-v3, smallthinker-21b, smallthinker-4b,
    /// glm-4.7-flash, glm-5 or glm-5.3-flash.
    #[arg(long)]
    pub like: String,
    /// Number of decoder layers (fewer than the real model to fit a disk).
    #[arg(long)]
    pub layers: Option<usize>,
    /// bf16, or fp8 (E4M3 with 128×128 block scales on projections, as the hub FP8 checkpoints).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Hub config.json of each shape (the table the operator sizes with).
pub fn config_like(name: &str) -> anyhow::Result<Value> {
    moe_sizing::known::config_json(name).with_context(|| {
        let names: Vec<&str> = moe_sizing::known::KNOWN_MODELS
            .iter()
            .map(|k| k.key)
            .collect();
        format!("--like {name}: choose {}", names.join(", "))
    })
}

/// `--layers`: fewer decoder layers, with the per-layer layouts cut to match.
fn set_layers(cfg: &mut Value, layers: usize) {
    if let Some(text) = cfg.get_mut("text_config").filter(|t| t.is_object()) {
        text["num_hidden_layers"] = layers.into();
        super::synth_glm5::set_layers(text, layers);
        return;
    }
    cfg["num_hidden_layers"] = layers.into();
    for key in ["rope_layout", "sliding_window_layout"] {
        if let Some(a) = cfg.get_mut(key).and_then(Value::as_array_mut) {
            a.truncate(layers);
        }
    }
    super::synth_glm::set_layers(cfg, layers);
}

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Kind {
    /// Projection weight `[out, in]`, random with std 1/sqrt(in).
    Proj,
    /// Norm weight: ones.
    Norm,
    /// Small random vector (biases, router bias) stored F32.
    VecF32,
}

pub(super) struct Spec {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: Kind,
}

/// Every tensor of the checkpoint with its HF name, derived from the parsed config.
fn tensor_specs(v: &Value) -> anyhow::Result<Vec<Spec>> {
    use super::synth_glm5::Values;
    use crate::model::config::{Arch, ModelConfig};
    use crate::model::names::MoeNames;
    let c = ModelConfig::from_json(v)?;
    let h = c.hidden_size;
    // Multimodal checkpoints (GLM-5.3-Flash) keep the text model under `model.language_model`.
    let hybrid = c.arch == Arch::Glm5Next;
    let root = if hybrid {
        "model.language_model"
    } else {
        "model"
    };
    let mut s = Vec::new();
    let mut p = |name: String, shape: Vec<usize>, kind| s.push(Spec { name, shape, kind });
    p(
        format!("{root}.embed_tokens.weight"),
        vec![c.vocab_size, h],
        Kind::Proj,
    );
    if !c.tie_word_embeddings {
        p("lm_head.weight".into(), vec![c.vocab_size, h], Kind::Proj);
    }
    p(format!("{root}.norm.weight"), vec![h], Kind::Norm);
    for l in 0..c.num_layers {
        let a = format!("{root}.layers.{l}.self_attn");
        p(
            format!("{root}.layers.{l}.input_layernorm.weight"),
            vec![h],
            Kind::Norm,
        );
        p(
            format!("{root}.layers.{l}.post_attention_layernorm.weight"),
            vec![h],
            Kind::Norm,
        );
        match &c.mla {
            _ if hybrid => {
                let mut add = |name: String, shape: Vec<usize>, values: Values| {
                    let kind = match values {
                        Values::Proj => Kind::Proj,
                        Values::Norm => Kind::Norm,
                        Values::F32 => Kind::VecF32,
                    };
                    p(name, shape, kind)
                };
                super::synth_glm5::mixer_specs(&c, l, &format!("{root}.layers.{l}"), &mut add);
            }
            Some(m) => {
                let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                if let Some(r) = m.q_lora_rank {
                    p(format!("{a}.q_a_proj.weight"), vec![r, h], Kind::Proj);
                    p(format!("{a}.q_a_layernorm.weight"), vec![r], Kind::Norm);
                    p(
                        format!("{a}.q_b_proj.weight"),
                        vec![c.num_heads * qk, r],
                        Kind::Proj,
                    );
                } else {
                    p(
                        format!("{a}.q_proj.weight"),
                        vec![c.num_heads * qk, h],
                        Kind::Proj,
                    );
                }
                p(
                    format!("{a}.kv_a_proj_with_mqa.weight"),
                    vec![m.kv_lora_rank + m.qk_rope_head_dim, h],
                    Kind::Proj,
                );
                p(
                    format!("{a}.kv_a_layernorm.weight"),
                    vec![m.kv_lora_rank],
                    Kind::Norm,
                );
                p(
                    format!("{a}.kv_b_proj.weight"),
                    vec![
                        c.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                        m.kv_lora_rank,
                    ],
                    Kind::Proj,
                );
                p(
                    format!("{a}.o_proj.weight"),
                    vec![h, c.num_heads * m.v_head_dim],
                    Kind::Proj,
                );
                let mut ix = vec![];
                super::synth_glm::indexer_specs(&c, l, &mut ix);
                ix.into_iter().for_each(|s| p(s.name, s.shape, s.kind));
            }
            None => {
                let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
                for (n, o) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                    p(format!("{a}.{n}.weight"), vec![o, h], Kind::Proj);
                    if c.arch == Arch::Glm4Moe {
                        p(format!("{a}.{n}.bias"), vec![o], Kind::VecF32);
                    }
                }
                p(format!("{a}.o_proj.weight"), vec![h, q], Kind::Proj);
                if c.arch == Arch::Qwen3Moe {
                    p(format!("{a}.q_norm.weight"), vec![c.head_dim], Kind::Norm);
                    p(format!("{a}.k_norm.weight"), vec![c.head_dim], Kind::Norm);
                }
            }
        }
        let mlp = format!("{root}.layers.{l}.mlp");
        let dense = |p: &mut dyn FnMut(String, Vec<usize>, Kind), prefix: &str, inter: usize| {
            p(
                format!("{prefix}.gate_proj.weight"),
                vec![inter, h],
                Kind::Proj,
            );
            p(
                format!("{prefix}.up_proj.weight"),
                vec![inter, h],
                Kind::Proj,
            );
            p(
                format!("{prefix}.down_proj.weight"),
                vec![h, inter],
                Kind::Proj,
            );
        };
        match &c.moe {
            Some(m) if c.is_moe_layer(l) => {
                let names = MoeNames::in_model(c.arch, root, l);
                p(names.router.clone(), vec![m.num_experts, h], Kind::Proj);
                if matches!(
                    c.arch,
                    Arch::Glm4Moe
                        | Arch::DeepseekV3
                        | Arch::Glm4MoeLite
                        | Arch::GlmMoeDsa
                        | Arch::Glm5Next
                ) {
                    p(
                        names.correction_bias.clone(),
                        vec![m.num_experts],
                        Kind::VecF32,
                    );
                }
                let i = m.expert_intermediate;
                for e in 0..m.num_experts {
                    let [g, u, d] = names.expert(e);
                    p(g, vec![i, h], Kind::Proj);
                    p(u, vec![i, h], Kind::Proj);
                    p(d, vec![h, i], Kind::Proj);
                }
                if let Some(w) = m.shared_intermediate {
                    dense(&mut p, &format!("{mlp}.shared_experts"), w);
                }
            }
            _ => dense(&mut p, &mlp, c.intermediate_size),
        }
    }
    Ok(s)
}

/// xorshift64*: fast, seedable, good enough for random weights.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Roughly normal (sum of 4 uniforms, variance-corrected), times `std`.
    fn normal(&mut self, std: f32) -> f32 {
        let r = self.next();
        let u = (0..4)
            .map(|i| ((r >> (16 * i)) & 0xFFFF) as f32 / 65535.0)
            .sum::<f32>()
            - 2.0;
        u * std * 1.732
    }
}

const SHARD_BYTES: usize = 4 << 30;

/// Appends one random element of the tensor's dtype.
fn element(buf: &mut Vec<u8>, rng: &mut Rng, dtype: &str, kind: Kind, is_scale: bool, fan_in: f32) {
    match (dtype, kind, is_scale) {
        ("F32", _, true) => buf.extend_from_slice(&(fan_in.sqrt().recip() / 64.0).to_le_bytes()),
        ("F32", _, false) => buf.extend_from_slice(&rng.normal(0.05).to_le_bytes()),
        ("F8_E4M3", _, _) => {
            // finite E4M3 around ±[0.5, 256): never 0x7F/0xFF (NaN)
            let r = rng.next();
            buf.push(((r >> 32) as u8 & 0x80) | (0x30 + (r as u8 % 0x48)));
        }
        (_, Kind::Norm, _) => buf.extend_from_slice(&half::bf16::ONE.to_bits().to_le_bytes()),
        _ => buf.extend_from_slice(
            &half::bf16::from_f32(rng.normal(fan_in.sqrt().recip()))
                .to_bits()
                .to_le_bytes(),
        ),
    }
}

pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    let mut cfg = config_like(&a.like)?;
    if let Some(l) = a.layers {
        if l == 0 {
            bail!("--layers must be at least 1");
        }
        set_layers(&mut cfg, l);
    }
    let fp8 = match a.dtype.as_str() {
        "bf16" => false,
        "fp8" => true,
        d => bail!("--dtype {d}: choose bf16 or fp8"),
    };
    if fp8 {
        cfg["quantization_config"] = moe_sizing::known::fp8_quantization_config();
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    // (name, dtype, shape, kind, is_scale)
    let mut entries: Vec<(String, &str, Vec<usize>, Kind, bool)> = vec![];
    for s in tensor_specs(&cfg)? {
        let quantize =
            fp8 && s.kind == Kind::Proj && s.name.contains("proj") && !s.name.contains("embed");
        match (s.kind, quantize) {
            (Kind::Proj, true) => {
                let sc = vec![s.shape[0].div_ceil(128), s.shape[1].div_ceil(128)];
                entries.push((s.name.clone(), "F8_E4M3", s.shape.clone(), s.kind, false));
                entries.push((format!("{}_scale_inv", s.name), "F32", sc, s.kind, true));
            }
            (Kind::VecF32, _) => entries.push((s.name, "F32", s.shape, s.kind, false)),
            _ => entries.push((s.name, "BF16", s.shape, s.kind, false)),
        }
    }
    let bytes_of = |dtype: &str, shape: &[usize]| -> usize {
        shape.iter().product::<usize>()
            * match dtype {
                "F8_E4M3" => 1,
                "BF16" => 2,
                _ => 4,
            }
    };
    // split into shards
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut size = 0;
    for (i, e) in entries.iter().enumerate() {
        let b = bytes_of(e.1, &e.2);
        if size + b > SHARD_BYTES && !shards.last().is_some_and(Vec::is_empty) {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().expect("non-empty").push(i);
        size += b;
    }
    let n_shards = shards.len();
    let mut weight_map = serde_json::Map::new();
    let base_seed = 0x9E37_79B9_7F4A_7C15 ^ a.seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let mut total = 0usize;
    for (si, idx) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", si + 1, n_shards);
        let mut header = serde_json::Map::new();
        let mut off = 0;
        for &i in idx {
            let (name, dtype, shape, _, _) = &entries[i];
            let b = bytes_of(dtype, shape);
            header.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + b]}),
            );
            weight_map.insert(name.clone(), file.clone().into());
            off += b;
        }
        let mut h = serde_json::to_vec(&header)?;
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let path = a.out.join(&file);
        let f =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = BufWriter::with_capacity(8 << 20, f);
        w.write_all(&(h.len() as u64).to_le_bytes())?;
        w.write_all(&h)?;
        for &i in idx {
            let (_, dtype, shape, kind, is_scale) = &entries[i];
            let n: usize = shape.iter().product();
            let fan_in = *shape.last().unwrap_or(&1) as f32;
            // Generated in parallel chunks (each with its own seeded stream), written in order.
            const CHUNK: usize = 1 << 20;
            let elem = bytes_of(dtype, &[1]);
            let mut done = 0;
            while done < n {
                let m = (n - done).min(64 * CHUNK);
                let bytes: Vec<Vec<u8>> = (0..m.div_ceil(CHUNK))
                    .into_par_iter()
                    .map(|c| {
                        let len = CHUNK.min(m - c * CHUNK);
                        let mut rng =
                            Rng(base_seed ^ ((i as u64) << 32) ^ (done + c * CHUNK) as u64 | 1);
                        let mut buf = Vec::with_capacity(len * elem);
                        for _ in 0..len {
                            element(&mut buf, &mut rng, dtype, *kind, *is_scale, fan_in);
                        }
                        buf
                    })
                    .collect();
                for b in bytes {
                    w.write_all(&b)?;
                }
                done += m;
            }
        }
        w.flush()?;
        total += off;
        eprintln!(
            "wrote {} ({:.2} GiB)",
            path.display(),
            off as f64 / (1u64 << 30) as f64
        );
    }
    std::fs::write(
        a.out.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(
            &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )?,
    )?;
    std::fs::write(
        a.out.join("config.json"),
        serde_json::to_string_pretty(&cfg)?,
    )?;
    eprintln!(
        "{}: {} tensors, {:.2} GiB",
        a.out.display(),
        entries.len(),
        total as f64 / (1u64 << 30) as f64
    );
    eprintln!(
        "{}",
        kv_footprint(&crate::model::ModelConfig::from_json(&cfg)?)
    );
    Ok(())
}

/// One line: the KV cache a position takes in this shape (every layer's rows, indexer keys included)
/// and what 128K and 1M positions of context take.
pub fn kv_footprint(c: &crate::model::ModelConfig) -> String {
    let per = crate::engine::kv::bytes_per_position(c);
    let gib = |n: usize| (per * n) as f64 / (1u64 << 30) as f64;
    format!(
        "KV cache: {:.1} KiB per position over {} layers (f32 rows, indexer keys included): \
         {:.1} GiB at 128K positions, {:.1} GiB at 1M",
        per as f64 / 1024.0,
        c.num_layers,
        gib(128 << 10),
        gib(1 << 20)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{LayerAttention, ModelConfig};

    fn params(like: &str) -> (usize, ModelConfig) {
        let cfg = config_like(like).unwrap();
        let n = tensor_specs(&cfg)
            .unwrap()
            .iter()
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        (n, ModelConfig::from_json(&cfg).unwrap())
    }

    #[test]
    fn smallthinker_shapes_match_the_model_cards() {
        // 21B-A3B: 52 layers of 64 experts (768 wide), untied; ~21.5 B parameters.
        let (n, c) = params("smallthinker-21b");
        assert!((21.0e9..22.0e9).contains(&(n as f64)), "{n}");
        assert_eq!(
            c.layer_attention[0],
            LayerAttention {
                rope: false,
                window: None
            }
        );
        assert_eq!(
            c.layer_attention[1],
            LayerAttention {
                rope: true,
                window: Some(4096)
            }
        );
        assert_eq!(
            c.layer_attention
                .iter()
                .filter(|l| l.window.is_none())
                .count(),
            13
        );
        // 4B-A0.6B: 32 layers of 32 experts, tied; ~4.0 B parameters.
        let (n, c) = params("smallthinker-4b");
        assert!((3.8e9..4.2e9).contains(&(n as f64)), "{n}");
        assert!(c.tie_word_embeddings);
        assert!(c.layer_attention.iter().all(|l| *l == LayerAttention::FULL));
    }

    #[test]
    fn glm53_flash_shape() {
        // ~320 B parameters (text model without MTP and vision), 288 experts top-8 of 2048.
        let (n, c) = params("glm-5.3-flash");
        assert!((300e9..340e9).contains(&(n as f64)), "{n}");
        use crate::model::hybrid::Mixer;
        assert_eq!(
            c.mixers.iter().filter(|m| **m == Mixer::Attention).count(),
            11
        );
        assert_eq!(c.moe_layers.iter().filter(|m| **m).count(), 42);
        let ix = c.indexer.as_ref().unwrap();
        assert_eq!((ix.n_heads, ix.head_dim, ix.topk), (32, 128, 2048));
        assert_eq!(
            ix.pooling,
            crate::model::config::IndexerPooling::KeyPool { pool: 4 }
        );
        // 11 indexed layers: latent 512 + indexer key and gate logits 2 × 128 floats per position;
        // linear-attention layers hold no rows
        assert_eq!(
            crate::engine::kv::bytes_per_position(&c),
            11 * (512 + 256) * 4
        );
        let mut cfg = config_like("glm-5.3-flash").unwrap();
        set_layers(&mut cfg, 5);
        let c = ModelConfig::from_json(&cfg).unwrap();
        assert_eq!(c.num_layers, 5);
        assert_eq!(c.mixers[3], Mixer::Attention);
    }

    #[test]
    fn glm_mla_shapes_match_the_published_sizes() {
        // GLM-4.7-Flash: "30B-A3B" (31.2 B with the embeddings); GLM-5: 744 B parameters (model card:
        // "744B total, 40B active"; 78 layers here, the MTP layer not counted).
        let (n, c) = params("glm-4.7-flash");
        assert!((29.0e9..32.0e9).contains(&(n as f64)), "{n}");
        assert!(c.indexer.is_none());
        let (n, c) = params("glm-5");
        assert!((730.0e9..750.0e9).contains(&(n as f64)), "{n}");
        let ix = c.indexer.as_ref().unwrap();
        assert_eq!((ix.n_heads, ix.head_dim, ix.topk), (32, 128, 2048));
        // latent 512 + rope key 64 + indexer key 128 floats per layer and position
        assert_eq!(
            crate::engine::kv::bytes_per_position(&c),
            78 * (512 + 64 + 128) * 4
        );
        assert!(
            kv_footprint(&c).contains("214.5 KiB"),
            "{}",
            kv_footprint(&c)
        );
        let mut cfg = config_like("glm-5").unwrap();
        cfg["indexer_types"] = json!(vec!["full"; 78]);
        set_layers(&mut cfg, 4);
        let c = ModelConfig::from_json(&cfg).unwrap();
        assert_eq!(c.indexer.unwrap().layers.len(), 4);
        assert_eq!(c.moe_layers, vec![false, false, false, true]);
    }

    #[test]
    fn fewer_layers_cut_the_layouts() {
        let mut cfg = config_like("smallthinker-21b").unwrap();
        set_layers(&mut cfg, 6);
        let c = ModelConfig::from_json(&cfg).unwrap();
        assert_eq!(c.num_layers, 6);
        assert_eq!(c.layer_attention.len(), 6);
        assert!(!c.layer_attention[4].rope);
    }
}
