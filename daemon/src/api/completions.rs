//! POST /v1/completions: prompt as text, token ids, or a list of either (choices are numbered prompt by
//! prompt, n per prompt).
use super::choice::{ChoiceDelta, LogprobEntry, OutputOptions};
use super::error::ApiError;
use super::generate::{
    choice_sampling, fit_context, now_unix, request_id, submit, ChoiceSpec, Job, SamplingControl,
};
use super::grammar;
use super::structured::GrammarUse;
use super::types::{parse_body, CompletionRequest, PromptSpec, ResponseFormat, MAX_TOP_LOGPROBS};
use super::AppState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::sync::Arc;

pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(&body)?;
    state.check_model(req.common.model.as_deref())?;
    let n = req.common.n()?;
    let sampling = req.common.sampling(&state.sampling_defaults)?;
    let format = req.common.response_format()?;
    let logit_bias = req.common.logit_bias(state.vocab_size)?;
    if req.echo {
        return Err(ApiError::bad_param("echo", "echo is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_param(
            "suffix",
            "suffix (fill-in-the-middle) is not supported by this model",
        ));
    }
    if let Some(b) = req.best_of.filter(|&b| b != n as i64) {
        return Err(ApiError::bad_param(
            "best_of",
            format!("best_of must equal n ({n}) when given: extra server-side candidates are not generated, got {b}"),
        ));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k @ 0..=MAX_TOP_LOGPROBS) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_param(
                "logprobs",
                format!("logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ))
        }
    };
    let vocab = state.vocab_size;
    let prompts: Vec<Vec<u32>> = match req.prompt {
        PromptSpec::Text(t) => vec![state.encode_prompt(&t).await?],
        PromptSpec::Texts(ts) => {
            let mut ids = Vec::with_capacity(ts.len());
            for t in &ts {
                ids.push(state.encode_prompt(t).await?);
            }
            ids
        }
        PromptSpec::Tokens(ids) => vec![ids],
        PromptSpec::TokenLists(l) => l,
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_param("prompt", "prompt must not be empty"));
    }
    if let Some(bad) = prompts.iter().flatten().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::bad_param(
            "prompt",
            format!("token id {bad} is outside the vocabulary (size {vocab})"),
        ));
    }
    let requested = req.common.max_tokens()?.or(Some(16)); // OpenAI's default for completions
    let max_tokens = prompts
        .iter()
        .map(|p| fit_context(&state, p.len(), requested))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .min()
        .unwrap_or(1);
    // Compiling a large schema takes CPU time: not on the async workers that stream other requests.
    let st = state.clone();
    let grammar = tokio::task::spawn_blocking(move || json_grammar(&st, &format))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    let mut choices = Vec::new();
    for (pi, p) in prompts.iter().enumerate() {
        for i in 0..n {
            choices.push(ChoiceSpec {
                index: pi * n + i,
                prompt: p.clone(),
                sampling: choice_sampling(&sampling, i),
            });
        }
    }
    let job = Job {
        choices,
        max_tokens,
        logprobs,
        output: OutputOptions {
            stop: req.common.stop.strings(),
            reasoning: None,
            tools: None,
            max_calls: None,
            skip_special_tokens: true,
        },
        ignore_eos: req.common.ignore_eos,
        extra_stop_ids: req.common.stop_token_ids.clone().unwrap_or_default(),
        prompt_tokens: prompts.iter().map(Vec::len).sum(),
        control: SamplingControl {
            grammar,
            logit_bias,
            thinking: None,
        },
    };
    let id = request_id("cmpl");
    let running = submit(&state, &id, job)?;
    let (created, model) = (now_unix(), state.served_model.clone());
    if req.common.stream {
        let include_usage = req.common.include_usage();
        let head = move |choices: Value, usage: Option<Value>| {
            let mut v = json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices});
            if include_usage {
                v["usage"] = usage.unwrap_or(Value::Null);
            }
            v
        };
        let head2 = head.clone();
        let chunk = move |i: usize, d: &ChoiceDelta, finish: Option<&str>| {
            let lp = logprobs.map(|_| logprobs_json(&d.logprobs, 0));
            head2(
                json!([{"index": i, "text": d.content, "logprobs": lp, "finish_reason": finish}]),
                None,
            )
        };
        let usage = include_usage.then_some(move |u: Value| head(json!([]), Some(u)));
        return Ok(running.stream(state.clone(), vec![], chunk, usage));
    }
    let (results, usage) = running.collect(&state).await?;
    let choices: Vec<Value> = results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let lp = logprobs.map(|_| logprobs_json(&r.logprobs, 0));
            json!({"index": i, "text": r.content, "logprobs": lp, "finish_reason": r.finish_reason})
        })
        .collect();
    Ok(axum::Json(
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": usage}),
    )
    .into_response())
}

/// `response_format` on text completions: the whole completion is JSON.
fn json_grammar(state: &AppState, format: &ResponseFormat) -> Result<Option<GrammarUse>, ApiError> {
    let (schema, strict) = match format {
        ResponseFormat::Text => return Ok(None),
        ResponseFormat::JsonObject => (None, false),
        ResponseFormat::JsonSchema { schema, strict } => (Some(schema), *strict),
    };
    let so = state.structured.as_ref().ok_or_else(|| {
        ApiError::bad_request("structured output is not available for this model's tokenizer")
    })?;
    let m = so
        .compile(grammar::json_response(schema, strict), &state.metrics)
        .map_err(|e| {
            ApiError::bad_param(
                "response_format",
                format!("cannot constrain output to this schema: {e}"),
            )
        })?;
    Ok(Some(GrammarUse::Whole(m)))
}

/// OpenAI's legacy completions logprobs object.
fn logprobs_json(entries: &[LogprobEntry], offset0: usize) -> Value {
    let mut offsets = Vec::with_capacity(entries.len());
    let mut at = offset0;
    for e in entries {
        offsets.push(at);
        at += e.token.len();
    }
    json!({
        "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(|e| e.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect::<Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}
