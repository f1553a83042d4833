//! POST /v1/responses — OpenAI's Responses API, as newer SDKs and coding agents speak it: text and
//! message input (with earlier `function_call` / `function_call_output` items), `instructions`,
//! function tools, `text.format` JSON schemas, and streaming as typed events
//! (`response.created` … `response.output_text.delta` … `response.completed`).
//!
//! The request is translated into a chat completion and runs through the same planning (template,
//! tools, grammar) and engine path; only the input and output shapes differ. Stateless: no `store`,
//! so `previous_response_id` is refused.
use super::choice::ChoiceDelta;
use super::error::ApiError;
use super::generate::{now_unix, request_id, submit, ChoiceResult};
use super::plan::plan_off_thread;
use super::tool_parser::ToolCall;
use super::types::{parse_body, ChatRequest};
use super::AppState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::Arc;
use tokio_stream::wrappers::ReceiverStream;

pub async fn responses(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: Map<String, Value> = parse_body(&body)?;
    let chat = to_chat_request(&req)?;
    let chat: ChatRequest = serde_json::from_value(Value::Object(chat))
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    state.check_model(chat.common.model.as_deref())?;
    let stream = chat.common.stream;
    let job = plan_off_thread(&state, chat).await?;
    let id = request_id("resp");
    let running = submit(&state, &id, job)?;
    let shell = ResponseShell {
        id,
        created: now_unix(),
        model: state.served_model.clone(),
        echo: echoed_fields(&req),
    };
    if stream {
        return Ok(stream_response(state, running, shell));
    }
    let (mut results, usage) = running.collect(&state).await?;
    let r = results.pop().unwrap_or_default();
    let output = output_items(&r.reasoning, &r.content, &r.calls);
    Ok(axum::Json(shell.body("completed", output, Some(&usage), r.finish_reason)).into_response())
}

/// Request fields the response object repeats back.
fn echoed_fields(req: &Map<String, Value>) -> Map<String, Value> {
    let mut m = Map::new();
    for (k, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("temperature", json!(1.0)),
        ("top_p", json!(1.0)),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("parallel_tool_calls", json!(true)),
        ("metadata", json!({})),
        ("text", json!({"format": {"type": "text"}})),
    ] {
        m.insert(k.into(), req.get(k).cloned().unwrap_or(default));
    }
    m
}

/// The Responses request as a chat-completions body.
fn to_chat_request(req: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    if req
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(ApiError::bad_param(
            "previous_response_id",
            "responses are not stored on this server: send the whole conversation in `input`",
        ));
    }
    let mut messages = Vec::new();
    if let Some(i) = req.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": i}));
    }
    match req.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => input_items(items, &mut messages)?,
        _ => {
            return Err(ApiError::bad_param(
                "input",
                "`input` must be a string or a list of items",
            ))
        }
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for k in [
        "model",
        "temperature",
        "top_p",
        "stream",
        "parallel_tool_calls",
        "seed",
    ] {
        if let Some(v) = req.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(m) = req.get("max_output_tokens") {
        chat.insert("max_completion_tokens".into(), m.clone());
    }
    if let Some(Value::Array(tools)) = req.get("tools") {
        let mut out = Vec::new();
        for t in tools {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::bad_param(
                    "tools",
                    format!(
                        "only function tools are supported, got {}",
                        t.get("type").unwrap_or(&Value::Null)
                    ),
                ));
            }
            let mut f = t.as_object().cloned().unwrap_or_default();
            f.remove("type");
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    match req.get("tool_choice") {
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            chat.insert(
                "tool_choice".into(),
                json!({"type": "function", "function": {"name": o.get("name")}}),
            );
        }
        Some(v) => {
            chat.insert("tool_choice".into(), v.clone());
        }
        None => {}
    }
    if let Some(format) = req.get("text").and_then(|t| t.get("format")) {
        let rf = match format.get("type").and_then(Value::as_str) {
            Some("json_schema") => json!({"type": "json_schema", "json_schema": {
                "name": format.get("name"), "schema": format.get("schema"),
                "strict": format.get("strict")}}),
            _ => format.clone(),
        };
        chat.insert("response_format".into(), rf);
    }
    Ok(chat)
}

