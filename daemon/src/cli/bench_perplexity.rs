//! `moe-daemon bench perplexity`: perplexity of a fixed text, with the dense projections as they are
//! stored or as the GPU holds them under `--dense-dtype bf16|fp8|int4`.
//!
//! With `--device cuda` the GPU engine itself is scored, once per dense format and per
//! `--kv-cache-dtypes` entry: each window is fed one token per step (decode steps, every position
//! attending to the cache in its dtype), so this measures what the KV cache's format costs too.
//! Without a GPU (the default, CPU backend) the dense weights are emulated:
//!
//! The GPU's accuracy cost of quantized dense weights, measured without a GPU: every dense projection
//! the GPU loader quantizes (attention q/k/v/o and MLA projections, dense MLPs, shared experts,
//! lm_head) goes through the same host round trip `kernels/src/cuda/quant.rs` performs at upload
//! (`quantize_linear`, then the kernels' reference dequantization), and the embedding table through
//! bf16 as the GPU keeps it; routers, norms, biases and routed experts are left as stored. A tied
//! table is read twice, once per role, as the GPU holds it twice. Text is scored in windows of
//! `--ctx` tokens (each on a fresh cache): the mean negative log-likelihood of every token after a
//! window's first, perplexity = exp(mean).
use super::model_path::ModelPath;
use crate::engine::linear::Linear;
use crate::engine::{Engine, EngineOptions, SeqInput};
use crate::weights::safetensors::SafetensorsDir;
use crate::weights::{HostData, HostTensor, TensorSource, WeightError};
use clap::{Args, ValueEnum};
use moe_kernels::cuda::quant::DenseFormat;
use std::path::PathBuf;
use std::time::Instant;

/// How dense projections are held for a perplexity run.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseAs {
    /// As the checkpoint stores them (the CPU backend's own kernels).
    Stored,
    /// Rounded to bf16 (the GPU's `--dense-dtype bf16`).
    Bf16,
    /// W8A16 E4M3 with group scales (`--dense-dtype fp8`).
    Fp8,
    /// W4A16 group-wise (`--dense-dtype int4`).
    Int4,
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// Model directory (config.json + safetensors) or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// UTF-8 text to score, tokenized with the model's tokenizer.
    #[arg(long)]
    pub text: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(2..=65536))]
    pub ctx: u32,
    /// Score at most this many tokens of the text (whole windows).
    #[arg(long, default_value_t = 4096)]
    pub max_tokens: usize,
    /// Dense weights to compare (comma separated): stored, bf16, fp8, int4 (`stored`: CPU only).
    #[arg(long, value_delimiter = ',', default_value = "bf16,fp8,int4")]
    pub dense: Vec<DenseAs>,
    /// With `--device cuda`: GPU KV cache dtypes to compare (comma separated): bf16, int8, fp8.
    #[arg(long, value_delimiter = ',', default_value = "bf16")]
    pub kv_cache_dtypes: Vec<super::engine_args::KvCacheDtypeArg>,
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
}

/// Tensor names the GPU loader quantizes under `--dense-dtype` (attention and MLA projections, dense
/// MLPs and shared experts, lm_head); routed experts, routers, norms and biases are not.
fn is_gpu_dense_projection(name: &str) -> bool {
    if name == "lm_head.weight" {
        return true;
    }
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return false;
    };
    let Some((_, suffix)) = rest.split_once('.') else {
        return false;
    };
    let routed = suffix.contains(".experts.");
    let projection = suffix.ends_with("_proj.weight") || suffix.ends_with("_proj_with_mqa.weight");
    let attention_or_mlp = suffix.starts_with("self_attn.") || suffix.starts_with("mlp.");
    attention_or_mlp && projection && !routed
}

/// A checkpoint whose dense projections read back as the GPU would compute with them.
struct AsOnGpu<'a> {
    inner: &'a dyn TensorSource,
    format: DenseFormat,
}

