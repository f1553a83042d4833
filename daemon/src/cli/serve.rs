//! `moe-daemon serve`: load a model (GGUF file or Hugging Face directory) on the engine thread while the
//! HTTP server already answers `/health` (and `/ready` with 503), then serve the OpenAI API until SIGTERM
//! or Ctrl-C: stop accepting, let in-flight requests finish within `--shutdown-timeout-s`, exit.
//!
//! Exit status: 0 after a clean drain; nonzero, with the cause on stderr, when the model fails to
//! load (error or panic: a liveness probe must see the process die, not a server stuck "loading") or
//! when the shutdown deadline passes with requests still running (those end with an error event).
#[path = "serve_conn.rs"]
mod conn;
use crate::api::{self, AppState, HttpLimits};
use crate::cli::engine_args::EngineArgs;
use crate::engine::kv::{blocks_for, BLOCK};
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::model::ModelConfig;
use crate::sched::scripted::{ScriptedModel, ScriptedReplies};
use crate::sched::{spawn_engine, EngineHandle, SchedulerConfig};
use crate::text::tokenizer::TokenizerPool;
use crate::text::{ChatTemplate, TextTokenizer};
use crate::weights::gguf::GgufFile;
use crate::weights::{HostTensor, TensorSource, WeightError};
use anyhow::{anyhow, bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// A GGUF file (e.g. the SmolLM2 one: `python3 scripts/smollm2_gguf_path.py`) or an HF checkpoint dir.
    #[arg(long)]
    pub model: PathBuf,
    /// Name clients pass as `model` (default: the file or directory name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer <key>` on /v1/*. Visible in `ps`: prefer --api-key-file or
    /// the MOE_API_KEY environment variable.
    #[arg(long, env = "MOE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Read the API key from this file (first line; e.g. a mounted Kubernetes Secret).
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// Require the API key on /metrics too (Prometheus then needs `authorization: {credentials: …}`).
    #[arg(long)]
    pub protect_metrics: bool,
    /// Largest request body in bytes; a larger `Content-Length` is refused (413) before reading.
    #[arg(long, default_value_t = api::DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Seconds a client has to send its request headers.
    #[arg(long, default_value_t = 15)]
    pub header_read_timeout_s: u64,
    /// Seconds a client has to send its request body once the headers are in.
    #[arg(long, default_value_t = 60)]
    pub body_read_timeout_s: u64,
    /// Open connections served at once; more wait in the listen backlog.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Tokens computed per engine step (prefill chunks + decode tokens).
    #[arg(long, alias = "max-num-batched-tokens", default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, alias = "max-num-seqs", default_value_t = 64)]
    pub max_running: usize,
    /// Checkpoint file format the caller expects (safetensors or gguf); checked against --model.
    #[arg(long)]
    pub weight_format: Option<String>,
    /// Requests that may wait for a slot; more get 429.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    #[arg(long, default_value_t = 32)]
    pub prefix_cache_entries: usize,
    /// KV positions the prefix cache may hold; taken from --kv-cache-tokens (0 turns caching off).
    #[arg(long, default_value_t = 8192)]
    pub prefix_cache_tokens: usize,
    /// Context length cap (default: the model's).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    #[arg(long, default_value_t = 600)]
    pub request_timeout_s: u64,
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout_s: u64,
    /// Split `<think>…</think>` into `reasoning_content`: auto (when the vocabulary has `</think>`), on, off.
    #[arg(long, default_value = "auto")]
    pub reasoning_parser: String,
    /// Reasoning tokens a request may spend before the server writes `</think>` for the model, when the
    /// request gives no `thinking_token_budget` (which wins): -1 unrestricted (the default; constrained
    /// answers still get half of max_tokens), 0 ends reasoning at once, N > 0 a budget (llama.cpp's
    /// `--reasoning-budget`).
    #[arg(long, default_value = "-1", allow_negative_numbers = true)]
    pub reasoning_budget: api::thinking::ReasoningBudget,
    /// Special-token strings typed in chat messages and tools: `parse` turns them into control tokens
    /// (vLLM's behaviour; a user can then open a system turn), `text` tokenises them as the text they
    /// are while the template's own markers stay control tokens.
    #[arg(long, default_value = "parse")]
    pub client_special_tokens: String,
    /// Chat template file overriding the model's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Browser origins allowed to call the API (CORS), comma-separated or repeated; `*` allows any.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Sampling defaults for fields a request leaves out: `auto` reads the model directory's
    /// `generation_config.json` (as vLLM does); `none` ignores it. `--default-*` flags win over both.
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    #[arg(long)]
    pub default_temperature: Option<f32>,
    #[arg(long)]
    pub default_top_p: Option<f32>,
    #[arg(long)]
    pub default_top_k: Option<i64>,
    #[arg(long)]
    pub default_min_p: Option<f32>,
    #[arg(long)]
    pub default_repetition_penalty: Option<f32>,
    /// Completion length when a request gives none (default: the rest of the context).
    #[arg(long)]
    pub default_max_tokens: Option<usize>,
    /// When prompt + max_tokens exceed the context, shorten max_tokens to fit (llama.cpp's behaviour)
    /// instead of answering 400 context_length_exceeded (vLLM's, the default).
    #[arg(long)]
    pub clamp_max_tokens: bool,
    /// Most tools one request may carry; more get 400 before they are rendered or tokenised. A tool
    /// list whose names (or, for templates that ignore tools, whole JSON) cannot fit the context is
    /// refused as early, with `context_length_exceeded`.
    #[arg(long, default_value_t = api::tools::DEFAULT_MAX_TOOLS)]
    pub max_tools: usize,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// TEST DOUBLE: instead of the model's weights, answer with scripted replies from this JSON file
    /// (`{"replies": [{"trigger": "...", "reply": "..."}], "step_delay_ms": 0}`), tokenised with the
    /// model's tokenizer. Lets HTTP tests exercise tool-call and reasoning output the real model never emits.
    #[arg(long)]
    pub scripted_replies: Option<PathBuf>,
}

