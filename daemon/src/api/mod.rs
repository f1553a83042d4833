//! The OpenAI-compatible HTTP server (axum): `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/tokenize`, `/detokenize`, `/metrics`, `/health`, `/ready`. Handlers validate and
//! tokenise, then hand sequences to the engine thread through [`crate::sched::EngineHandle`];
//! responses are whole JSON or SSE streams.
pub mod chat;
pub mod choice;
pub mod completions;
pub mod error;
pub mod generate;
pub mod grammar;
pub mod plan;
pub mod reasoning;
pub mod responses;
pub mod structured;
pub mod tokenize;
pub mod tool_parser;
pub mod tools;
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
    /// Grammar-constrained decoding (JSON schema, tool calls); None when the tokenizer could not be
    /// mapped to bytes (then such requests get 400).
    pub structured: Option<Arc<structured::StructuredOutputs>>,
    /// The chat template writes tool calls in GLM-4.5's XML form (then `tool_choice` is not enforced).
    pub glm_tool_format: bool,
    /// Sampling values used where a request leaves them out.
    pub sampling_defaults: types::SamplingDefaults,
    /// Clamp `max_tokens` to what fits the context instead of refusing the request.
    pub clamp_max_tokens: bool,
    /// Browser origins allowed by CORS (`*` for any); empty: no CORS headers.
    pub allowed_origins: Vec<String>,
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
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), gate));
    let cors = cors_layer(&state.allowed_origins);
    Router::new()
        .merge(v1)
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::bad_request("unknown endpoint").with_status(StatusCode::NOT_FOUND)
        })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
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