impl AsOnGpu<'_> {
    /// The GPU's `[rows, cols]` matrix for `t`, widened back to f32: quantized and dequantized
    /// (bf16 for bf16, or for widths the quantized kernels cannot take).
    fn round_trip(&self, t: HostTensor) -> HostTensor {
        let shape = t.shape.clone();
        let l = Linear::new(t, None);
        let (rows, cols) = (l.out_dim, l.in_dim);
        let data = match crate::engine::gpu::quantize_linear(&l, self.format) {
            Some(q) => {
                let mut v = vec![0f32; rows * cols];
                for (r, row) in v.chunks_mut(cols.max(1)).enumerate() {
                    q.dequantize_row(r, row);
                }
                HostData::F32(v)
            }
            None => HostData::Bf16(crate::engine::gpu::linear_bf16(&l)),
        };
        HostTensor { shape, data }
    }
}

impl TensorSource for AsOnGpu<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let t = self.inner.load(name)?;
        Ok(if is_gpu_dense_projection(name) {
            self.round_trip(t)
        } else if name == "model.embed_tokens.weight" {
            HostTensor {
                data: HostData::Bf16(t.to_bf16()),
                shape: t.shape,
            }
        } else {
            t
        })
    }
}

/// The engine with its dense projections as the GPU holds them in `format` (`None`: as stored).
fn load(
    path: &ModelPath,
    opts: &EngineOptions,
    format: Option<DenseFormat>,
) -> anyhow::Result<Engine> {
    let Some(format) = format else {
        return path.load_engine(opts);
    };
    match path {
        ModelPath::Dir(dir) => {
            let config = dir.join("config.json");
            let text = std::fs::read_to_string(&config)
                .map_err(|e| anyhow::anyhow!("{}: {e}", config.display()))?;
            let cfg: serde_json::Value = serde_json::from_str(&text)?;
            let src = SafetensorsDir::open(dir)?;
            Engine::from_source(
                &cfg,
                &AsOnGpu {
                    inner: &src,
                    format,
                },
                opts,
            )
        }
        ModelPath::Gguf { file, .. } => Engine::from_source(
            &file.hf_config()?,
            &AsOnGpu {
                inner: file,
                format,
            },
            opts,
        ),
    }
}

/// Negative log-likelihood of the tokens scored so far.
#[derive(Default)]
struct Nll {
    sum: f64,
    tokens: usize,
}

impl Nll {
    /// Scores `next` under `logits` (log-softmax in f64).
    fn add(&mut self, logits: &[f32], next: u32) {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
        self.sum += max + sum.ln() - logits[next as usize] as f64;
        self.tokens += 1;
    }

    /// The mean over the tokens scored, and their count.
    fn mean(&self) -> anyhow::Result<(f64, usize)> {
        anyhow::ensure!(self.tokens > 0, "the text has fewer than two tokens");
        Ok((self.sum / self.tokens as f64, self.tokens))
    }
}

/// Mean negative log-likelihood of `ids` scored in windows of `ctx`, and the tokens scored.
fn mean_nll(engine: &Engine, ids: &[u32], ctx: usize) -> anyhow::Result<(f64, usize)> {
    let mut nll = Nll::default();
    for window in ids.chunks(ctx).filter(|w| w.len() >= 2) {
        let mut cache = engine.new_cache();
        let rows = engine.forward_all(&mut [SeqInput {
            cache: &mut cache,
            tokens: window,
        }])?;
        for (logits, &next) in rows.iter().zip(&window[1..]) {
            nll.add(logits, next);
        }
    }
    nll.mean()
}