/// Input items → chat messages. Consecutive `function_call` items join one assistant message.
fn input_items(items: &[Value], messages: &mut Vec<Value>) -> Result<(), ApiError> {
    for item in items {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = match item.get("content") {
                    Some(Value::String(s)) => Value::String(s.clone()),
                    Some(Value::Array(parts)) => Value::Array(parts.clone()),
                    _ => Value::String(String::new()),
                };
                messages.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let call = json!({"id": item.get("call_id"), "type": "function", "function": {
                    "name": item.get("name"), "arguments": item.get("arguments")}});
                match messages.last_mut() {
                    Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => {
                        if let Some(calls) = m["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => messages
                        .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => messages.push(json!({"role": "tool",
                "tool_call_id": item.get("call_id"), "content": output_text(item.get("output"))})),
            // Earlier reasoning is not fed back to the model (chat templates drop it as well).
            "reasoning" => {}
            other => {
                return Err(ApiError::bad_param(
                    "input",
                    format!("input items of type `{other}` are not supported"),
                ))
            }
        }
    }
    Ok(())
}

fn output_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

struct ResponseShell {
    id: String,
    created: u64,
    model: String,
    echo: Map<String, Value>,
}

impl ResponseShell {
    fn body(&self, status: &str, output: Vec<Value>, usage: Option<&Value>, finish: &str) -> Value {
        let mut v = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": null,
            "incomplete_details": null, "usage": usage.map(responses_usage),
        });
        if status == "completed" && finish == "length" {
            v["status"] = json!("incomplete");
            v["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        for (k, val) in &self.echo {
            v[k] = val.clone();
        }
        v
    }
}

/// Chat usage → Responses usage names.
fn responses_usage(u: &Value) -> Value {
    json!({
        "input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
        "total_tokens": u["total_tokens"],
        "input_tokens_details": {"cached_tokens": u.pointer("/prompt_tokens_details/cached_tokens").cloned().unwrap_or(json!(0))},
        "output_tokens_details": {"reasoning_tokens": 0},
    })
}

fn reasoning_item(text: &str) -> Value {
    json!({"type": "reasoning", "id": request_id("rs"), "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "completed" {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    } else {
        json!([])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(c: &ToolCall, status: &str) -> Value {
    json!({"type": "function_call", "id": request_id("fc"), "call_id": request_id("call"),
           "name": c.name, "arguments": c.arguments, "status": status})
}

fn output_items(reasoning: &str, content: &str, calls: &[ToolCall]) -> Vec<Value> {
    let mut out = Vec::new();
    if !reasoning.is_empty() {
        out.push(reasoning_item(reasoning));
    }
    if !content.trim().is_empty() || calls.is_empty() {
        out.push(message_item(&request_id("msg"), content, "completed"));
    }
    out.extend(calls.iter().map(|c| call_item(c, "completed")));
    out
}

/// Builds the event sequence of a streamed response.
struct EventWriter {
    seq: u64,
    output: Vec<Value>,
    /// The open message item: (output index, id, text so far).
    message: Option<(usize, String, String)>,
    reasoning: String,
}

impl EventWriter {
    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Event::default().event(kind).data(data.to_string())
    }

    fn on_delta(&mut self, d: &ChoiceDelta) -> Vec<Event> {
        let mut ev = Vec::new();
        self.reasoning.push_str(&d.reasoning);
        if !d.content.is_empty() && (self.message.is_some() || !d.content.trim().is_empty()) {
            if self.message.is_none() {
                let idx = self.output.len();
                let id = request_id("msg");
                self.output.push(Value::Null);
                ev.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": idx, "item": message_item(&id, "", "in_progress")}),
                ));
                ev.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": id,
                    "output_index": idx, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}}),
                ));
                self.message = Some((idx, id, String::new()));
            }
            let (idx, id) = match &mut self.message {
                Some((idx, id, text)) => {
                    text.push_str(&d.content);
                    (*idx, id.clone())
                }
                None => return ev,
            };
            ev.push(self.event(
                "response.output_text.delta",
                json!({"item_id": id,
                "output_index": idx, "content_index": 0, "delta": d.content, "logprobs": []}),
            ));
        }
        for c in &d.calls {
            ev.extend(self.close_message());
            let idx = self.output.len();
            let item = call_item(c, "completed");
            self.output.push(item.clone());
            let mut added = item.clone();
            added["arguments"] = json!("");
            added["status"] = json!("in_progress");
            ev.push(self.event(
                "response.output_item.added",
                json!({"output_index": idx, "item": added}),
            ));
            ev.push(self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": item["id"], "output_index": idx, "delta": c.arguments}),
            ));
            ev.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item["id"], "output_index": idx, "arguments": c.arguments}),
            ));
            ev.push(self.event(
                "response.output_item.done",
                json!({"output_index": idx, "item": item}),
            ));
        }
        ev
    }

    fn close_message(&mut self) -> Vec<Event> {
        let Some((idx, id, text)) = self.message.take() else {
            return vec![];
        };
        let item = message_item(&id, &text, "completed");
        self.output[idx] = item.clone();
        vec![
            self.event("response.output_text.done", json!({"item_id": id, "output_index": idx,
                "content_index": 0, "text": text, "logprobs": []})),
            self.event("response.content_part.done", json!({"item_id": id, "output_index": idx,
                "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}})),
            self.event("response.output_item.done", json!({"output_index": idx, "item": item})),
        ]
    }

    /// The final output list (reasoning first, as in non-streamed responses).
    fn final_output(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        if !self.reasoning.is_empty() {
            out.push(reasoning_item(&self.reasoning));
        }
        out.append(&mut self.output);
        out
    }
}

fn stream_response(
    state: Arc<AppState>,
    mut running: super::generate::Running,
    shell: ResponseShell,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(async move {
        let mut w = EventWriter {
            seq: 0,
            output: Vec::new(),
            message: None,
            reasoning: String::new(),
        };
        let start = shell.body("in_progress", vec![], None, "");
        let head = [
            w.event("response.created", json!({"response": start})),
            w.event("response.in_progress", json!({"response": start})),
        ];
        for e in head {
            if tx.send(Ok(e)).await.is_err() {
                return;
            }
        }
        let mut last = ChoiceResult::default();
        loop {
            let next = tokio::select! {
                _ = tx.closed() => return,
                n = running.next_delta(&state) => n,
            };
            let Some(next) = next else { break };
            let events = match next {
                Ok((_, d, finish)) => {
                    if let Some(f) = finish {
                        last.finish_reason = f;
                    }
                    w.on_delta(&d)
                }
                Err(e) => {
                    let failed = w.event(
                        "error",
                        json!({"code": e.code, "message": e.message, "param": e.param}),
                    );
                    let _ = tx.send(Ok(failed)).await;
                    return;
                }
            };
            for e in events {
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
        }
        let mut tail = w.close_message();
        let usage = running.usage();
        let done = shell.body(
            "completed",
            w.final_output(),
            Some(&usage),
            last.finish_reason,
        );
        let kind = if done["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        tail.push(w.event(kind, json!({"response": done})));
        running.log_done(true);
        for e in tail {
            if tx.send(Ok(e)).await.is_err() {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_input_becomes_chat_messages() {
        let req: Map<String, Value> = serde_json::from_value(json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 50,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        }))
        .unwrap();
        let chat = to_chat_request(&req).unwrap();
        let msgs = chat["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 4);
        assert_eq!(msgs[0]["role"], "system");
        assert_eq!(msgs[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(msgs[3]["role"], "tool");
        assert_eq!(chat["tools"][0]["function"]["name"], "get_weather");
        assert_eq!(chat["tool_choice"]["function"]["name"], "get_weather");
        assert_eq!(chat["response_format"]["type"], "json_schema");
        assert_eq!(chat["max_completion_tokens"], 50);
        let parsed: ChatRequest = serde_json::from_value(Value::Object(chat)).unwrap();
        assert_eq!(parsed.messages.len(), 4);
        let stored: Map<String, Value> =
            serde_json::from_value(json!({"input": "x", "previous_response_id": "resp_1"}))
                .unwrap();
        assert!(to_chat_request(&stored).is_err());
    }

    #[test]
    fn streamed_events_open_and_close_items_in_order() {
        let mut w = EventWriter {
            seq: 0,
            output: Vec::new(),
            message: None,
            reasoning: String::new(),
        };
        let text = ChoiceDelta {
            content: "Hi".into(),
            ..Default::default()
        };
        assert_eq!(w.on_delta(&text).len(), 3);
        let call = ChoiceDelta {
            calls: vec![ToolCall {
                name: "f".into(),
                arguments: "{}".into(),
            }],
            ..Default::default()
        };
        // message closed (3 events), then the call (4 events)
        assert_eq!(w.on_delta(&call).len(), 7);
        let out = w.final_output();
        assert_eq!(out[0]["content"][0]["text"], "Hi");
        assert_eq!(out[1]["type"], "function_call");
    }
}
