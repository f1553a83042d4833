//! A chat request turned into engine work: messages checked, tools written into the prompt (by the
//! template, or by the server when the template ignores them), the prompt rendered and tokenised,
//! max_tokens settled against the context, and the output grammar chosen and compiled.
//!
//! All of it runs on a blocking task: rendering thousands of tools, tokenising a long prompt or
//! compiling a large schema must not hold up the async workers that stream other requests' tokens.
use super::choice::OutputOptions;
use super::error::ApiError;
use super::generate::{choice_sampling, fit_context, ChoiceSpec, Job, SamplingControl};
use super::grammar::{self, CallCount, CallFormat};
use super::reasoning::ReasoningParser;
use super::structured::GrammarUse;
use super::thinking::{self, ThinkStart, ThinkingSpec};
use super::tools::{check_messages, inject_hermes_tools, ToolChoice, Tools};
use super::types::{chat_logprobs, ChatRequest, ResponseFormat};
use super::AppState;
use llguidance::api::TopLevelGrammar;
use std::sync::Arc;

/// [`plan_chat`] on a blocking task.
pub async fn plan_off_thread(state: &Arc<AppState>, req: ChatRequest) -> Result<Job, ApiError> {
    let st = state.clone();
    tokio::task::spawn_blocking(move || plan_chat(&st, req))
        .await
        .map_err(|e| ApiError::internal(format!("request planning failed: {e}")))?
}

pub fn plan_chat(state: &AppState, mut req: ChatRequest) -> Result<Job, ApiError> {
    let n = req.common.n()?;
    let sampling = req.common.sampling(&state.sampling_defaults)?;
    let logprobs = chat_logprobs(req.logprobs, req.top_logprobs)?;
    let format = req.common.response_format()?;
    let logit_bias = req.common.logit_bias(state.vocab_size)?;
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::bad_request("this model has no chat template; use /v1/completions")
    })?;
    check_messages(&mut req.messages, template.knows_developer_role)?;
    if let Some(t) = req.tools.as_deref().filter(|_| !tool_choice_is_none(&req)) {
        state
            .tool_limits
            .check(t, template.renders_tools, state.max_context)?;
    }
    let tools = Tools::parse(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    let kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    // Client text, with special-token strings marked when they must stay text (--client-special-tokens).
    let bad = |e: crate::text::TextError| ApiError::bad_request(e.to_string());
    let client_messages = state
        .tokenizer
        .mark_client_text(&req.messages)
        .map_err(bad)?
        .into_owned();
    let client_tools = tools
        .as_ref()
        .map(|t| state.tokenizer.mark_client_text(&t.raw))
        .transpose()
        .map_err(bad)?;
    let (messages, template_tools) = match client_tools.as_deref() {
        Some(t) if !template.renders_tools => (inject_hermes_tools(&client_messages, t), None),
        Some(t) => (client_messages, Some(t)),
        None => (client_messages, None),
    };
    let prompt_text = template
        .render(
            &messages,
            template_tools,
            req.add_generation_prompt.unwrap_or(true),
            &kwargs,
        )
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let prompt = state.encode_prompt_blocking(&prompt_text)?;
    let max_tokens = fit_context(state, prompt.len(), req.common.max_tokens()?)?;
    let grammar = output_grammar(state, tools.as_ref(), &format)?;
    let enable_thinking = kwargs.get("enable_thinking").and_then(|v| v.as_bool());
    let thinking_off = thinking::thinking_off(&prompt_text, enable_thinking);
    let prompt_opened_think = ReasoningParser::prompt_opens_think(&prompt_text) && !thinking_off;
    let thinking = match state.reasoning && !thinking_off {
        true => thinking_spec(
            grammar.as_ref(),
            prompt_opened_think,
            req.thinking_token_budget.or(state.default_thinking_budget),
            max_tokens,
        ),
        false => None,
    };
    Ok(Job {
        choices: (0..n)
            .map(|i| ChoiceSpec {
                index: i,
                prompt: prompt.clone(),
                sampling: choice_sampling(&sampling, i),
            })
            .collect(),
        max_tokens,
        logprobs,
        output: OutputOptions {
            stop: req.common.stop.strings(),
            reasoning: state.reasoning.then_some(prompt_opened_think),
            tools: tools.as_ref().map(|t| t.raw.clone()),
            max_calls: tools.as_ref().filter(|t| !t.parallel).map(|_| 1),
            skip_special_tokens: true,
        },
        ignore_eos: req.common.ignore_eos,
        extra_stop_ids: req.common.stop_token_ids.clone().unwrap_or_default(),
        prompt_tokens: prompt.len(),
        control: SamplingControl {
            grammar,
            logit_bias,
            thinking,
        },
    })
}

