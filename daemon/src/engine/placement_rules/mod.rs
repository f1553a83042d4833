//! Placement rule files (`--placement-rules FILE`): an ordered list of rules that match routed experts by
//! tensor / module name (regex), layer and expert index, and choose where each expert lives for decode,
//! where long prompts compute it, and the format its DRAM copy is packed in. The first matching rule
//! wins, as in KTransformers' optimize rules and llama.cpp's `-ot` overrides (docs/PLACEMENT.md).
//!
//! This file parses and checks a rule file on its own (syntax, regexes, ranges, formats), with the line
//! and column of every mistake, and joins rule sets from several sources (a user's rules, then the
//! operator's per-node-class rules: the first match across all of them wins); [`resolve`] applies a
//! checked rule set to a model's shape and prints the plan, naming the source and line of each rule.
pub mod resolve;

use moe_kernels::cpu::moe::WeightFormat;
use serde::Deserialize;
use serde_saphyr::Spanned;
use std::path::Path;
use std::sync::Arc;

pub use resolve::{ExpertChoice, PlacementPlan, ResolveError};

/// Rule files are small; anything larger is a mistake (a checkpoint passed by accident).
const MAX_FILE_BYTES: usize = 1 << 20;
/// More rules than any model has layers × a few; bounds the work of resolving.
const MAX_RULES: usize = 4096;
/// Compiled regex size cap (bytes of the automaton), so a pathological pattern fails cleanly.
const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Backtracking steps fancy-regex may take per match before it gives up with an error.
const BACKTRACK_LIMIT: usize = 100_000;
/// Largest layer / expert index a range may name (far above any model; bounds range expansion).
const MAX_INDEX: u32 = 1 << 16;

/// Where an expert lives, so where decode steps compute it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    Gpu,
    Cpu,
}

/// Where a long prompt's step (layerwise prefill) computes an expert that lives in DRAM: streamed to
/// the GPU, or on the CPU as in decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillDevice {
    #[default]
    Gpu,
    Cpu,
}

/// A set of indices written as `"0-15,20,30-31"`, a number, or a list of those.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexSet(Vec<(u32, u32)>);

impl IndexSet {
    pub fn contains(&self, i: usize) -> bool {
        self.0
            .iter()
            .any(|&(a, b)| (a as usize..=b as usize).contains(&i))
    }

    /// Largest index named.
    pub fn max(&self) -> u32 {
        self.0.iter().map(|r| r.1).max().unwrap_or(0)
    }

    /// Parses `"0-15,20"`; `Err` says what is wrong.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim) {
            let num = |t: &str| -> Result<u32, String> {
                let v: u32 = t.trim().parse().map_err(|_| {
                    format!("`{t}` is not an index (expected e.g. 3, 0-15 or 0-3,8)")
                })?;
                if v > MAX_INDEX {
                    return Err(format!("index {v} is above {MAX_INDEX}"));
                }
                Ok(v)
            };
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => {
                    let v = num(part)?;
                    (v, v)
                }
            };
            if a > b {
                return Err(format!("range `{part}` runs backwards"));
            }
            out.push((a, b));
        }
        Ok(Self(out))
    }
}

impl std::fmt::Display for IndexSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, &(a, b)) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            if a == b {
                write!(f, "{sep}{a}")?;
            } else {
                write!(f, "{sep}{a}-{b}")?;
            }
        }
        Ok(())
    }
}