pub fn run(a: PerplexityArgs) -> anyhow::Result<()> {
    let path = ModelPath::open(&a.model)?;
    let text = std::fs::read_to_string(&a.text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.text.display()))?;
    let tokenizer = path
        .tokenizer()?
        .ok_or_else(|| anyhow::anyhow!("{}: no tokenizer", a.model.display()))?;
    let mut ids = tokenizer.encode(&text)?;
    let ctx = a.ctx as usize;
    ids.truncate((a.max_tokens / ctx).max(1) * ctx);
    let opts = a.engine.options_with(true)?;
    println!(
        "{}: {} tokens of {} in windows of {ctx}",
        a.model.display(),
        ids.len(),
        a.text.display()
    );
    if matches!(opts.device, crate::engine::Device::Cuda(_)) {
        return run_on_gpu(&a, &path, opts, &ids);
    }
    for dense in &a.dense {
        let t = Instant::now();
        let format = match dense {
            DenseAs::Stored => None,
            DenseAs::Bf16 => Some(DenseFormat::Bf16),
            DenseAs::Fp8 => Some(DenseFormat::Fp8),
            DenseAs::Int4 => Some(DenseFormat::Int4),
        };
        let engine = load(&path, &opts, format)?;
        let (nll, n) = mean_nll(&engine, &ids, ctx)?;
        println!(
            "dense {:<6} perplexity {:>9.4}  (mean NLL {nll:.5} over {n} tokens, {:.1} s)",
            format!("{dense:?}").to_lowercase(),
            nll.exp(),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Mean negative log-likelihood of `ids` scored in windows of `ctx`, fed one token per step (the GPU
/// backend returns the last position's logits of a step), and the tokens scored.
fn mean_nll_stepwise(engine: &Engine, ids: &[u32], ctx: usize) -> anyhow::Result<(f64, usize)> {
    let mut nll = Nll::default();
    for window in ids.chunks(ctx).filter(|w| w.len() >= 2) {
        let mut cache = engine.new_cache();
        for (i, &next) in window[1..].iter().enumerate() {
            let logits = engine
                .reserve_and_forward(&mut [SeqInput {
                    cache: &mut cache,
                    tokens: &window[i..i + 1],
                }])?
                .remove(0);
            nll.add(&logits, next);
        }
    }
    nll.mean()
}

/// The GPU engine scored per dense format and KV cache dtype.
fn run_on_gpu(
    a: &PerplexityArgs,
    path: &ModelPath,
    mut opts: EngineOptions,
    ids: &[u32],
) -> anyhow::Result<()> {
    use super::engine_args::KvCacheDtypeArg;
    use moe_sizing::{DenseChoice, DenseDtype, KvCacheDtype};
    let ctx = a.ctx as usize;
    for dense in &a.dense {
        opts.dense_dtype = DenseChoice::Fixed(match dense {
            DenseAs::Stored => {
                anyhow::bail!(
                    "--dense stored is the CPU backend's; on the GPU use bf16, fp8 or int4"
                )
            }
            DenseAs::Bf16 => DenseDtype::Bf16,
            DenseAs::Fp8 => DenseDtype::Fp8,
            DenseAs::Int4 => DenseDtype::Int4,
        });
        for kv in &a.kv_cache_dtypes {
            opts.kv_cache_dtype = match kv {
                KvCacheDtypeArg::Bf16 => KvCacheDtype::Bf16,
                KvCacheDtypeArg::Fp8 => KvCacheDtype::Fp8,
                KvCacheDtypeArg::Int8 => KvCacheDtype::Int8,
            };
            let t = Instant::now();
            let engine = path.load_engine(&opts)?;
            let (nll, n) = mean_nll_stepwise(&engine, ids, ctx)?;
            println!(
                "dense {:<6} kv {:<5} perplexity {:>9.4}  (mean NLL {nll:.5} over {n} tokens, GPU, {:.1} s)",
                format!("{dense:?}").to_lowercase(),
                opts.kv_cache_dtype.as_str(),
                nll.exp(),
                t.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform logits give ln(vocabulary) per token; a token whose logit leads by ln(3) over two
    /// others gets probability 3/5; nothing scored is an error.
    #[test]
    fn nll_is_the_log_softmax_of_the_next_token() {
        let mut nll = Nll::default();
        nll.add(&[0.5; 8], 3);
        assert!((nll.mean().unwrap().0 - 8f64.ln()).abs() < 1e-12);
        let mut nll = Nll::default();
        nll.add(&[3f32.ln(), 0.0, 0.0], 0);
        let (mean, tokens) = nll.mean().unwrap();
        assert!((mean - (5.0f64 / 3.0).ln()).abs() < 1e-6, "{mean}");
        assert_eq!(tokens, 1);
        assert!(Nll::default().mean().is_err());
    }

    #[test]
    fn gpu_dense_projections_are_the_ones_the_gpu_quantizes() {
        for name in [
            "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight",
        ] {
            assert!(is_gpu_dense_projection(name), "{name}");
        }
        for name in [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.experts.5.down_proj.weight",
            "model.layers.0.input_layernorm.weight",
        ] {
            assert!(!is_gpu_dense_projection(name), "{name}");
        }
    }
}
