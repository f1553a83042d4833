//! Chat templates: the Jinja source shipped with a model, rendered with minijinja configured as
//! Hugging Face's `apply_chat_template` does (trim_blocks, lstrip_blocks, Python string/dict methods via
//! minijinja-contrib's pycompat, `raise_exception`, `tojson`, `strftime_now`).
use super::TextError;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

/// A template for checkpoints of `architecture` (config.json's `architectures[0]`, or what a GGUF file's
/// architecture maps to) that come without one of their own: GGUF files written without
/// `tokenizer.chat_template`, synthetic checkpoints. `--chat-template` and the checkpoint's own template
/// come first.
pub fn builtin_for_architecture(architecture: &str) -> Option<&'static str> {
    match architecture {
        // SmallThinker's hub template could not be read here (the hub stores the file in Xet; only
        // its size, 7.27 kB, is visible). The model uses Qwen2.5's tokenizer (151,936 ids; EOS
        // `<|endoftext|>` and `<|im_end|>` in generation_config.json) and its tokenizer_config.json has
        // the size of Qwen2.5-Instruct's, whose published template this is (ChatML with Hermes tool
        // calls).
        "SmallThinkerForCausalLM" => {
            Some(include_str!("testdata/smallthinker_chat_template.jinja"))
        }
        // GLM-5.3-Flash's `chat_template.jinja` (zai-org/GLM-5.3-Flash on the Hugging Face hub), as
        // vendored unchanged in the GitHub repository Weschera/GLM-5.3-Flash-NVIDIA-NVFP4-2x-DGX-Spark
        // (commit 957c19e, 10,720 bytes, sha256 3406cc91…). The hub itself cannot be read from here; two
        // other vendored copies differ only by local edits (the generation prompt's thinking switch,
        // early loop exits). The `[gMASK]<sop>` prefix, `<|system|>Reasoning Effort: …` line, tool
        // header, `<arg_key>` calls and `<think>` handling are those the server's GLM parsers expect.
        "Glm5NextForConditionalGeneration" => {
            Some(include_str!("testdata/glm53_flash_chat_template.jinja"))
        }
        // GLM-5 (zai-org/GLM-5) and GLM-4.7-Flash ship the GLM-4.7 family's `chat_template.jinja`
        // (3 KB): `[gMASK]<sop>`, the `<|system|>` tools header, compact `<arg_key>` tool calls,
        // `<|observation|>` results, history reasoning cleared unless `clear_thinking` is false, and a
        // generation prompt opening `<think>` (`</think>` with `enable_thinking` false). The file here
        // matches the GLM-5 tokenizer's template wherever public sources quote it (the same fragments
        // and renders of zai-org/GLM-5: `[gMASK]<sop><|user|>你好<|assistant|><think>` and
        // `…<|assistant|></think>2<|user|>…`; text/builtin_template_tests.rs checks both) and a
        // vendored copy of the GLM-4.7 template line for line; without its final newline it is
        // byte for byte llama.cpp's `models/templates/GLM-4.7-Flash.jinja` (3120 bytes, sha256
        // d63ad536…, docs/GLM5-NEXT.md).
        "GlmMoeDsaForCausalLM" | "Glm4MoeLiteForCausalLM" => {
            Some(include_str!("testdata/glm5_chat_template.jinja"))
        }
        _ => None,
    }
}

/// The template `serve` renders with: `--chat-template`'s file, else the checkpoint's own, else the
/// built-in one of its architecture.
pub fn choose_source(
    from_flag: Option<String>,
    from_checkpoint: Option<&str>,
    architecture: &str,
) -> Option<String> {
    from_flag
        .or_else(|| from_checkpoint.map(str::to_string))
        .or_else(|| builtin_for_architecture(architecture).map(str::to_string))
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template writes the `tools` it is given into the prompt (many small models' templates
    /// ignore them; the server then writes them itself).
    pub renders_tools: bool,
    /// The template handles a `developer` role itself (otherwise the server maps it to `system`).
    pub knows_developer_role: bool,
}

/// Python's `json.dumps` layout, as HF's `tojson` produces it: `", "` and `": "` separators (or
/// `indent` spaces), non-ASCII kept. Models were trained on prompts rendered this way.
struct PyJsonFormatter {
    indent: Option<usize>,
    /// Per open container: whether it has had an element (empty ones print as `[]` / `{}`).
    open: Vec<bool>,
}

impl PyJsonFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(n) = self.indent {
            w.write_all(b"\n")?;
            w.write_all(" ".repeat(n * self.open.len()).as_bytes())?;
        }
        Ok(())
    }

    fn element<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if let Some(top) = self.open.last_mut() {
            *top = true;
        }
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }

    fn close<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        if self.open.pop() == Some(true) {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }
}