/// `layers:` / `experts:` as written: a string of ranges, a number, or a list of either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum IndexSpec {
    One(u32),
    Text(String),
    List(Vec<IndexItem>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum IndexItem {
    One(u32),
    Text(String),
}

impl IndexSpec {
    fn to_set(&self) -> Result<IndexSet, String> {
        let text = match self {
            IndexSpec::One(n) => n.to_string(),
            IndexSpec::Text(s) => s.clone(),
            IndexSpec::List(items) => items
                .iter()
                .map(|i| match i {
                    IndexItem::One(n) => n.to_string(),
                    IndexItem::Text(s) => s.clone(),
                })
                .collect::<Vec<_>>()
                .join(","),
        };
        IndexSet::parse(&text)
    }
}

/// One rule as written in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    #[serde(rename = "match")]
    matcher: Spanned<RawMatch>,
    /// `gpu` | `cpu` | `auto` (left to `--gpu-experts` and `--expert-placement`).
    #[serde(default)]
    decode: Option<Spanned<String>>,
    /// `gpu` | `cpu`: where a long prompt computes this expert when it lives in DRAM.
    #[serde(default)]
    prefill: Option<Spanned<String>>,
    /// DRAM format: bf16, fp8, int8, int4, int4g64, int4g128, int4m32, int8g32.
    #[serde(default)]
    dtype: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    name: Option<Spanned<String>>,
    #[serde(default)]
    layers: Option<Spanned<IndexSpec>>,
    #[serde(default)]
    experts: Option<Spanned<IndexSpec>>,
}

/// A checked rule.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The file (or flag, or variable) the rule comes from.
    pub source: Arc<str>,
    /// Line of the rule's `match:` in its file (1-based), for the plan and for errors.
    pub line: usize,
    pub name: Option<fancy_regex::Regex>,
    pub layers: Option<IndexSet>,
    pub experts: Option<IndexSet>,
    /// `None`: `auto`, the placement strategy decides.
    pub decode: Option<Residency>,
    pub prefill: PrefillDevice,
    /// `None`: `--expert-dtype`, else as stored in the checkpoint.
    pub dtype: Option<WeightFormat>,
    /// Where `layers:` / `experts:` / `dtype:` were written, for errors found against the model.
    pub layers_at: Position,
    pub experts_at: Position,
    pub dtype_at: Position,
}

/// Line and column (1-based) in the rule file; 0 when the rule was built from a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// A checked, ordered rule set and where it came from (a file, or a flag such as `--n-cpu-moe`; several
/// joined by [`RuleSet::then`]).
#[derive(Debug, Clone)]
pub struct RuleSet {
    /// The sources' names joined with ` + `, in order.
    pub source: String,
    pub rules: Vec<Rule>,
    /// Where the rules come from, in the order they are tried.
    pub sources: Vec<RuleSource>,
}

/// One file (or flag, or variable) of a rule set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSource {
    pub name: Arc<str>,
    /// The file's leading comment lines (without `#`), printed with the plan: what the file says it
    /// is for (the operator writes the node class and its sizing figures there).
    pub comment: Vec<String>,
}

/// A rule file that cannot be used: `source:line:column: message`.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}:{at}: {message}")]
pub struct RulesError {
    pub source_name: String,
    pub at: Position,
    pub message: String,
}

fn pos<T>(s: &Spanned<T>) -> Position {
    Position {
        line: s.referenced.line() as usize,
        column: s.referenced.column() as usize,
    }
}

