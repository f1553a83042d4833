//! POST /v1/chat/completions.
use super::choice::{ChoiceDelta, LogprobEntry, OutputOptions};
use super::error::ApiError;
use super::generate::{
    choice_sampling, fit_context, now_unix, request_id, submit, ChoiceSpec, Job, OutputConstraint,
};
use super::reasoning::ReasoningParser;
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
    if req.messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    if let Some(bad) = req
        .messages
        .iter()
        .find(|m| m.get("role").and_then(Value::as_str).is_none())
    {
        return Err(ApiError::bad_param(
            "messages",
            format!("every message needs a string `role`: {bad}"),
        ));
    }
    let n = req.common.n()?;
    let sampling = req.common.sampling()?;
    let logprobs = chat_logprobs(req.logprobs, req.top_logprobs)?;
    let json_mode = req.common.json_mode()?;
    let tools = tools_in_use(&req)?;
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::bad_request("this model has no chat template; use /v1/completions")
    })?;
    let kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    // Client text, with special-token strings marked when they must stay text (--client-special-tokens).
    let bad = |e: crate::text::TextError| ApiError::bad_request(e.to_string());
    let messages = state
        .tokenizer
        .mark_client_text(&req.messages)
        .map_err(bad)?;
    let tool_specs = req
        .tools
        .as_deref()
        .map(|t| state.tokenizer.mark_client_text(t));
    let tool_specs = tool_specs.transpose().map_err(bad)?;
    let prompt_text = template
        .render(
            &messages,
            tool_specs.as_deref().filter(|_| tools.is_some()),
            req.add_generation_prompt.unwrap_or(true),
            &kwargs,
        )
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let prompt = state.encode_prompt(&prompt_text).await?;
    let max_tokens = fit_context(&state, prompt.len(), req.common.max_tokens()?)?;
    let output = OutputOptions {
        stop: req.common.stop.strings(),
        reasoning: state
            .reasoning
            .then(|| ReasoningParser::prompt_opens_think(&prompt_text)),
        tools: tools.clone(),
        skip_special_tokens: true,
    };
    let forced = forced_tool_names(&req, tools.as_deref());
    let constraint = match forced {
        Some(names) if !state.glm_tool_format => OutputConstraint::ToolCall(names),
        _ if json_mode => OutputConstraint::JsonObject,
        _ => OutputConstraint::None,
    };
    let job = Job {
        choices: (0..n)
            .map(|i| ChoiceSpec {
                index: i,
                prompt: prompt.clone(),
                sampling: choice_sampling(&sampling, i),
            })
            .collect(),
        max_tokens,
        logprobs,
        output,
        ignore_eos: req.common.ignore_eos,
        extra_stop_ids: req.common.stop_token_ids.clone().unwrap_or_default(),
        prompt_tokens: prompt.len(),
        constraint,
    };
    let id = request_id("chatcmpl");
    let running = submit(&state, &id, job)?;
    let created = now_unix();
    let model = state.served_model.clone();
    if req.common.stream {
        let include_usage = req.common.include_usage();
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

/// The tools the parser should look for, after checking `tool_choice` against `tools`.
fn tools_in_use(req: &ChatRequest) -> Result<Option<Vec<Value>>, ApiError> {
    let tools = req.tools.clone().filter(|t| !t.is_empty());
    if let Some(bad) = tools.iter().flatten().find(|t| {
        t.pointer("/function/name")
            .and_then(Value::as_str)
            .is_none()
    }) {
        return Err(ApiError::bad_param(
            "tools",
            format!("each tool needs `function.name`: {bad}"),
        ));
    }
    match &req.tool_choice {
        None => Ok(tools),
        Some(Value::String(s)) if s == "none" => Ok(None),
        Some(Value::String(s)) if s == "auto" || s == "required" => {
            if tools.is_none() && s == "required" {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    "tool_choice `required` needs `tools`",
                ));
            }
            Ok(tools)
        }
        Some(v) => {
            let name = v.pointer("/function/name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_param("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
            })?;
            let known = tools
                .iter()
                .flatten()
                .any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name));
            if !known {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    format!("tool_choice names `{name}`, which is not in `tools`"),
                ));
            }
            Ok(tools)
        }
    }
}

/// `stream_index`: streamed deltas number their calls from this index.
/// Tools the output must call one of (`tool_choice` required or named), if any.
fn forced_tool_names(req: &ChatRequest, tools: Option<&[Value]>) -> Option<Vec<String>> {
    let names = || -> Vec<String> {
        tools
            .into_iter()
            .flatten()
            .filter_map(|t| {
                t.pointer("/function/name")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .collect()
    };
    match &req.tool_choice {
        Some(Value::String(s)) if s == "required" => Some(names()),
        Some(v) => v
            .pointer("/function/name")
            .and_then(Value::as_str)
            .map(|n| vec![n.to_string()]),
        None => None,
    }
}

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