/// The reasoning section of a request with a reasoning parser and thinking on. A grammar (forced
/// calls, JSON, `auto` calls) starts after it; a whole-output one (the answer must come) gets a
/// default budget of half of `max_tokens`. A budget asked for (the request's `thinking_token_budget`,
/// else the server's `--reasoning-budget`) wins, kept under `max_tokens`. Nothing to gate: None.
fn thinking_spec(
    grammar: Option<&GrammarUse>,
    prompt_opened_think: bool,
    requested_budget: Option<usize>,
    max_tokens: usize,
) -> Option<ThinkingSpec> {
    let whole = matches!(grammar, Some(GrammarUse::Whole(_)));
    let budget = match (requested_budget, whole) {
        (Some(b), true) => Some(b.min(max_tokens.saturating_sub(1))),
        (Some(b), false) => Some(b),
        (None, true) => Some(thinking::constrained_budget(max_tokens)),
        (None, false) => None,
    };
    if grammar.is_none() && budget.is_none() {
        return None;
    }
    let start = match prompt_opened_think {
        true => ThinkStart::Inside,
        false => ThinkStart::MayOpen,
    };
    Some(ThinkingSpec { start, budget })
}

/// `tool_choice: none`: the tools are dropped, not rendered.
fn tool_choice_is_none(req: &ChatRequest) -> bool {
    req.tool_choice.as_ref().and_then(|c| c.as_str()) == Some("none")
}

/// What constrains the output, compiled: forced tool calls, JSON (alone or beside `auto` tool calls),
/// or `auto` tool calls once one opens, in the call format the chat template teaches (Hermes JSON or
/// GLM's XML).
fn output_grammar(
    state: &AppState,
    tools: Option<&Tools>,
    format: &ResponseFormat,
) -> Result<Option<GrammarUse>, ApiError> {
    let json = match format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some((None, false)),
        ResponseFormat::JsonSchema { schema, strict } => Some((Some(schema), *strict)),
    };
    let format = match state.glm_tool_format {
        true => CallFormat::Glm,
        false => CallFormat::Hermes,
    };
    let Some(so) = &state.structured else {
        if json.is_some() || tools.is_some_and(|t| t.forced_specs().is_some()) {
            return Err(ApiError::bad_request(
                "structured output is not available: this model's tokenizer could not be mapped to bytes",
            ));
        }
        return Ok(None);
    };
    let compile = |g: Result<TopLevelGrammar, String>| {
        g.and_then(|g| so.compile(g, &state.metrics)).map_err(|e| {
            ApiError::bad_param(
                if json.is_some() {
                    "response_format"
                } else {
                    "tools"
                },
                format!("cannot constrain output to this schema: {e}"),
            )
        })
    };
    let count = |t: &Tools| match (&t.choice, t.parallel) {
        (ToolChoice::Required, true) => CallCount::OneOrMore,
        _ => CallCount::One,
    };
    let tags = &so.call_tags;
    match (tools, json) {
        (Some(t), _) if t.forced_specs().is_some() => {
            let specs = t.forced_specs().unwrap_or_default();
            let g = grammar::forced_calls(&specs, tags, format, count(t));
            Ok(Some(GrammarUse::Whole(compile(g)?)))
        }
        (Some(t), Some((schema, strict))) => {
            let g = grammar::json_or_calls(schema, strict, &t.specs, tags, format, count(t));
            Ok(Some(GrammarUse::Whole(compile(g)?)))
        }
        (None, Some((schema, strict))) => {
            let g = Ok(grammar::json_response(schema, strict));
            Ok(Some(GrammarUse::Whole(compile(g)?)))
        }
        (Some(t), None) => match compile(grammar::call_after_open(&t.specs, tags, format)) {
            Ok(call) => Ok(Some(GrammarUse::AfterToolCallOpens {
                call,
                single: !t.parallel,
                format,
            })),
            // `auto` still works unconstrained: the parser reads whatever calls the model writes.
            Err(e) => {
                tracing::warn!(error = %e.message, "tool-call grammar not compiled; calls unconstrained");
                Ok(None)
            }
        },
        (None, None) => Ok(None),
    }
}
