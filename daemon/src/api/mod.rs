//! The OpenAI-compatible HTTP server (axum): `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/tokenize`, `/detokenize`, `/metrics`, `/health`, `/ready`. Handlers validate and tokenise, then hand sequences to the engine
//! thread through [`crate::sched::EngineHandle`]; responses are whole JSON or SSE streams.
//!
//! Server-level layers on `/v1/*` and `/tokenize`, outermost first: the API key (before any body is
//! read), the drain refusal, then the body read (a `Content-Length` over the limit is refused before
//! reading; the body must arrive within the read timeout; large bodies are read and tokenised a few
//! at a time). Every error, 404 / 405 / 413 included, is OpenAI's JSON error object.
pub mod chat;
pub mod choice;
pub mod completions;
pub mod error;
pub mod generate;
pub mod glm_calls;
pub mod grammar;
pub mod mask_worker;
pub mod plan;
pub mod raw_text;
pub mod reasoning;
pub mod responses;
mod string_formats;
pub mod structured;
pub mod thinking;
pub mod tokenize;
pub mod tool_parser;
pub mod tools;
pub mod types;

#[cfg(test)]
#[path = "glm5_format_tests.rs"]
mod glm5_format_tests;

use crate::metrics::Metrics;
use crate::sched::EngineHandle;
use crate::text::tokenizer::{EncodeError, TokenizerPool};
use crate::text::{ChatTemplate, TextTokenizer};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use error::ApiError;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};

pub struct AppState {
    pub served_model: String,
    pub tokenizer: Arc<TextTokenizer>,
    pub template: Option<ChatTemplate>,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    /// Bearer token required on `/v1/*` when set.
    pub api_key: Option<String>,
    pub max_context: usize,
    pub vocab_size: usize,
    /// Split `<think>` blocks into `reasoning_content`.
    pub reasoning: bool,
    pub request_timeout: Duration,
    pub retry_after_s: u64,
    /// Set on SIGTERM: new requests get 503 while in-flight ones finish.
    pub draining: AtomicBool,
    pub created: u64,
    /// Grammar-constrained decoding (JSON schema, tool calls); None when the tokenizer could not be
    /// mapped to bytes (then such requests get 400).
    pub structured: Option<Arc<structured::StructuredOutputs>>,
    /// The chat template writes tool calls in GLM's XML form (GLM-4.5 … 5.x), not Hermes JSON.
    pub glm_tool_format: bool,
    /// Sampling values used where a request leaves them out.
    pub sampling_defaults: types::SamplingDefaults,
    /// Bounds on a request's tools, checked before they are rendered or tokenised.
    pub tool_limits: tools::ToolLimits,
    /// Clamp `max_tokens` to what fits the context instead of refusing the request.
    pub clamp_max_tokens: bool,
    /// Reasoning budget of requests that give no `thinking_token_budget` (`--reasoning-budget`);
    /// `None`: unrestricted.
    pub default_thinking_budget: Option<usize>,
    /// Browser origins allowed by CORS (`*` for any); empty: no CORS headers.
    pub allowed_origins: Vec<String>,
    /// Prompts are tokenised here, off the async runtime.
    pub tokenize_pool: TokenizerPool,
    pub limits: HttpLimits,
    /// `/metrics` requires the API key too.
    pub protect_metrics: bool,
    /// Becomes true when the shutdown deadline passes: requests still running end with an error
    /// (streams: an error event, then `[DONE]`) instead of being cut mid-response.
    pub deadline_passed: watch::Receiver<bool>,
}

/// Limits on request bodies.
pub struct HttpLimits {
    pub max_body_bytes: usize,
    /// The whole body must arrive within this time once the headers are in.
    pub body_read_timeout: Duration,
    /// Bodies over [`LARGE_BODY_BYTES`] (or of unknown length) read and processed at once.
    pub large_bodies: Semaphore,
}

/// Above this a body counts as large: it is read, parsed and tokenised under a slot of
/// [`HttpLimits::large_bodies`] (a 24 MiB prompt costs ~1.5 GB while it is tokenised).
pub const LARGE_BODY_BYTES: u64 = 1 << 20;

impl HttpLimits {
    pub fn new(max_body_bytes: usize, body_read_timeout: Duration, large_slots: usize) -> Self {
        Self {
            max_body_bytes,
            body_read_timeout,
            large_bodies: Semaphore::new(large_slots.max(1)),
        }
    }
}

