//! OpenAI request bodies (lenient: unknown fields ignored, as vLLM does) and the sampling settings
//! derived from them. Responses are built as JSON values where they are assembled.
use super::error::ApiError;
use crate::engine::sampling::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Map, Value};

#[derive(Debug, Deserialize, Default)]
#[serde(untagged)]
pub enum StopSpec {
    #[default]
    None,
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub fn strings(&self) -> Vec<String> {
        match self {
            StopSpec::None => vec![],
            StopSpec::One(s) => vec![s.clone()],
            StopSpec::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by chat and text completions.
#[derive(Debug, Deserialize, Default)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub stop: StopSpec,
    pub stop_token_ids: Option<Vec<u32>>,
    pub seed: Option<u64>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<Value>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// Token id (as a string) → bias added to its logit, in [-100, 100].
    pub logit_bias: Option<Map<String, Value>>,
}

/// Server-side sampling defaults (`generation_config.json`, `--default-*` flags), used where a request
/// leaves a field out.
#[derive(Debug, Clone, Default)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<usize>,
}

impl SamplingDefaults {
    /// The sampling fields of a Hugging Face `generation_config.json`.
    pub fn from_generation_config(cfg: &Value) -> Self {
        let f = |k: &str| cfg.get(k).and_then(Value::as_f64).map(|v| v as f32);
        // `do_sample: false` means greedy whatever temperature says.
        let greedy = cfg.get("do_sample").and_then(Value::as_bool) == Some(false);
        Self {
            temperature: if greedy { Some(0.0) } else { f("temperature") },
            top_p: f("top_p"),
            top_k: cfg.get("top_k").and_then(Value::as_i64),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
            max_tokens: cfg
                .get("max_new_tokens")
                .and_then(Value::as_u64)
                .map(|v| v as usize),
        }
    }