impl serde_json::ser::Formatter for PyJsonFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open.push(false);
        w.write_all(b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.element(w, first)
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open.push(false);
        w.write_all(b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.element(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

fn py_tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut out,
        PyJsonFormatter {
            indent,
            open: Vec::new(),
        },
    );
    serde::Serialize::serialize(&json, &mut ser)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(
        String::from_utf8(out).unwrap_or_default(),
    ))
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> String {
    // UTC date only; templates use it for "Today is ..." lines.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    format
        .replace("%Y", &y.to_string())
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[(m as usize).saturating_sub(1) % 12])
        .replace("%b", &MONTHS[(m as usize).saturating_sub(1) % 12][..3])
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

impl ChatTemplate {
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", py_tojson);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TextError::Template(e.to_string()))?;
        let mut t = Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
            renders_tools: false,
            knows_developer_role: source.contains("developer"),
        };
        t.renders_tools = t.probe_renders_tools();
        Ok(t)
    }

    /// Renders one user turn with a uniquely named tool and looks for the name in the prompt.
    fn probe_renders_tools(&self) -> bool {
        const PROBE: &str = "moe_probe_tool_0c9f";
        let user = serde_json::json!({"role": "user", "content": "hi"});
        let system = serde_json::json!({"role": "system", "content": "probe"});
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": PROBE,
            "description": "probe", "parameters": {"type": "object", "properties": {}}}}),
        ];
        // Some templates insist on a system turn first: try both shapes.
        [vec![user.clone()], vec![system, user]]
            .iter()
            .any(|messages| {
                self.render(messages, Some(&tools), true, &Default::default())
                    .is_ok_and(|p| p.contains(PROBE))
            })
    }

    /// Renders `messages` (OpenAI shape, normalised by [`normalize_messages`]) and `tools` to the prompt.
    /// `extra` carries `chat_template_kwargs` (e.g. `enable_thinking`).
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String, TextError> {
        let mut ctx = extra.clone();
        ctx.insert("messages".into(), Json::Array(normalize_messages(messages)));
        if let Some(t) = tools.filter(|t| !t.is_empty()) {
            ctx.insert("tools".into(), Json::Array(t.to_vec()));
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TextError::Template(e.to_string()))?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| TextError::Template(e.to_string()))
    }
}

/// Makes OpenAI messages what HF templates expect: text-part arrays joined into one string, null content
/// as "", and tool-call `arguments` JSON strings parsed into objects (templates iterate or `tojson` them).
pub fn normalize_messages(messages: &[Json]) -> Vec<Json> {
    messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(obj) = m.as_object_mut() {
                match obj.get("content") {
                    Some(Json::Array(parts)) => {
                        let text: String = parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Json::as_str))
                            .collect::<Vec<_>>()
                            .join("");
                        obj.insert("content".into(), Json::String(text));
                    }
                    None | Some(Json::Null) => {
                        obj.insert("content".into(), Json::String(String::new()));
                    }
                    _ => {}
                }
                if let Some(Json::Array(calls)) = obj.get_mut("tool_calls") {
                    for c in calls {
                        let args = c.pointer("/function/arguments").and_then(Json::as_str);
                        if let Some(parsed) =
                            args.and_then(|a| serde_json::from_str::<Json>(a).ok())
                        {
                            c["function"]["arguments"] = parsed;
                        }
                    }
                }
            }
            m
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn tool_rendering_and_developer_role_are_detected() {
        let smol = ChatTemplate::new(SMOLLM2, None, None).unwrap();
        assert!(!smol.renders_tools && !smol.knows_developer_role);
        let with_tools = ChatTemplate::new(
            "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        assert!(with_tools.renders_tools);
    }

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(SMOLLM2, None, Some("<|im_end|>")).unwrap();
        let msgs = [json!({"role": "user", "content": [{"type": "text", "text": "Hi"}]})];
        let out = t.render(&msgs, None, true, &Default::default()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_tojson_raise_and_kwargs_work() {
        let src = "{% if not enable_thinking %}{{ raise_exception('no') }}{% endif %}\
                   {% for m in messages %}{{ m.content.strip() | upper }}|{% if m.tool_calls %}\
                   {{ m.tool_calls[0].function.arguments.city }}{% endif %}{% endfor %}{{ tools | tojson }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let msgs = [
            json!({"role": "assistant", "content": null, "tool_calls": [
            {"type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]}),
            json!({"role": "user", "content": "  hi "}),
        ];
        let tools = [json!({"type": "function", "function": {"name": "w"}})];
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), json!(true));
        let out = t.render(&msgs, Some(&tools), false, &kw).unwrap();
        assert!(out.starts_with("|Paris"), "{out}");
        assert!(out.contains("HI|") && out.contains("\"name\""), "{out}");
        kw.insert("enable_thinking".into(), json!(false));
        let err = t.render(&msgs, None, false, &kw).unwrap_err().to_string();
        assert!(err.contains("no"), "{err}");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t =
            ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", None, None).unwrap();
        let mut kw = serde_json::Map::new();
        kw.insert("x".into(), json!({"a": [1, "é"], "b": {}}));
        let out = t.render(&[], None, false, &kw).unwrap();
        assert_eq!(
            out,
            "{\"a\": [1, \"é\"], \"b\": {}}|{\n  \"a\": [\n    1,\n    \"é\"\n  ],\n  \"b\": {}\n}"
        );
    }

    #[test]
    fn qwen3_template_renders_tools_history_and_thinking_switch() {
        let t = ChatTemplate::new(
            include_str!("testdata/qwen3_chat_template.jinja"),
            None,
            None,
        )
        .unwrap();
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}),
        ];
        let msgs = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Weather in Paris?"}),
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
        ];
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), json!(false));
        let out = t.render(&msgs, Some(&tools), true, &kw).unwrap();
        let want = [
            "<|im_start|>system\nBe brief.\n\n# Tools",
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n</tools>",
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n",
        ];
        for w in want {
            assert!(out.contains(w), "missing {w:?} in\n{out}");
        }
        assert!(
            out.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            "{out}"
        );
    }

    #[test]
    fn strftime_now_formats_a_date() {
        let s = strftime_now("%d %B %Y".into());
        assert!(
            s.len() >= 10 && s.chars().next().unwrap().is_ascii_digit(),
            "{s}"
        );
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
    }
}
