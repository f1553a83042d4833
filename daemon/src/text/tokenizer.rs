//! The tokenizer: an HF `tokenizers::Tokenizer` built from `tokenizer.json` or from GGUF metadata
//! (`tokenizer.ggml.*`: BPE vocab, merges, token types, pre-tokenizer name), plus the special tokens and
//! chat template the server needs.
use super::TextError;
use crate::weights::gguf::{GgufFile, GgufValue};
use serde_json::{json, Value};
use std::path::Path;
use tokenizers::Tokenizer;

pub struct TextTokenizer {
    inner: Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Token ids that end generation (EOS and template end-of-turn markers).
    pub stop_token_ids: Vec<u32>,
    pub chat_template: Option<String>,
}

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
        let id = |k: &str| g.get(k).and_then(GgufValue::as_u64).map(|v| v as u32);
        let name = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize).cloned());
        let eos = id("tokenizer.ggml.eos_token_id");
        let mut t = Self {
            inner,
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
        let inner = Tokenizer::from_file(&file).map_err(|e| TextError::File {
            path: file.display().to_string(),
            message: e.to_string(),
        })?;
        let cfg: Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(Value::Null);
        let token_str = |v: &Value| match v {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
            _ => None,
        };
        let chat_template = std::fs::read_to_string(dir.join("chat_template.jinja"))
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
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
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
}
