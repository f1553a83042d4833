//! The OpenAI-compatible HTTP server (axum): `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
//! `/metrics`, `/health`, `/ready`. Handlers validate and tokenise, then hand sequences to the engine
//! thread through [`crate::sched::EngineHandle`]; responses are whole JSON or SSE streams.
pub mod chat;
pub mod choice;
pub mod completions;
pub mod error;
pub mod forced_tool;
pub mod generate;
pub mod json_mode;
pub mod reasoning;
pub mod tool_parser;
pub mod types;

use crate::metrics::Metrics;
use crate::sched::EngineHandle;
use crate::text::{ChatTemplate, TextTokenizer};
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
    /// Every token's text, for JSON-mode and forced-tool-call constraints.
    pub token_texts: Arc<Vec<String>>,
    /// The chat template writes tool calls in GLM-4.5's XML form (then `tool_choice` is not enforced).
    pub glm_tool_format: bool,
}

impl AppState {
    /// 404 for a model this server does not serve (a missing `model` means the served one).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.served_model => Err(ApiError::model_not_found(m)),
            _ => Ok(()),
        }
    }
}

/// Largest request body accepted (long prompts as JSON).
const MAX_BODY_BYTES: usize = 32 << 20;

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/tokenize", post(tokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), gate));
    Router::new()
        .merge(v1)
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::bad_request("unknown endpoint").with_status(StatusCode::NOT_FOUND)
        })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

impl ApiError {
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }
}

/// API key check and drain refusal for `/v1/*`.
async fn gate(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return ApiError::unauthorized().into_response();
        }
    }
    if state.draining.load(Ordering::Acquire) && req.method() == axum::http::Method::POST {
        return ApiError::unavailable("the server is shutting down").into_response();
    }
    next.run(req).await
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{
        "id": state.served_model, "object": "model", "created": state.created, "owned_by": "moe-daemon",
        "max_model_len": state.max_context,
    }]}))
    .into_response()
}

/// vLLM's `/tokenize`: `{"prompt": "..."}` → `{"tokens": [...], "count": n, "max_model_len": m}`.
async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Req {
        prompt: String,
    }
    let req: Req = types::parse_body(&body)?;
    let tokens = state
        .tokenizer
        .encode(&req.prompt)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(axum::Json(
        json!({"count": tokens.len(), "tokens": tokens, "max_model_len": state.max_context}),
    )
    .into_response())
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