impl RuleSet {
    /// Reads and checks a rule file.
    pub fn load(path: &Path) -> Result<Self, RulesError> {
        let source_name = path.display().to_string();
        let fail = |message: String| RulesError {
            source_name: source_name.clone(),
            at: Position::default(),
            message,
        };
        let meta = std::fs::metadata(path).map_err(|e| fail(format!("cannot read: {e}")))?;
        if meta.len() > MAX_FILE_BYTES as u64 {
            return Err(fail(format!(
                "{} bytes; a rule file is at most {MAX_FILE_BYTES}",
                meta.len()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read: {e}")))?;
        Self::parse(&source_name, &text)
    }

    /// Parses and checks rule-file text; `source_name` prefixes errors.
    pub fn parse(source_name: &str, text: &str) -> Result<Self, RulesError> {
        let err = |at: Position, message: String| RulesError {
            source_name: source_name.to_string(),
            at,
            message,
        };
        if text.len() > MAX_FILE_BYTES {
            return Err(err(
                Position::default(),
                format!("a rule file is at most {MAX_FILE_BYTES} bytes"),
            ));
        }
        if text.trim().is_empty() {
            return Err(err(
                Position { line: 1, column: 1 },
                "empty rule file: expected a list of rules (`- match: ...`)".into(),
            ));
        }
        let raw: Vec<Spanned<RawRule>> = serde_saphyr::from_str(text).map_err(|e| {
            let at = e.location().map_or(Position::default(), |l| Position {
                line: l.line() as usize,
                column: l.column() as usize,
            });
            // The rendered error repeats the position and quotes the line; keep its first line.
            let msg = e.to_string();
            let first = msg.lines().next().unwrap_or("invalid YAML").to_string();
            err(at, format!("{first} (expected a list of rules: `- match: {{name: REGEX, layers: 0-15, experts: 0-31}}` with decode / prefill / dtype)"))
        })?;
        if raw.is_empty() {
            return Err(err(
                Position { line: 1, column: 1 },
                "no rules in the file".into(),
            ));
        }
        if raw.len() > MAX_RULES {
            return Err(err(
                pos(&raw[MAX_RULES]),
                format!("more than {MAX_RULES} rules"),
            ));
        }
        let source: Arc<str> = source_name.into();
        let mut rules = Vec::with_capacity(raw.len());
        for r in &raw {
            rules.push(check_rule(r, &source).map_err(|(at, m)| err(at, m))?);
        }
        Ok(Self {
            source: source_name.to_string(),
            rules,
            sources: vec![RuleSource {
                name: source,
                comment: leading_comment(text),
            }],
        })
    }

    /// These rules, then `later`'s (which decide only what none of these matched).
    pub fn then(mut self, later: RuleSet) -> RuleSet {
        self.source = format!("{} + {}", self.source, later.source);
        self.rules.extend(later.rules);
        self.sources.extend(later.sources);
        self
    }

    /// The sets joined in order (the first match across all of them wins); `None` when there are none.
    pub fn join(sets: impl IntoIterator<Item = RuleSet>) -> Option<RuleSet> {
        sets.into_iter().reduce(RuleSet::then)
    }

    /// llama.cpp's `--n-cpu-moe N`: the routed experts of layers 0..N live in DRAM, every other
    /// layer's on the GPU.
    pub fn n_cpu_moe(n: usize) -> Self {
        let source: Arc<str> = format!("--n-cpu-moe {n}").into();
        let mut rules = Vec::new();
        if n > 0 {
            rules.push(Rule {
                layers: Some(IndexSet(vec![(0, n.min(MAX_INDEX as usize) as u32 - 1)])),
                decode: Some(Residency::Cpu),
                ..Rule::everything(source.clone())
            });
        }
        rules.push(Rule {
            decode: Some(Residency::Gpu),
            ..Rule::everything(source.clone())
        });
        Self {
            source: source.to_string(),
            rules,
            sources: vec![RuleSource {
                name: source,
                comment: Vec::new(),
            }],
        }
    }
}

/// Leading comment lines shown with the plan: at most this many, each clipped to [`COMMENT_CHARS`].
const COMMENT_LINES: usize = 12;
const COMMENT_CHARS: usize = 200;

/// The comment lines a rule file starts with (blank lines and a `---` before them skipped), without
/// their `#`, bounded.
fn leading_comment(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .skip_while(|l| l.is_empty() || *l == "---")
        .take_while(|l| l.starts_with('#'))
        .map(|l| l.trim_start_matches('#').trim())
        .filter(|l| !l.is_empty())
        .take(COMMENT_LINES)
        .map(|l| clip(l, COMMENT_CHARS))
        .collect()
}

/// `text` cut at a word boundary within `max` characters, with `…` when cut.
fn clip(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let cut: String = text.chars().take(max).collect();
    let end = cut.rfind(' ').unwrap_or(cut.len());
    format!("{}…", &cut[..end])
}

impl Rule {
    /// Where the rule is: `SOURCE:LINE` (`SOURCE` alone for a rule built from a flag).
    pub fn label(&self) -> String {
        match self.line {
            0 => self.source.to_string(),
            n => format!("{}:{n}", self.source),
        }
    }

    /// The rule as the plan prints it, e.g. `{layers: 0-3, experts: 0-7} decode gpu`.
    pub fn summary(&self) -> String {
        let mut m = Vec::new();
        if let Some(n) = &self.name {
            m.push(format!("name: '{}'", n.as_str()));
        }
        if let Some(l) = &self.layers {
            m.push(format!("layers: {l}"));
        }
        if let Some(e) = &self.experts {
            m.push(format!("experts: {e}"));
        }
        let mut s = if m.is_empty() {
            "{every routed expert}".to_string()
        } else {
            format!("{{{}}}", m.join(", "))
        };
        s.push_str(match self.decode {
            Some(Residency::Gpu) => " decode gpu",
            Some(Residency::Cpu) => " decode cpu",
            None => " decode auto",
        });
        if self.prefill == PrefillDevice::Cpu {
            s.push_str(" prefill cpu");
        }
        if let Some(d) = self.dtype {
            s.push_str(&format!(" dtype {}", resolve::format_name(d)));
        }
        s
    }

    /// A rule matching every routed expert, deciding nothing (`decode: auto`).
    fn everything(source: Arc<str>) -> Self {
        Rule {
            source,
            line: 0,
            name: None,
            layers: None,
            experts: None,
            decode: None,
            prefill: PrefillDevice::Gpu,
            dtype: None,
            layers_at: Position::default(),
            experts_at: Position::default(),
            dtype_at: Position::default(),
        }
    }
}

fn check_rule(r: &Spanned<RawRule>, source: &Arc<str>) -> Result<Rule, (Position, String)> {
    let m = &r.value.matcher;
    let name = match &m.value.name {
        Some(n) => Some(
            fancy_regex::RegexBuilder::new(&n.value)
                .delegate_size_limit(REGEX_SIZE_LIMIT)
                .backtrack_limit(BACKTRACK_LIMIT)
                .build()
                .map_err(|e| (pos(n), format!("`{}` is not a valid regex: {e}", n.value)))?,
        ),
        None => None,
    };
    let set = |s: &Option<Spanned<IndexSpec>>, what: &str| -> Result<_, (Position, String)> {
        s.as_ref()
            .map(|s| {
                s.value
                    .to_set()
                    .map(|v| (v, pos(s)))
                    .map_err(|e| (pos(s), format!("{what}: {e}")))
            })
            .transpose()
    };
    let layers = set(&m.value.layers, "layers")?;
    let experts = set(&m.value.experts, "experts")?;
    if name.is_none() && layers.is_none() && experts.is_none() {
        return Err((
            pos(m),
            "`match` needs at least one of name, layers, experts (an empty match would hide every rule after it; write `name: \".*\"` to mean everything)".into(),
        ));
    }
    let decode = match r.value.decode.as_ref() {
        None => None,
        Some(d) => match d.value.as_str() {
            "gpu" | "cuda" => Some(Residency::Gpu),
            "cpu" => Some(Residency::Cpu),
            "auto" => None,
            other => return Err((pos(d), format!("decode: `{other}` is not gpu, cpu or auto"))),
        },
    };
    let prefill = match r.value.prefill.as_ref() {
        None => PrefillDevice::Gpu,
        Some(p) => match p.value.as_str() {
            "gpu" | "cuda" => PrefillDevice::Gpu,
            "cpu" => PrefillDevice::Cpu,
            other => return Err((pos(p), format!("prefill: `{other}` is not gpu or cpu"))),
        },
    };
    let dtype = r
        .value
        .dtype
        .as_ref()
        .map(|d| {
            d.value
                .parse::<WeightFormat>()
                .map_err(|e| (pos(d), format!("dtype: {e}")))
        })
        .transpose()?;
    let at = |s: &Option<Spanned<String>>| s.as_ref().map_or(Position::default(), pos);
    Ok(Rule {
        source: source.clone(),
        line: pos(r).line,
        name,
        layers_at: layers.as_ref().map_or(Position::default(), |l| l.1),
        experts_at: experts.as_ref().map_or(Position::default(), |e| e.1),
        layers: layers.map(|l| l.0),
        experts: experts.map(|e| e.0),
        decode,
        prefill,
        dtype,
        dtype_at: at(&r.value.dtype),
    })
}

#[cfg(test)]
mod tests;