    /// `over`'s values where it has them, else these.
    pub fn overridden_by(self, over: SamplingDefaults) -> Self {
        Self {
            temperature: over.temperature.or(self.temperature),
            top_p: over.top_p.or(self.top_p),
            top_k: over.top_k.or(self.top_k),
            min_p: over.min_p.or(self.min_p),
            repetition_penalty: over.repetition_penalty.or(self.repetition_penalty),
            max_tokens: over.max_tokens.or(self.max_tokens),
        }
    }
}

/// `response_format`.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against `schema`; `strict` refuses schema keywords that cannot be enforced.
    JsonSchema {
        schema: Value,
        strict: bool,
    },
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub common: CommonParams,
    pub messages: Vec<Value>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub add_generation_prompt: Option<bool>,
    /// Reasoning tokens after which `</think>` is written for the model (vLLM's field).
    pub thinking_token_budget: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptSpec {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub common: CommonParams,
    pub prompt: PromptSpec,
    /// Top alternatives per token (OpenAI's legacy integer form).
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    /// Text after the completion (fill-in-the-middle); not supported, refused when non-empty.
    pub suffix: Option<String>,
    /// Server-side candidates per choice; only `best_of == n` (no extra candidates) is served.
    pub best_of: Option<i64>,
}

pub const MAX_N: i64 = 16;
pub const MAX_TOP_LOGPROBS: i64 = 20;

impl CommonParams {
    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_N => Ok(n as usize),
            n => Err(ApiError::bad_param(
                "n",
                format!("n must be between 1 and {MAX_N}, got {n}"),
            )),
        }
    }

    /// Requested completion length, if any (`max_completion_tokens` wins over `max_tokens`).
    pub fn max_tokens(&self) -> Result<Option<usize>, ApiError> {
        let (name, v) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => ("max_completion_tokens", v),
            (None, Some(v)) => ("max_tokens", v),
            (None, None) => return Ok(None),
        };
        if v < 1 {
            return Err(ApiError::bad_param(
                name,
                format!("{name} must be at least 1, got {v}"),
            ));
        }
        Ok(Some(v as usize))
    }

    pub fn sampling(&self, defaults: &SamplingDefaults) -> Result<SamplingParams, ApiError> {
        let top_k = match self.top_k.or(defaults.top_k).unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            k => {
                return Err(ApiError::bad_param(
                    "top_k",
                    format!("top_k must be -1, 0 or positive, got {k}"),
                ))
            }
        };
        let temperature = self.temperature.or(defaults.temperature).unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad_param(
                "temperature",
                format!("temperature must be between 0 and 2, got {temperature}"),
            ));
        }
        let p = SamplingParams {
            temperature,
            top_k,
            top_p: self.top_p.or(defaults.top_p).unwrap_or(1.0),
            min_p: self.min_p.or(defaults.min_p).unwrap_or(0.0),
            repetition_penalty: self
                .repetition_penalty
                .or(defaults.repetition_penalty)
                .unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed,
        };
        p.validate().map_err(|m| {
            let param = m.split_whitespace().next().unwrap_or("").to_string();
            ApiError::bad_param(&param, m)
        })?;
        Ok(p)
    }

    /// `response_format`: text (also when absent), `json_object`, or `json_schema` (OpenAI's
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`).
    pub fn response_format(&self) -> Result<ResponseFormat, ApiError> {
        let Some(rf) = &self.response_format else {
            return Ok(ResponseFormat::Text);
        };
        let bad = |m: String| ApiError::bad_param("response_format", m);
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => Ok(ResponseFormat::Text),
            Some("json_object") => Ok(ResponseFormat::JsonObject),
            Some("json_schema") => {
                let js = rf
                    .get("json_schema")
                    .ok_or_else(|| bad("`json_schema` needs a `json_schema` object".into()))?;
                let schema = js.get("schema").cloned().unwrap_or_else(|| json!({}));
                if !schema.is_object() {
                    return Err(bad("`json_schema.schema` must be a JSON schema object".into()));
                }
                Ok(ResponseFormat::JsonSchema {
                    schema,
                    strict: js.get("strict").and_then(Value::as_bool).unwrap_or(false),
                })
            }
            Some(other) => Err(bad(format!(
                "response_format type `{other}` is not supported (supported: text, json_object, json_schema)"
            ))),
            None => Err(bad("response_format needs a `type`".into())),
        }
    }

    /// `logit_bias` as (token id, bias) pairs, checked against the vocabulary.
    pub fn logit_bias(&self, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(vec![]);
        };
        map.iter()
            .map(|(k, v)| {
                let id = k.trim().parse::<u32>().ok().filter(|&i| (i as usize) < vocab);
                let bias = v.as_f64().filter(|b| (-100.0..=100.0).contains(b));
                match (id, bias) {
                    (Some(id), Some(b)) => Ok((id, b as f32)),
                    (None, _) => Err(ApiError::bad_param(
                        "logit_bias",
                        format!("logit_bias key `{k}` is not a token id of this vocabulary (size {vocab})"),
                    )),
                    (_, None) => Err(ApiError::bad_param(
                        "logit_bias",
                        format!("logit_bias for `{k}` must be a number in [-100, 100], got {v}"),
                    )),
                }
            })
            .collect()
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// Top-logprob count from the chat form (`logprobs: true`, `top_logprobs: k`).
pub fn chat_logprobs(logprobs: bool, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    match (logprobs, top) {
        (_, Some(k)) if !(0..=MAX_TOP_LOGPROBS).contains(&k) => Err(ApiError::bad_param(
            "top_logprobs",
            format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        )),
        (false, Some(k)) if k > 0 => Err(ApiError::bad_param(
            "top_logprobs",
            "top_logprobs needs `logprobs: true`",
        )),
        (true, k) => Ok(Some(k.unwrap_or(0) as usize)),
        (false, _) => Ok(None),
    }
}

/// Parses a JSON body; every failure is a 400 naming what is wrong, never a panic.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lenient_bodies_parse_and_bad_values_are_400s() {
        let r: ChatRequest = parse_body(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":"x","unknown":1,
                "max_completion_tokens":5,"max_tokens":9,"top_k":-1}"#,
        )
        .unwrap();
        assert_eq!(r.common.stop.strings(), vec!["x".to_string()]);
        assert_eq!(r.common.max_tokens().unwrap(), Some(5));
        assert_eq!(r.common.sampling(&Default::default()).unwrap().top_k, 0);
        for bad in [
            &br#"{"messages": 3}"#[..],
            br#"{"model":"m"}"#,
            br#"not json"#,
            br#"{"messages":[],"n":"two"}"#,
        ] {
            let e = parse_body::<ChatRequest>(bad).unwrap_err();
            assert_eq!(e.status, 400);
        }
        let r: ChatRequest = parse_body(br#"{"messages":[],"temperature":-1,"n":0}"#).unwrap();
        assert_eq!(
            r.common
                .sampling(&Default::default())
                .unwrap_err()
                .param
                .as_deref(),
            Some("temperature")
        );
        assert_eq!(r.common.n().unwrap_err().param.as_deref(), Some("n"));
        assert!(chat_logprobs(true, Some(50)).is_err());
        assert_eq!(chat_logprobs(true, None).unwrap(), Some(0));
    }

    #[test]
    fn response_formats_logit_bias_and_defaults() {
        let r: ChatRequest = parse_body(
            br#"{"messages":[],"response_format":{"type":"json_schema","json_schema":{"name":"x",
                "schema":{"type":"object"},"strict":true}},"logit_bias":{"5":-100,"7":2.5}}"#,
        )
        .unwrap();
        assert_eq!(
            r.common.response_format().unwrap(),
            ResponseFormat::JsonSchema {
                schema: json!({"type": "object"}),
                strict: true
            }
        );
        assert_eq!(
            r.common.logit_bias(10).unwrap(),
            vec![(5, -100.0), (7, 2.5)]
        );
        assert!(r.common.logit_bias(6).is_err());
        let bad: ChatRequest = parse_body(
            br#"{"messages":[],"logit_bias":{"1":300},"response_format":{"type":"xml"}}"#,
        )
        .unwrap();
        assert!(bad.common.logit_bias(10).is_err());
        assert!(bad.common.response_format().is_err());
        let d = SamplingDefaults::from_generation_config(&json!({"temperature": 0.6, "top_k": 20}))
            .overridden_by(SamplingDefaults {
                temperature: Some(0.2),
                ..Default::default()
            });
        let p = r.common.sampling(&d).unwrap();
        assert_eq!((p.temperature, p.top_k), (0.2, 20));
    }

    #[test]
    fn prompt_forms_parse() {
        let c: CompletionRequest = parse_body(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(c.prompt, PromptSpec::Tokens(_)));
        let c: CompletionRequest = parse_body(br#"{"prompt":["a","b"]}"#).unwrap();
        assert!(matches!(c.prompt, PromptSpec::Texts(_)));
        let c: CompletionRequest = parse_body(br#"{"prompt":[[1],[2]]}"#).unwrap();
        assert!(matches!(c.prompt, PromptSpec::TokenLists(_)));
    }
}
