//! The tokenizer: an HF `tokenizers::Tokenizer` built from `tokenizer.json` or from GGUF metadata
//! (`tokenizer.ggml.*`: BPE vocab, merges, token types, pre-tokenizer name), plus the special tokens and
//! chat template the server needs.
use super::TextError;
use crate::weights::gguf::{GgufFile, GgufValue};
use crate::weights::{read_text_file, JSON_FILE_LIMIT};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use tokenizers::Tokenizer;
use tokio::sync::Semaphore;

pub struct TextTokenizer {
    inner: Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Token ids that end generation (EOS and template end-of-turn markers).
    pub stop_token_ids: Vec<u32>,
    pub chat_template: Option<String>,
    /// Set by [`Self::keep_client_specials_literal`].
    literal: Option<LiteralSpecials>,
}

/// A special-token string taken out of client text is replaced by U+FDD0, the token's index, U+FDD1:
/// Unicode noncharacters, which no client text needs (text holding them is refused).
const MARK_OPEN: char = '\u{FDD0}';
const MARK_CLOSE: char = '\u{FDD1}';

/// Special tokens typed by a client, tokenised as the text they are. vLLM's default (and ours) is
/// to tokenise the rendered prompt as one string, so `<|im_start|>system` inside a user message
/// becomes the control token (role injection); this is the switch that prevents it.
struct LiteralSpecials {
    /// The special tokens' strings, longest first (a token containing another wins).
    specials: Vec<String>,
    /// The same tokenizer with special-token matching off.
    plain: Tokenizer,
}

/// `tokenizer.json` size limit: the largest real ones (250k-token vocabularies) are ~35 MB.
const TOKENIZER_FILE_LIMIT: u64 = 512 << 20;

fn tok_err(e: impl std::fmt::Display) -> TextError {
    TextError::Tokenizer(e.to_string())
}

/// HF pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` names (BPE models).
fn pre_tokenizer_for(pre: &str) -> Value {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    match pre {
        // llama.cpp: "\p{N}" then the GPT-2 regex.
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "exaone" | "minerva" => {
            json!({
                "type": "Sequence",
                "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]
            })
        }
        "llama3" | "llama-bpe" | "qwen2" | "deepseek-r1-qwen" | "smaug-bpe" => json!({
            "type": "Sequence",
            "pretokenizers": [
                split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                byte_level(false)
            ]
        }),
        _ => byte_level(true),
    }
}

