//! vLLM's `/tokenize` (a prompt, or chat `messages` rendered through the template as a chat request
//! would be) and `/detokenize`.
use super::error::ApiError;
use super::tools::{check_messages, inject_hermes_tools, Tools};
use super::types::parse_body;
use super::AppState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::Arc;

#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Value>>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(default)]
    return_token_strs: bool,
}

/// `{"prompt": "..."}` or `{"messages": [...]}` → `{"count", "tokens", "max_model_len"}`
/// (and `token_strs` on request).
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: TokenizeRequest = parse_body(&body)?;
    state.check_model(req.model.as_deref())?;
    let want_strs = req.return_token_strs;
    let st = state.clone();
    let text = tokio::task::spawn_blocking(move || text_of(&st, req))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    // On the bounded tokenizer pool; a text far beyond the context is refused without tokenising it all.
    let tokens = state.encode_prompt(&text).await?;
    let mut out =
        json!({"count": tokens.len(), "tokens": tokens, "max_model_len": state.max_context});
    if want_strs {
        let strs: Vec<String> = tokens
            .iter()
            .map(|&t| state.tokenizer.id_to_token(t).unwrap_or_default())
            .collect();
        out["token_strs"] = json!(strs);
    }
    Ok(axum::Json(out).into_response())
}

/// The text to tokenise: the prompt, or the messages rendered by the chat template.
fn text_of(state: &AppState, mut req: TokenizeRequest) -> Result<String, ApiError> {
    Ok(match (req.prompt.take(), req.messages.take()) {
        (Some(p), None) => p,
        (None, Some(mut messages)) => {
            let template = state.template.as_ref().ok_or_else(|| {
                ApiError::bad_request("this model has no chat template; send `prompt`")
            })?;
            check_messages(&mut messages, template.knows_developer_role)?;
            let tools = Tools::parse(req.tools.as_deref(), None, None)?;
            let (messages, template_tools) = match &tools {
                Some(t) if !template.renders_tools => {
                    (inject_hermes_tools(&messages, &t.raw), None)
                }
                Some(t) => (messages, Some(t.raw.as_slice())),
                None => (messages, None),
            };
            template
                .render(
                    &messages,
                    template_tools,
                    req.add_generation_prompt.unwrap_or(true),
                    &req.chat_template_kwargs.clone().unwrap_or_default(),
                )
                .map_err(|e| ApiError::bad_request(e.to_string()))?
        }
        _ => {
            return Err(ApiError::bad_request(
                "send exactly one of `prompt` and `messages`",
            ))
        }
    })
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `{"tokens": [...]}` → `{"prompt": "..."}` (special tokens kept, as vLLM does).
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: DetokenizeRequest = parse_body(&body)?;
    state.check_model(req.model.as_deref())?;
    let vocab = state.vocab_size;
    if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_param(
            "tokens",
            format!("token id {bad} is outside the vocabulary (size {vocab})"),
        ));
    }
    let text = state
        .tokenizer
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(axum::Json(json!({"prompt": text})).into_response())
}
