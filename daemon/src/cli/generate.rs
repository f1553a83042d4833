//! `moe-daemon generate`: offline generation for one prompt, with optional per-step logits dump
//! (`--logits-out`) used to check the engine against reference implementations.
use crate::engine::sampling::{Sampler, SamplingParams};
use crate::engine::SeqInput;
use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model directory (config.json + safetensors) or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text, tokenized with the model's tokenizer.json (or the GGUF's vocabulary).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids (no tokenizer needed), e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Write `{"steps": [{"token": id, "logits": [...]}, ...]}`: step 0 is the last prefill position.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// Print one JSON object (ids, text, timings) instead of plain text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
}

#[derive(Serialize)]
struct Step {
    token: u32,
    logits: Vec<f32>,
}

#[derive(Serialize)]
struct LogitsFile {
    steps: Vec<Step>,
}

#[derive(Serialize)]
struct Report {
    prompt_ids: Vec<u32>,
    token_ids: Vec<u32>,
    text: Option<String>,
    finish_reason: &'static str,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        seed: a.seed,
    };
    params.validate().map_err(anyhow::Error::msg)?;
    let model = super::model_path::ModelPath::open(&a.model)?;
    let tokenizer = model.tokenizer()?;
    let prompt: Vec<u32> = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            let tok = tokenizer.as_ref().with_context(|| {
                format!(
                    "--prompt needs {}/tokenizer.json; use --prompt-ids instead",
                    a.model.display()
                )
            })?;
            tok.encode(text)?
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let engine = model.load_engine(&a.engine.options_with(true)?)?;
    let mut sampler = Sampler::new(&params);
    let mut cache = engine.new_cache();
    let t0 = Instant::now();
    let mut logits = engine
        .reserve_and_forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &prompt,
        }])?
        .remove(0);
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut generated = Vec::new();
    let mut steps = Vec::new();
    let mut finish = "length";
    let eos = &engine.config().eos_token_ids;
    for i in 0..a.max_tokens {
        let tok = sampler.sample_parts(&logits, &prompt, &generated);
        generated.push(tok);
        if a.logits_out.is_some() {
            steps.push(Step {
                token: tok,
                logits: std::mem::take(&mut logits),
            });
        }
        if !a.ignore_eos && eos.contains(&tok) {
            finish = "stop";
            break;
        }
        if i + 1 == a.max_tokens {
            break;
        }
        logits = engine
            .reserve_and_forward(&mut [SeqInput {
                cache: &mut cache,
                tokens: &[tok],
            }])?
            .remove(0);
    }
    let decode_s = t1.elapsed().as_secs_f64();
    if let Some(path) = &a.engine.record_routing {
        engine.save_routing_stats(path)?;
    }
    if let Some(path) = &a.logits_out {
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = std::io::BufWriter::new(f);
        serde_json::to_writer(&mut w, &LogitsFile { steps })?;
        w.flush()?;
    }
    let text = match &tokenizer {
        Some(t) => Some(t.decode(&generated)?),
        None => None,
    };
    let decode_steps = generated.len().saturating_sub(1).max(1);
    let report = Report {
        prompt_ids: prompt.clone(),
        token_ids: generated.clone(),
        text: text.clone(),
        finish_reason: finish,
        prefill_tokens_per_s: prompt.len() as f64 / prefill_s.max(1e-9),
        decode_tokens_per_s: decode_steps as f64 / decode_s.max(1e-9),
    };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        match text {
            Some(t) => println!("{t}"),
            None => println!(
                "{}",
                generated
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
        eprintln!(
            "prompt {} tokens, {:.1} tok/s prefill; generated {} tokens, {:.1} tok/s decode ({finish})",
            prompt.len(),
            report.prefill_tokens_per_s,
            generated.len(),
            report.decode_tokens_per_s
        );
    }
    Ok(())
}