/// Counts tensors as the engine loads them, for the progress bar.
struct ProgressSource<'a> {
    inner: &'a dyn TensorSource,
    bar: ProgressBar,
}

impl TensorSource for ProgressSource<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let t = self.inner.load(name);
        self.bar.inc(1);
        self.bar.set_message(name.to_string());
        t
    }
}

fn progress_bar(len: Option<u64>) -> ProgressBar {
    let bar = match len {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template(
                "loading weights {bar:40} {pos}/{len} tensors {elapsed} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        ),
        None => ProgressBar::new_spinner().with_message("loading weights"),
    };
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// What the model path provides before the weights load.
struct ModelFiles {
    tokenizer: Option<TextTokenizer>,
    max_positions: usize,
    gguf: Option<Arc<GgufFile>>,
    name: String,
    /// config.json's `architectures[0]` (for a GGUF file, the architecture it maps to).
    architecture: String,
}

fn open_model(path: &Path) -> anyhow::Result<ModelFiles> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".into());
    if path.is_dir() {
        let tokenizer = TextTokenizer::from_hf_dir(path)?;
        let cfg = ModelConfig::from_dir(path)?;
        return Ok(ModelFiles {
            tokenizer: Some(tokenizer),
            max_positions: cfg.max_position_embeddings,
            gguf: None,
            name,
            architecture: cfg.arch_name.clone(),
        });
    }
    let g = GgufFile::open(path)?;
    let tokenizer = TextTokenizer::from_gguf(&g)?;
    let cfg = g.hf_config()?;
    let max_positions = cfg["max_position_embeddings"].as_u64().unwrap_or(2048) as usize;
    let architecture = cfg["architectures"][0]
        .as_str()
        .unwrap_or_default()
        .to_string();
    Ok(ModelFiles {
        tokenizer: Some(tokenizer),
        max_positions,
        gguf: Some(Arc::new(g)),
        name,
        architecture,
    })
}

fn start_engine(
    args: &ServeArgs,
    files: &ModelFiles,
    gguf: Option<Arc<GgufFile>>,
    tok: &TextTokenizer,
    metrics: Arc<Metrics>,
    load_failed: LoadFailed,
) -> anyhow::Result<EngineHandle> {
    let sched = SchedulerConfig {
        max_batch_tokens: args.max_batch_tokens,
        max_running: args.max_running,
        max_waiting: args.max_waiting,
        prefix_cache_entries: args.prefix_cache_entries,
        prefix_cache_tokens: args.prefix_cache_tokens,
    };
    if let Some(script) = &args.scripted_replies {
        let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(script)?)
            .with_context(|| format!("reading {}", script.display()))?;
        let mut replies = Vec::new();
        for r in spec["replies"].as_array().into_iter().flatten() {
            let (Some(t), Some(reply)) = (r["trigger"].as_str(), r["reply"].as_str()) else {
                bail!(
                    "{}: each reply needs string `trigger` and `reply`",
                    script.display()
                );
            };
            replies.push((tok.encode(t)?, tok.encode(reply)?));
        }
        let model = ScriptedModel::new(ScriptedReplies {
            replies,
            end_token: tok.stop_token_ids.first().copied().unwrap_or(0),
            vocab: tok.vocab_size(),
            max_positions: files.max_positions,
            kv_cache_tokens: args.engine.kv_tokens_or(65536),
            step_delay: Duration::from_millis(spec["step_delay_ms"].as_u64().unwrap_or(0)),
            step_stats: None,
        });
        tracing::warn!(
            "serving SCRIPTED replies from {} (test double, no weights)",
            script.display()
        );
        return Ok(spawn_engine(move || Ok(model), sched, metrics));
    }
    let opts = args.engine.serving_options(
        context_len(args, files),
        args.max_running,
        args.max_batch_tokens,
    )?;
    let path = args.model.clone();
    Ok(spawn_engine(
        report_load(load_failed, move || {
            let t0 = std::time::Instant::now();
            let engine = match gguf {
                Some(g) => {
                    let cfg = g.hf_config()?;
                    let bar = progress_bar(Some(g.tensors.len() as u64));
                    let src = ProgressSource {
                        inner: &*g,
                        bar: bar.clone(),
                    };
                    let e = Engine::from_source(&cfg, &src, &opts);
                    bar.finish_and_clear();
                    e?
                }
                None => {
                    let bar = progress_bar(None);
                    let e = Engine::load(&path, &opts);
                    bar.finish_and_clear();
                    e?
                }
            };
            tracing::info!(seconds = t0.elapsed().as_secs_f64(), "weights loaded");
            if let Some(m) = crate::engine::heap::MemoryReport::now() {
                tracing::info!("host memory once loaded and warm: {m}");
            }
            Ok(engine)
        }),
        sched,
        metrics,
    ))
}

