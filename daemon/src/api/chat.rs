//! POST /v1/chat/completions.
use super::choice::{ChoiceDelta, LogprobEntry};
use super::error::ApiError;
use super::generate::{now_unix, request_id, submit};
use super::plan::plan_off_thread;
use super::tool_parser::ToolCall;
use super::types::{chat_logprobs, parse_body, ChatRequest};
use super::AppState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::Arc;

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(&body)?;
    state.check_model(req.common.model.as_deref())?;
    let stream = req.common.stream;
    let include_usage = req.common.include_usage();
    let logprobs = chat_logprobs(req.logprobs, req.top_logprobs)?;
    let n = req.common.n()?;
    let job = plan_off_thread(&state, req).await?;
    let id = request_id("chatcmpl");
    let running = submit(&state, &id, job)?;
    let created = now_unix();
    let model = state.served_model.clone();
    if stream {
        let head = move |choices: Value, usage: Option<Value>| {
            let mut v = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices});
            if include_usage {
                v["usage"] = usage.unwrap_or(Value::Null);
            }
            v
        };
        let first = (0..n)
            .map(|i| head(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]), None))
            .collect();
        let head2 = head.clone();
        let chunk = move |i: usize, d: &ChoiceDelta, finish: Option<&str>| {
            let mut delta = json!({});
            if !d.content.is_empty() {
                delta["content"] = json!(d.content);
            }
            if !d.reasoning.is_empty() {
                delta["reasoning_content"] = json!(d.reasoning);
            }
            if !d.calls.is_empty() {
                delta["tool_calls"] = tool_calls_json(&d.calls, Some(d.first_call_index));
            }
            let lp = (logprobs.is_some() && !d.logprobs.is_empty())
                .then(|| json!({"content": logprobs_json(&d.logprobs)}));
            head2(
                json!([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]),
                None,
            )
        };
        let usage = include_usage.then_some(move |u: Value| head(json!([]), Some(u)));
        return Ok(running.stream(state.clone(), first, chunk, usage));
    }
    let (results, usage) = running.collect(&state).await?;
    let choices: Vec<Value> = results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let mut message = json!({"role": "assistant", "content": r.content});
            if !r.reasoning.is_empty() {
                message["reasoning_content"] = json!(r.reasoning);
            }
            if !r.calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&r.calls, None);
                if r.content.trim().is_empty() {
                    message["content"] = Value::Null;
                }
            }
            let lp = logprobs.map(|_| json!({"content": logprobs_json(&r.logprobs)}));
            json!({"index": i, "message": message, "logprobs": lp, "finish_reason": r.finish_reason})
        })
        .collect();
    let body = json!({"id": id, "object": "chat.completion", "created": created, "model": model,
                      "choices": choices, "usage": usage});
    Ok(axum::Json(body).into_response())
}

/// `tool_calls` as OpenAI returns them; `stream_index`: streamed deltas number their calls from it.
fn tool_calls_json(calls: &[ToolCall], stream_index: Option<usize>) -> Value {
    let list: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({"id": request_id("call"), "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}});
            if let Some(first) = stream_index {
                v["index"] = json!(first + i);
            }
            v
        })
        .collect();
    Value::Array(list)
}

fn logprobs_json(entries: &[LogprobEntry]) -> Vec<Value> {
    let item = |t: &str, l: f32| json!({"token": t, "logprob": l, "bytes": t.as_bytes()});
    entries
        .iter()
        .map(|e| {
            let mut v = item(&e.token, e.logprob);
            v["top_logprobs"] = Value::Array(e.top.iter().map(|(t, l)| item(t, *l)).collect());
            v
        })
        .collect()
}