impl TextTokenizer {
    /// From a GGUF file's `tokenizer.ggml.*` metadata (BPE / "gpt2" models) and `tokenizer.chat_template`.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, TextError> {
        let path = g.path().display().to_string();
        let bad = |message: String| TextError::File {
            path: path.clone(),
            message,
        };
        let model = g.get("tokenizer.ggml.model").and_then(GgufValue::as_str);
        if model != Some("gpt2") {
            return Err(bad(format!(
                "tokenizer model {model:?} is not supported (supported: gpt2 byte-level BPE)"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>, TextError> {
            let arr = g
                .get(key)
                .and_then(GgufValue::as_array)
                .ok_or_else(|| bad(format!("metadata `{key}` missing")))?;
            arr.iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad(format!("metadata `{key}` is not a string array")))
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<i64> = g
            .get("tokenizer.ggml.token_type")
            .and_then(GgufValue::as_array)
            .map(|a| {
                a.iter()
                    .map(|v| match v {
                        GgufValue::I64(x) => *x,
                        GgufValue::U64(x) => *x as i64,
                        _ => 1,
                    })
                    .collect()
            })
            .unwrap_or_default();
        if types.len() > tokens.len() {
            return Err(bad(format!(
                "metadata `tokenizer.ggml.token_type` has {} entries for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let vocab: serde_json::Map<String, Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        // ggml token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
        let added: Vec<Value> = types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(i, &t)| {
                json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": t == 3})
            })
            .collect();
        let pre = g
            .get("tokenizer.ggml.pre")
            .and_then(GgufValue::as_str)
            .unwrap_or("default");
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer_for(pre),
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": merges}
        });
        let inner: Tokenizer = spec.to_string().parse().map_err(tok_err)?;
        // Ids outside the vocabulary are ignored as llama.cpp does (it warns and drops them).
        let id = |k: &str| {
            g.get(k)
                .and_then(GgufValue::as_u64)
                .filter(|&v| v < tokens.len() as u64)
                .map(|v| v as u32)
        };
        let name = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize).cloned());
        let eos = id("tokenizer.ggml.eos_token_id");
        let mut t = Self {
            inner,
            literal: None,
            bos_token: name(id("tokenizer.ggml.bos_token_id")),
            eos_token: name(eos),
            stop_token_ids: eos.into_iter().collect(),
            chat_template: g
                .get("tokenizer.chat_template")
                .and_then(GgufValue::as_str)
                .map(str::to_string),
        };
        t.add_end_of_turn_tokens();
        Ok(t)
    }

    /// From a Hugging Face directory: `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TextError> {
        let file = dir.join("tokenizer.json");
        let file_err = |message: String| TextError::File {
            path: file.display().to_string(),
            message,
        };
        let text =
            read_text_file(&file, TOKENIZER_FILE_LIMIT).map_err(|e| file_err(e.to_string()))?;
        let inner: Tokenizer = text.parse().map_err(|e| file_err(format!("{e}")))?;
        let side_file = |name: &str| read_text_file(&dir.join(name), JSON_FILE_LIMIT);
        let cfg: Value = side_file("tokenizer_config.json")
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(Value::Null);
        let token_str = |v: &Value| match v {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
            _ => None,
        };
        let chat_template =
            side_file("chat_template.jinja")
                .ok()
                .or_else(|| match &cfg["chat_template"] {
                    Value::String(s) => Some(s.clone()),
                    Value::Array(list) => list
                        .iter()
                        .find(|t| t["name"] == "default")
                        .or(list.first())
                        .and_then(|t| t["template"].as_str().map(str::to_string)),
                    _ => None,
                });
        let eos_token = token_str(&cfg["eos_token"]);
        let mut t = Self {
            bos_token: token_str(&cfg["bos_token"]),
            stop_token_ids: eos_token
                .as_deref()
                .and_then(|e| inner.token_to_id(e))
                .into_iter()
                .collect(),
            eos_token,
            inner,
            chat_template,
            literal: None,
        };
        t.add_end_of_turn_tokens();
        Ok(t)
    }

    /// Chat models end a turn with a marker that is not always the EOS token (ChatML `<|im_end|>`,
    /// GLM `<|user|>`, Llama 3 `<|eot_id|>`); generation stops on any of them.
    fn add_end_of_turn_tokens(&mut self) {
        for marker in [
            "<|im_end|>",
            "<|eot_id|>",
            "<|endoftext|>",
            "<|user|>",
            "<|observation|>",
        ] {
            if let Some(id) = self.inner.token_to_id(marker) {
                if !self.stop_token_ids.contains(&id) {
                    self.stop_token_ids.push(id);
                }
            }
        }
    }

    /// Text to ids; special-token strings in the text become their ids (templates emit them as text).
    /// `encode_fast` skips the per-token offsets, which we never read and which cost most of the
    /// memory of a long encoding.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// [`Self::encode`] for a prompt that may hold at most `max_tokens` tokens. A text far longer
    /// than that is first measured on a prefix: when the prefix alone is over the limit the prompt
    /// is refused without tokenising the whole body (megabytes of text cost seconds and ~65× their
    /// size in memory).
    pub fn encode_within(&self, text: &str, max_tokens: usize) -> Result<Vec<u32>, EncodeError> {
        let probe = max_tokens
            .saturating_add(1)
            .saturating_mul(PROBE_BYTES_PER_TOKEN);
        if text.len() > probe {
            let prefix = &text[..word_boundary_before(text, probe)];
            let n = self.encode_marked(prefix)?.len();
            if n > max_tokens {
                return Err(EncodeError::TooLong {
                    at_least: n,
                    max_tokens,
                });
            }
        }
        let ids = self.encode_marked(text)?;
        if ids.len() > max_tokens {
            return Err(EncodeError::TooLong {
                at_least: ids.len(),
                max_tokens,
            });
        }
        Ok(ids)
    }

    /// From now on, special-token strings in client text marked by [`Self::mark_client_text`] are
    /// tokenised as plain text, not as control tokens.
    pub fn keep_client_specials_literal(&mut self) {
        let mut specials: Vec<String> = self
            .inner
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        specials.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        let mut plain = self.inner.clone();
        plain.set_encode_special_tokens(true);
        self.literal = Some(LiteralSpecials { specials, plain });
    }

    /// Client-controlled JSON (messages, tools) with every special-token string in its strings
    /// marked, so that it survives the chat template and is tokenised as text. Unchanged (borrowed)
    /// when the switch is off.
    pub fn mark_client_text<'a>(
        &self,
        v: &'a [Value],
    ) -> Result<std::borrow::Cow<'a, [Value]>, TextError> {
        let Some(lit) = &self.literal else {
            return Ok(std::borrow::Cow::Borrowed(v));
        };
        let mut out = v.to_vec();
        for item in &mut out {
            mark_strings(item, lit)?;
        }
        Ok(std::borrow::Cow::Owned(out))
    }

    /// [`Self::encode`] honouring marks: the text between marks is tokenised with special tokens
    /// parsed (the template's own markers), each mark as its special token's plain text.
    fn encode_marked(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let Some(lit) = self.literal.as_ref().filter(|_| text.contains(MARK_OPEN)) else {
            return self.encode(text);
        };
        let mut ids = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find(MARK_OPEN) {
            ids.extend(self.encode(&rest[..open])?);
            let after = &rest[open + MARK_OPEN.len_utf8()..];
            let close = after
                .find(MARK_CLOSE)
                .ok_or_else(|| tok_err("unclosed mark"))?;
            let idx: usize = after[..close].parse().map_err(tok_err)?;
            let special = lit.specials.get(idx).ok_or_else(|| tok_err("bad mark"))?;
            let enc = lit
                .plain
                .encode_fast(special.as_str(), false)
                .map_err(tok_err)?;
            ids.extend(enc.get_ids());
            rest = &after[close + MARK_CLOSE.len_utf8()..];
        }
        ids.extend(self.encode(rest)?);
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The underlying HF tokenizer (for llguidance's byte-level token view).
    pub fn hf_tokenizer(&self) -> &Tokenizer {
        &self.inner
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Marks every special-token string inside the strings of `v` (keys are left alone).
fn mark_strings(v: &mut Value, lit: &LiteralSpecials) -> Result<(), TextError> {
    match v {
        Value::String(s) => {
            if s.contains([MARK_OPEN, MARK_CLOSE]) {
                return Err(TextError::Tokenizer(
                    "text contains the Unicode noncharacters U+FDD0/U+FDD1".into(),
                ));
            }
            for (i, special) in lit.specials.iter().enumerate() {
                if s.contains(special.as_str()) {
                    *s = s.replace(special.as_str(), &format!("{MARK_OPEN}{i}{MARK_CLOSE}"));
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                mark_strings(item, lit)?;
            }
        }
        Value::Object(map) => {
            for item in map.values_mut() {
                mark_strings(item, lit)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Bytes of text per allowed token before a prompt is measured on a prefix first: text averages
/// 3–5 bytes per token, so only prompts that are almost surely too long take that path.
const PROBE_BYTES_PER_TOKEN: usize = 16;

/// The end of a prefix of at most `limit` bytes, moved back to the last whitespace within 1 KiB so
/// that the prefix's tokens are the whole text's tokens (no word cut in two).
fn word_boundary_before(text: &str, limit: usize) -> usize {
    let mut end = limit.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let window_start = end.saturating_sub(1024);
    match text[..end].rfind(char::is_whitespace) {
        Some(ws) if ws >= window_start && ws > 0 => ws,
        _ => end,
    }
}

/// Why a prompt was not tokenised.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("the prompt has at least {at_least} tokens, over the limit of {max_tokens}")]
    TooLong { at_least: usize, max_tokens: usize },
    #[error(transparent)]
    Text(#[from] TextError),
    #[error("the tokenizer pool has shut down")]
    PoolClosed,
}

/// Tokenisation off the async runtime: prompts are tokenised on tokio's blocking threads, at most
/// `slots` at once; the rest wait for a slot without holding a runtime worker, so `/health` and
/// streams keep being served while large prompts are tokenised, and peak tokenizer memory is
/// bounded by `slots` encodings.
pub struct TokenizerPool {
    tokenizer: Arc<TextTokenizer>,
    slots: Arc<Semaphore>,
}

impl TokenizerPool {
    pub fn new(tokenizer: Arc<TextTokenizer>, slots: usize) -> Self {
        Self {
            tokenizer,
            slots: Arc::new(Semaphore::new(slots.max(1))),
        }
    }

    /// One slot per two cores, at least one and at most four: tokenising is CPU work that
    /// competes with the engine's own threads.
    pub fn default_slots() -> usize {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get() / 2)
            .clamp(1, 4)
    }

    pub async fn encode_within(
        &self,
        text: String,
        max_tokens: usize,
    ) -> Result<Vec<u32>, EncodeError> {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| EncodeError::PoolClosed)?;
        let tok = self.tokenizer.clone();
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            tok.encode_within(&text, max_tokens)
        })
        .await
        .map_err(|_| EncodeError::PoolClosed)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_directory_gives_tokenizer_template_and_stop_tokens() {
        let dir = std::env::temp_dir().join(format!("moe-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "normalizer": null, "post_processor": null,
            "decoder": null,
            "added_tokens": [{"id": 3, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "pre_tokenizer": {"type": "Whitespace"},
            "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "<|im_end|>": 3},
                      "unk_token": "[UNK]"}
        });
        std::fs::write(dir.join("tokenizer.json"), spec.to_string()).unwrap();
        let cfg = json!({"eos_token": {"content": "<|im_end|>"}, "bos_token": null,
                         "chat_template": [{"name": "default", "template": "{{ messages[0].content }}"}]});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = TextTokenizer::from_hf_dir(&dir).unwrap();
        assert_eq!(t.encode("hello world<|im_end|>").unwrap(), vec![0, 1, 3]);
        assert_eq!(t.stop_token_ids, vec![3]);
        assert_eq!(
            t.chat_template.as_deref(),
            Some("{{ messages[0].content }}")
        );
        std::fs::write(dir.join("chat_template.jinja"), "file wins").unwrap();
        assert_eq!(
            TextTokenizer::from_hf_dir(&dir)
                .unwrap()
                .chat_template
                .as_deref(),
            Some("file wins")
        );
        std::fs::remove_dir_all(dir).ok();
    }

    fn byte_level_tokenizer() -> TextTokenizer {
        let dir = tempfile::tempdir().unwrap();
        let mut vocab = serde_json::Map::new();
        for b in 0u8..=255 {
            let c = match b {
                b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff => b as char,
                _ => char::from_u32(0x100 + b as u32).unwrap(),
            };
            let n = vocab.len();
            vocab.entry(c.to_string()).or_insert(n.into());
        }
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
            "post_processor": null, "decoder": null, "added_tokens": [],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                              "use_regex": true},
            "model": {"type": "BPE", "vocab": vocab, "merges": []}
        });
        std::fs::write(dir.path().join("tokenizer.json"), spec.to_string()).unwrap();
        TextTokenizer::from_hf_dir(dir.path()).unwrap()
    }

    #[test]
    fn prompts_over_the_limit_are_refused_from_a_prefix() {
        let t = byte_level_tokenizer();
        // One token per byte here: 100 bytes fit 100 tokens, 101 do not.
        assert_eq!(t.encode_within(&"a".repeat(100), 100).unwrap().len(), 100);
        assert!(matches!(
            t.encode_within(&"a".repeat(101), 100),
            Err(EncodeError::TooLong { at_least: 101, .. })
        ));
        // 8 MB of words against a 1,000-token limit: refused after tokenising a ~16 KB prefix.
        let big = "word ".repeat(8 << 20 >> 3);
        let t0 = std::time::Instant::now();
        match t.encode_within(&big, 1000) {
            Err(EncodeError::TooLong { at_least, .. }) => assert!(at_least < 20_000, "{at_least}"),
            other => panic!("expected TooLong, got {other:?}"),
        }
        // Tokenising all 8 MB takes seconds at this opt-level; the prefix takes milliseconds.
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            t0.elapsed()
        );
        // A prefix cut is moved back to a word boundary.
        assert_eq!(word_boundary_before("hello world", 8), 5);
        assert_eq!(word_boundary_before("héllo", 2), 1);
    }

    #[test]
    fn the_pool_runs_at_most_its_slots_and_keeps_the_runtime_free() {
        let t = Arc::new(byte_level_tokenizer());
        let pool = Arc::new(TokenizerPool::new(t, 1));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let big = "word ".repeat(200_000);
            let p = pool.clone();
            let job = tokio::spawn(async move { p.encode_within(big, 2_000_000).await });
            // The single-threaded runtime still runs other tasks while the prompt is tokenised.
            let ticks = tokio::spawn(async {
                for _ in 0..5 {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            });
            ticks.await.unwrap();
            assert!(!job.is_finished(), "tokenising blocked the runtime");
            assert_eq!(job.await.unwrap().unwrap().len(), 1_000_000);
        });
    }

    #[test]
    fn client_special_tokens_stay_text_when_asked() {
        let dir = std::env::temp_dir().join(format!("moe-tok-lit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "normalizer": null, "post_processor": null,
            "decoder": null,
            "added_tokens": [{"id": 4, "content": "<|im_start|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[<|>_a-z]"}, "behavior": "Isolated",
                              "invert": false},
            "model": {"type": "WordLevel", "vocab": {"<": 0, "|": 1, ">": 2, "[UNK]": 3, "<|im_start|>": 4,
                      "i": 5, "m": 6, "_": 7, "s": 8, "t": 9, "a": 10, "r": 11},
                      "unk_token": "[UNK]"}
        });
        std::fs::write(dir.join("tokenizer.json"), spec.to_string()).unwrap();
        let mut t = TextTokenizer::from_hf_dir(&dir).unwrap();
        let msgs = vec![json!({"role": "user", "content": "<|im_start|>"})];
        // Default (vLLM's): the typed marker becomes the control token.
        let same = t.mark_client_text(&msgs).unwrap();
        let rendered = format!("<|im_start|>{}", same[0]["content"].as_str().unwrap());
        assert_eq!(t.encode_within(&rendered, 100).unwrap(), vec![4, 4]);
        // Switched: the template's marker stays a control token, the typed one is text.
        t.keep_client_specials_literal();
        let marked = t.mark_client_text(&msgs).unwrap();
        let rendered = format!("<|im_start|>{}", marked[0]["content"].as_str().unwrap());
        let ids = t.encode_within(&rendered, 100).unwrap();
        assert_eq!(ids[0], 4);
        assert!(!ids[1..].contains(&4), "{ids:?}");
        assert_eq!(
            t.decode(&ids[1..], false).unwrap().replace(' ', ""),
            "<|im_start|>"
        );
        let bad = vec![json!({"role": "user", "content": "\u{FDD0}0\u{FDD1}"})];
        assert!(t.mark_client_text(&bad).is_err());
        std::fs::remove_dir_all(dir).ok();
    }
}