/// Where a failed load is reported: the server exits with this message.
type LoadFailed = tokio::sync::watch::Sender<Option<String>>;

/// Runs `load` on the engine thread, turning a panic into an error, and reports any failure to the
/// server so that the process exits instead of serving 503s forever.
fn report_load<M>(
    failed: LoadFailed,
    load: impl FnOnce() -> anyhow::Result<M> + Send + 'static,
) -> impl FnOnce() -> anyhow::Result<M> + Send + 'static {
    move || {
        let result = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(load)) {
            Ok(r) => r,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown panic");
                Err(anyhow!("the loader panicked: {msg}"))
            }
        };
        if let Err(e) = &result {
            failed.send_replace(Some(format!("{e:#}")));
        }
        result
    }
}

/// `--weight-format` (as the operator passes it) must agree with what `--model` is.
fn check_weight_format(format: Option<&str>, model: &Path) -> anyhow::Result<()> {
    let is_gguf = model
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    match format {
        None => Ok(()),
        Some("gguf") if is_gguf => Ok(()),
        Some("safetensors") if !is_gguf => Ok(()),
        Some(f @ ("gguf" | "safetensors")) => anyhow::bail!(
            "--weight-format {f} does not match --model {} ({})",
            model.display(),
            if is_gguf {
                "a GGUF file"
            } else {
                "a safetensors directory"
            }
        ),
        Some(f) => anyhow::bail!("--weight-format {f}: choose safetensors or gguf"),
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .try_init();
    check_weight_format(args.weight_format.as_deref(), &args.model)?;
    let mut files =
        open_model(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
    let mut tokenizer = files.tokenizer.take().context("tokenizer missing")?;
    match args.client_special_tokens.as_str() {
        "parse" => {}
        "text" => tokenizer.keep_client_specials_literal(),
        other => bail!("--client-special-tokens must be parse or text, got {other}"),
    }
    let tokenizer = Arc::new(tokenizer);
    let from_flag = match &args.chat_template {
        Some(p) => {
            Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)
        }
        None => None,
    };
    let template_src = crate::text::chat_template::choose_source(
        from_flag,
        tokenizer.chat_template.as_deref(),
        &files.architecture,
    );
    let glm_tool_format = template_src
        .as_deref()
        .is_some_and(|t| t.contains("<arg_key>"));
    let template = template_src
        .map(|s| {
            ChatTemplate::new(
                &s,
                tokenizer.bos_token.as_deref(),
                tokenizer.eos_token.as_deref(),
            )
        })
        .transpose()?;
    let reasoning = match args.reasoning_parser.as_str() {
        "on" => true,
        "off" => false,
        "auto" => tokenizer.token_to_id("</think>").is_some(),
        other => bail!("--reasoning-parser must be auto, on or off, got {other}"),
    };
    if args.reasoning_budget.0.is_some() && !reasoning {
        tracing::warn!("--reasoning-budget has no effect: the reasoning parser is off (--reasoning-parser on turns it on)");
    }
    let metrics = Arc::new(Metrics::new()?);
    let sampling_defaults = sampling_defaults(&args)?;
    let structured = structured_outputs(&tokenizer);
    let (load_failed, load_failure) = tokio::sync::watch::channel(None);
    // The engine's load owns the GGUF mapping from here on and drops it once the weights are
    // packed or uploaded: held here, every page the load touched would stay mapped (resident) for
    // the life of the server.
    let gguf = files.gguf.take();
    let engine = start_engine(
        &args,
        &files,
        gguf,
        &tokenizer,
        metrics.clone(),
        load_failed,
    )?;
    let api_key = match &args.api_key_file {
        Some(p) => Some(read_key_file(p)?),
        None => args.api_key.clone(),
    };
    if args.protect_metrics && api_key.is_none() {
        bail!("--protect-metrics needs an API key (--api-key-file, --api-key or MOE_API_KEY)");
    }
    let (deadline_tx, deadline_passed) = tokio::sync::watch::channel(false);
    // A request must fit the context and, alone, the KV cache (the scheduler preempts to make room
    // for it, but cannot make the cache larger): longer ones get a 400 before they are queued.
    // (`--kv-cache-tokens auto` plans at least one such sequence or refuses to start)
    let context = context_len(&args, &files);
    let max_context = context.min(kv_capacity_positions(args.engine.kv_tokens_or(context)));
    let state = Arc::new(AppState {
        served_model: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| files.name.clone()),
        vocab_size: tokenizer.vocab_size(),
        tokenizer: tokenizer.clone(),
        template,
        engine,
        metrics,
        api_key,
        max_context,
        reasoning,
        request_timeout: Duration::from_secs(args.request_timeout_s),
        retry_after_s: 1,
        draining: Default::default(),
        created: api::generate::now_unix(),
        structured,
        glm_tool_format,
        tokenize_pool: TokenizerPool::new(tokenizer.clone(), TokenizerPool::default_slots()),
        limits: HttpLimits::new(
            args.max_body_bytes,
            Duration::from_secs(args.body_read_timeout_s),
            LARGE_BODIES_AT_ONCE,
        ),
        protect_metrics: args.protect_metrics,
        deadline_passed,
        sampling_defaults,
        clamp_max_tokens: args.clamp_max_tokens,
        default_thinking_budget: args.reasoning_budget.0,
        tool_limits: api::tools::ToolLimits::new(
            args.max_tools,
            tokenizer
                .hf_tokenizer()
                .get_vocab(true)
                .keys()
                .map(String::as_str),
        ),
        allowed_origins: args.allowed_origins.clone(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(serve(args, state, load_failure, deadline_tx))
}

/// `generation_config.json` (with `--generation-config auto`, HF directories) under the `--default-*`
/// flags.
fn sampling_defaults(args: &ServeArgs) -> anyhow::Result<api::types::SamplingDefaults> {
    use api::types::SamplingDefaults;
    let from_model = match args.generation_config.as_str() {
        "none" => SamplingDefaults::default(),
        "auto" => {
            let path = args.model.join("generation_config.json");
            match std::fs::read_to_string(&path) {
                Ok(text) => {
                    let cfg: serde_json::Value = serde_json::from_str(&text)
                        .with_context(|| format!("parsing {}", path.display()))?;
                    let d = SamplingDefaults::from_generation_config(&cfg);
                    tracing::info!(?d, "sampling defaults from generation_config.json");
                    d
                }
                Err(_) => SamplingDefaults::default(),
            }
        }
        other => bail!("--generation-config must be auto or none, got {other}"),
    };
    Ok(from_model.overridden_by(SamplingDefaults {
        temperature: args.default_temperature,
        top_p: args.default_top_p,
        top_k: args.default_top_k,
        min_p: args.default_min_p,
        repetition_penalty: args.default_repetition_penalty,
        max_tokens: args.default_max_tokens,
    }))
}

/// llguidance's view of the vocabulary; without it JSON-schema and forced-tool requests get 400.
fn structured_outputs(tok: &TextTokenizer) -> Option<Arc<api::structured::StructuredOutputs>> {
    let t0 = std::time::Instant::now();
    match api::structured::StructuredOutputs::new(tok, tok.vocab_size()) {
        Ok(s) => {
            tracing::info!(
                seconds = t0.elapsed().as_secs_f64(),
                "structured output (llguidance) ready"
            );
            Some(Arc::new(s))
        }
        Err(e) => {
            tracing::warn!(error = %e, "structured output unavailable for this tokenizer");
            None
        }
    }
}

/// The key from `--api-key-file`: its first line, which must not be empty.
fn read_key_file(path: &Path) -> anyhow::Result<String> {
    let text = crate::weights::read_text_file(path, 64 << 10)
        .with_context(|| format!("reading the API key from {}", path.display()))?;
    let key = text.lines().next().unwrap_or("").trim();
    if key.is_empty() {
        bail!("{}: the API key file is empty", path.display());
    }
    Ok(key.to_string())
}

/// Resolves with the cause when the engine thread reports a failed load; never otherwise (the
/// sender is dropped without a report once the model is up, or when no weights are loaded).
async fn load_failed(rx: &mut tokio::sync::watch::Receiver<Option<String>>) -> String {
    match rx.wait_for(Option::is_some).await {
        Ok(cause) => cause.clone().unwrap_or_default(),
        Err(_) => std::future::pending().await,
    }
}

/// Bodies over 1 MiB held at once (at most 8 × --max-body-bytes in memory); tokenising them is
/// bounded separately by the tokenizer pool.
const LARGE_BODIES_AT_ONCE: usize = 8;

/// How long streams cut by the shutdown deadline get to send their error event and `[DONE]`.
const CUT_STREAMS_GRACE: Duration = Duration::from_secs(2);

async fn serve(
    args: ServeArgs,
    state: Arc<AppState>,
    mut load_failure: tokio::sync::watch::Receiver<Option<String>>,
    deadline_tx: tokio::sync::watch::Sender<bool>,
) -> anyhow::Result<()> {
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, model = %state.served_model, "serving the OpenAI API");
    let (drain_tx, mut drain_rx) = tokio::sync::watch::channel(false);
    let st = state.clone();
    let limits = conn::ConnLimits {
        header_read_timeout: Duration::from_secs(args.header_read_timeout_s.max(1)),
        max_connections: args.max_connections,
    };
    let server = conn::serve_http1(listener, api::router(state.clone()), limits, async move {
        shutdown_signal().await;
        st.draining.store(true, Ordering::Release);
        tracing::info!("shutdown requested: refusing new requests, finishing in-flight ones");
        let _ = drain_tx.send(true);
    });
    let mut server = std::pin::pin!(server);
    let deadline = Duration::from_secs(args.shutdown_timeout_s);
    tokio::select! {
        _ = &mut server => {}
        cause = load_failed(&mut load_failure) => bail!("the model failed to load: {cause}"),
        _ = async {
            let _ = drain_rx.wait_for(|d| *d).await;
            tokio::time::sleep(deadline).await;
        } => {
            tracing::warn!(?deadline, "shutdown deadline passed with requests in flight; ending them");
            let _ = deadline_tx.send(true);
            let _ = tokio::time::timeout(CUT_STREAMS_GRACE, &mut server).await;
            bail!("the shutdown deadline ({deadline:?}) passed with requests still running");
        }
    }
    tracing::info!("server stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// The longest sequence served: --max-model-len, at most the model's positions.
fn context_len(args: &ServeArgs, files: &ModelFiles) -> usize {
    args.max_model_len
        .map_or(files.max_positions, |m| m.min(files.max_positions))
}

/// Positions the engine's KV cache holds for `--kv-cache-tokens` (whole blocks).
fn kv_capacity_positions(kv_cache_tokens: usize) -> usize {
    blocks_for(kv_cache_tokens).max(1) * BLOCK
}

#[cfg(test)]
mod operator_contract_tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        serve: ServeArgs,
    }

    /// The argument list the operator's StatefulSet builder renders must parse and validate here.
    #[test]
    fn operator_rendered_args_parse() {
        let argv = [
            "moe-daemon",
            "--model",
            "/models/Qwen--Qwen3-30B-A3B",
            "--served-model-name",
            "qwen3",
            "--weight-format",
            "safetensors",
            "--gpu-experts",
            "15",
            "--expert-placement",
            "frequency",
            "--cpu-threads",
            "29",
            "--numa",
            "auto",
            "--hugepages",
            "1G",
            "--max-model-len",
            "32768",
            "--max-num-seqs",
            "16",
            "--max-num-batched-tokens",
            "8192",
            "--port",
            "8000",
            "--host",
            "0.0.0.0",
            "--device",
            "cuda",
        ];
        let w = Wrapper::try_parse_from(argv).expect("operator args parse");
        assert_eq!(w.serve.max_running, 16);
        assert_eq!(w.serve.max_batch_tokens, 8192);
        assert!(w.serve.engine.options().is_ok());
        assert!(check_weight_format(Some("safetensors"), &w.serve.model).is_ok());
        assert!(check_weight_format(Some("gguf"), &w.serve.model).is_err());
        assert!(check_weight_format(Some("onnx"), &w.serve.model).is_err());
    }
}