impl AppState {
    /// 404 for a model this server does not serve (a missing `model` means the served one).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.served_model => Err(ApiError::model_not_found(m)),
            _ => Ok(()),
        }
    }

    /// Tokenises a prompt on the tokenizer pool; a prompt that cannot fit the context is refused
    /// (OpenAI's `context_length_exceeded`) without tokenising all of it.
    pub async fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        let ctx = self.max_context;
        self.tokenize_pool
            .encode_within(text.to_owned(), ctx)
            .await
            .map_err(|e| encode_error(ctx, e))
    }

    /// [`Self::encode_prompt`] for code already on a blocking thread (request planning).
    pub fn encode_prompt_blocking(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        let ctx = self.max_context;
        self.tokenizer
            .encode_within(text, ctx)
            .map_err(|e| encode_error(ctx, e))
    }

    /// Resolves when the shutdown deadline has passed (never, while the server runs normally).
    pub async fn shutdown_deadline_passed(&self) {
        let mut rx = self.deadline_passed.clone();
        if rx.wait_for(|passed| *passed).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

fn encode_error(ctx: usize, e: EncodeError) -> ApiError {
    match e {
        EncodeError::TooLong { at_least, .. } => ApiError::context_length(format!(
            "This model's maximum context length is {ctx} tokens. However, your messages \
             resulted in at least {at_least} tokens. Please reduce the length of the messages."
        )),
        EncodeError::Text(e) => ApiError::bad_request(e.to_string()),
        e @ EncodeError::PoolClosed => ApiError::unavailable(e.to_string()),
    }
}

/// Largest request body accepted by default (long prompts as JSON).
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;

pub fn router(state: Arc<AppState>) -> Router {
    // route_layer: the layer added last runs first, so the key is checked before a body is read.
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), read_body))
        .route_layer(middleware::from_fn_with_state(state.clone(), gate));
    let mut metrics_route = Router::new().route("/metrics", get(metrics));
    if state.protect_metrics {
        metrics_route =
            metrics_route.route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    }
    let cors = cors_layer(&state.allowed_origins);
    Router::new()
        .merge(v1)
        .merge(metrics_route)
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .fallback(|| async {
            ApiError::bad_request("unknown endpoint").with_status(StatusCode::NOT_FOUND)
        })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::bad_request(format!(
                "method {} is not allowed on {}",
                req.method(),
                req.uri().path()
            ))
            .with_status(StatusCode::METHOD_NOT_ALLOWED)
        })
        .layer(axum::extract::DefaultBodyLimit::max(
            state.limits.max_body_bytes,
        ))
        .layer(cors)
        .with_state(state)
}

/// CORS for browser clients: `--allowed-origins` (`*` for any). Preflight requests are answered
/// before the API-key check, as browsers send them without credentials.
fn cors_layer(origins: &[String]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, Any, CorsLayer};
    if origins.is_empty() {
        return CorsLayer::new();
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| o.parse().ok()))
    };
    CorsLayer::new()
        .allow_origin(allow)
        .allow_methods(Any)
        .allow_headers(Any)
}

impl ApiError {
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }
}

/// `Authorization: Bearer <key>` (scheme case-insensitive, as RFC 7235 says) against the key, in
/// time that does not depend on where the two first differ.
pub fn bearer_matches(headers: &axum::http::HeaderMap, key: &str) -> bool {
    use subtle::ConstantTimeEq;
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some((scheme, token)) = value.trim().split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && bool::from(token.trim().as_bytes().ct_eq(key.as_bytes()))
}

/// The API key check alone (for `/metrics` when it is protected).
async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match &state.api_key {
        Some(key) if !bearer_matches(req.headers(), key) => {
            ApiError::unauthorized().into_response()
        }
        _ => next.run(req).await,
    }
}

/// API key check and drain refusal for `/v1/*`.
async fn gate(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        if !bearer_matches(req.headers(), key) {
            return ApiError::unauthorized().into_response();
        }
    }
    if state.draining.load(Ordering::Acquire) && req.method() == axum::http::Method::POST {
        return ApiError::unavailable("the server is shutting down").into_response();
    }
    next.run(req).await
}

/// Reads the whole request body before the handler runs: a declared length over the limit is a 413
/// without reading a byte, a body that does not arrive within the read timeout is a 408, and large
/// bodies wait for a slot so that only a few are held and tokenised at once.
async fn read_body(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let limits = &state.limits;
    if req.method() == axum::http::Method::GET || req.method() == axum::http::Method::HEAD {
        return next.run(req).await;
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return ApiError::payload_too_large(limits.max_body_bytes).into_response();
    }
    let _large_slot = match declared {
        Some(n) if n <= LARGE_BODY_BYTES => None,
        _ => limits.large_bodies.acquire().await.ok(),
    };
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, limits.max_body_bytes);
    let read = tokio::time::timeout(
        limits.body_read_timeout,
        http_body_util::BodyExt::collect(limited),
    );
    let bytes = match read.await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return ApiError::payload_too_large(limits.max_body_bytes).into_response()
        }
        Ok(Err(e)) => {
            return ApiError::bad_request(format!("could not read the request body: {e}"))
                .into_response()
        }
        Err(_) => {
            return ApiError::bad_request(format!(
                "the request body did not arrive within {} s",
                limits.body_read_timeout.as_secs_f64()
            ))
            .with_status(StatusCode::REQUEST_TIMEOUT)
            .into_response()
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

fn model_card(state: &AppState) -> serde_json::Value {
    json!({"id": state.served_model, "object": "model", "created": state.created,
           "owned_by": "moe-daemon", "root": state.served_model, "max_model_len": state.max_context})
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
}

/// GET /v1/models/{id} (`client.models.retrieve`).
async fn model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    state.check_model(Some(&id))?;
    Ok(axum::Json(model_card(&state)).into_response())
}

async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.is_ready() && !state.draining.load(Ordering::Acquire) {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
