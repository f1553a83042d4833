//! Applying a checked [`RuleSet`] to a model: each routed expert (layer, expert) gets the choice of the
//! first rule that matches it, checked against the model's shape; and the printed plan of what went where.
//!
//! A rule's `name` regex is searched (anywhere in the string, as llama.cpp's `-ot`) in every name the
//! expert goes by: its Hugging Face module (`model.layers.3.mlp.experts.17`), its three tensors
//! (`….gate_proj.weight`), the layer's experts module (`model.layers.3.mlp.experts`, what
//! KTransformers' rules name) and the layer's GGUF tensors (`blk.3.ffn_gate_exps.weight`, what
//! llama.cpp's `-ot` patterns name).
use super::{Position, PrefillDevice, Residency, RuleSet, RuleSource};
use crate::model::config::Arch;
use crate::model::names::MoeNames;
use crate::model::ModelConfig;
use moe_kernels::cpu::moe::WeightFormat;
use std::fmt::Write as _;
use std::sync::Arc;

/// What the rules decided for one routed expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpertChoice {
    /// `None`: no rule pinned it; the placement strategy decides.
    pub decode: Option<Residency>,
    pub prefill: PrefillDevice,
    /// DRAM format; `None`: `--expert-dtype`, else as stored.
    pub dtype: Option<WeightFormat>,
    /// Index of the deciding rule in its set.
    pub rule: Option<usize>,
}

/// Per layer (empty rows for dense layers), per expert: the rules' choices.
#[derive(Debug, Clone)]
pub struct PlacementPlan {
    pub source: String,
    pub experts: Vec<Vec<ExpertChoice>>,
    /// Per layer: the one DRAM format its experts are packed in (`None`: the default).
    pub layer_dtype: Vec<Option<WeightFormat>>,
    /// File lines of rules that matched no routed expert.
    pub unused_rules: Vec<usize>,
    /// How the plan names each rule, by index: `line 5`, or `FILE:5` when the set joins sources.
    rule_labels: Vec<String>,
    /// Each rule as the plan lists it, under its source.
    rule_summaries: Vec<(Arc<str>, usize, String)>,
    /// Routed experts each rule decided (the first match), by index.
    rule_hits: Vec<usize>,
    /// Where the rules come from, in the order tried.
    sources: Vec<RuleSource>,
}

#[derive(Debug, thiserror::Error)]
#[error("{source_name}:{at}: {message}")]
pub struct ResolveError {
    pub source_name: String,
    pub at: Position,
    pub message: String,
}

/// Names one layer's routed experts go by (see the module comment).
struct LayerNames {
    layer_level: Vec<String>,
    names: MoeNames,
}

impl LayerNames {
    fn new(arch: Arch, layer: usize) -> Self {
        let names = MoeNames::new(arch, layer);
        let layer_level = vec![
            format!("{}.experts", names.block),
            format!("blk.{layer}.ffn_gate_exps.weight"),
            format!("blk.{layer}.ffn_up_exps.weight"),
            format!("blk.{layer}.ffn_down_exps.weight"),
        ];
        Self { layer_level, names }
    }

    fn expert_level(&self, e: usize) -> Vec<String> {
        let mut v = vec![format!("{}.experts.{e}", self.names.block)];
        v.extend(self.names.expert(e));
        v
    }
}

/// Whether `re` finds a match in any of `names` (a regex that exceeds its backtracking budget on a name
/// counts as no match there; names are short, so that takes a deliberately pathological pattern).
fn any_match(re: &fancy_regex::Regex, names: &[String]) -> bool {
    names.iter().any(|n| re.is_match(n).unwrap_or(false))
}

impl RuleSet {
    /// Each routed expert's choice under these rules, checked against `cfg`.
    pub fn resolve(&self, cfg: &ModelConfig) -> Result<PlacementPlan, ResolveError> {
        let err = |source: &str, at: Position, message: String| ResolveError {
            source_name: source.to_string(),
            at,
            message,
        };
        let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
        // Rules from flags (line 0) may name more layers than the model has, as llama.cpp's
        // --n-cpu-moe does; a file's ranges must fit the model.
        for r in self.rules.iter().filter(|r| r.line > 0) {
            if let Some(l) = &r.layers {
                if l.max() as usize >= cfg.num_layers {
                    return Err(err(
                        &r.source,
                        r.layers_at,
                        format!(
                            "layer {} is beyond the model's {} layers (0-{})",
                            l.max(),
                            cfg.num_layers,
                            cfg.num_layers.saturating_sub(1)
                        ),
                    ));
                }
            }
            if let Some(x) = &r.experts {
                if x.max() as usize >= experts {
                    return Err(err(
                        &r.source,
                        r.experts_at,
                        format!(
                            "expert {} is beyond the model's {experts} routed experts per layer",
                            x.max()
                        ),
                    ));
                }
            }
            if r.decode == Some(Residency::Gpu) && r.dtype.is_some_and(|d| d != WeightFormat::Bf16)
            {
                return Err(err(
                    &r.source,
                    r.dtype_at,
                    "dtype is the format of DRAM experts; experts kept on the GPU are bf16 (use decode: cpu or auto with this dtype)".into(),
                ));
            }
        }
        let mut hits = vec![0usize; self.rules.len()];
        let mut out = Vec::with_capacity(cfg.num_layers);
        let mut layer_dtype = vec![None; cfg.num_layers];
        for layer in 0..cfg.num_layers {
            if !cfg.is_moe_layer(layer) {
                out.push(Vec::new());
                continue;
            }
            let names = LayerNames::new(cfg.arch, layer);
            // Per rule: matches the whole layer (Some(true)), none of it (Some(false)), or depends on
            // the expert (None: the regex must be tried on each expert's own names).
            let layer_verdict: Vec<Option<bool>> = self
                .rules
                .iter()
                .map(|r| {
                    if r.layers.as_ref().is_some_and(|l| !l.contains(layer)) {
                        return Some(false);
                    }
                    match &r.name {
                        None => Some(true),
                        Some(re) if any_match(re, &names.layer_level) => Some(true),
                        Some(_) => None,
                    }
                })
                .collect();
            let mut row = Vec::with_capacity(experts);
            for e in 0..experts {
                let mut expert_names = None;
                let hit = self.rules.iter().enumerate().find(|(i, r)| {
                    if r.experts.as_ref().is_some_and(|x| !x.contains(e)) {
                        return false;
                    }
                    match layer_verdict[*i] {
                        Some(v) => v,
                        None => {
                            let n = expert_names.get_or_insert_with(|| names.expert_level(e));
                            r.name.as_ref().is_some_and(|re| any_match(re, n))
                        }
                    }
                });
                row.push(match hit {
                    Some((i, r)) => {
                        hits[i] += 1;
                        ExpertChoice {
                            decode: r.decode,
                            prefill: r.prefill,
                            dtype: r.dtype,
                            rule: Some(i),
                        }
                    }
                    None => ExpertChoice::default(),
                });
            }
            layer_dtype[layer] = self
                .layer_format(layer, &row)
                .map_err(|(source, at, m)| err(&source, at, m))?;
            out.push(row);
        }
        let one_source = self.sources.len() <= 1;
        let rule_labels: Vec<String> = self
            .rules
            .iter()
            .map(|r| match one_source {
                true => format!("line {}", r.line),
                false => r.label(),
            })
            .collect();
        Ok(PlacementPlan {
            source: self.source.clone(),
            experts: out,
            layer_dtype,
            unused_rules: self
                .rules
                .iter()
                .zip(&hits)
                .filter(|(_, &n)| n == 0)
                .map(|(r, _)| r.line)
                .collect(),
            rule_labels,
            rule_summaries: self
                .rules
                .iter()
                .map(|r| (r.source.clone(), r.line, r.summary()))
                .collect(),
            rule_hits: hits,
            sources: self.sources.clone(),
        })
    }

    /// The one DRAM format of a layer: every expert that may live in DRAM must agree (the CPU kernels
    /// and the prefill stream pack a layer's DRAM experts as one set).
    fn layer_format(
        &self,
        layer: usize,
        row: &[ExpertChoice],
    ) -> Result<Option<WeightFormat>, (String, Position, String)> {
        let mut first: Option<(usize, &ExpertChoice)> = None;
        for (e, c) in row.iter().enumerate() {
            if c.decode == Some(Residency::Gpu) {
                continue;
            }
            match first {
                None => first = Some((e, c)),
                Some((e0, c0)) if c0.dtype != c.dtype => {
                    let rule = |c: &ExpertChoice| c.rule.map(|i| &self.rules[i]);
                    let (source, at) = rule(c).or(rule(c0)).map_or(
                        (self.source.clone(), Position::default()),
                        |r| {
                            let at = Position {
                                line: r.line,
                                column: 1,
                            };
                            (r.source.to_string(), at)
                        },
                    );
                    let show =
                        |d: Option<WeightFormat>| d.map_or("the default".into(), format_name);
                    let by = |c: &ExpertChoice| {
                        rule(c).map_or("no rule".into(), |r| format!("the rule at {}", r.label()))
                    };
                    return Err((
                        source,
                        at,
                        format!(
                            "layer {layer}: DRAM experts {e0} and {e} would get different formats ({} by {}, {} by {}); a layer's DRAM experts share one format",
                            show(c0.dtype),
                            by(c0),
                            show(c.dtype),
                            by(c)
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(first.and_then(|(_, c)| c.dtype))
    }
}

impl PlacementPlan {
    /// Per layer and expert: pinned to the GPU (`Some(true)`), to DRAM (`Some(false)`), or free.
    pub fn pins(&self) -> Vec<Vec<Option<bool>>> {
        self.experts
            .iter()
            .map(|row| {
                row.iter()
                    .map(|c| c.decode.map(|d| d == Residency::Gpu))
                    .collect()
            })
            .collect()
    }

    /// Per MoE layer: how many experts the rules pin to the GPU and to DRAM, as the GPU memory plan
    /// counts them.
    pub fn layer_pins(&self) -> Vec<moe_sizing::LayerPins> {
        self.experts
            .iter()
            .filter(|row| !row.is_empty())
            .map(|row| {
                let count =
                    |r: Residency| row.iter().filter(|c| c.decode == Some(r)).count() as u64;
                moe_sizing::LayerPins {
                    gpu: count(Residency::Gpu),
                    dram: count(Residency::Cpu),
                }
            })
            .collect()
    }

    /// Per layer and expert: computed on the CPU in long-prompt steps when it lives in DRAM.
    pub fn prefill_on_cpu(&self) -> Vec<Vec<bool>> {
        self.experts
            .iter()
            .map(|row| {
                row.iter()
                    .map(|c| c.prefill == PrefillDevice::Cpu)
                    .collect()
            })
            .collect()
    }

    /// The printed plan: runs of layers with the same layout, each as runs of experts with the same
    /// home, prefill device, format and deciding rule. `placement[layer][expert]`: on the GPU.
    pub fn describe(&self, placement: &[Vec<bool>], default_dtype: &str) -> String {
        let mut layer_lines: Vec<(usize, usize, Vec<String>)> = Vec::new();
        for (layer, row) in self.experts.iter().enumerate() {
            if row.is_empty() {
                continue;
            }
            let on_gpu = placement.get(layer).map(Vec::as_slice).unwrap_or(&[]);
            let key = |e: usize| {
                let c = &row[e];
                let gpu = on_gpu.get(e).copied().unwrap_or(false);
                let how = match (c.rule, c.decode) {
                    (Some(i), Some(_)) => format!("rule {}", self.rule_labels[i]),
                    (Some(i), None) => format!("strategy (rule {})", self.rule_labels[i]),
                    (None, _) => "strategy (no rule)".to_string(),
                };
                if gpu {
                    format!("decode gpu   bf16          {how}")
                } else {
                    let prefill = match c.prefill {
                        PrefillDevice::Gpu => "prefill gpu",
                        PrefillDevice::Cpu => "prefill cpu",
                    };
                    let dtype =
                        self.layer_dtype[layer].map_or(default_dtype.to_string(), format_name);
                    format!("decode cpu   {dtype:<13} {prefill}  {how}")
                }
            };
            let mut parts = Vec::new();
            let mut start = 0;
            for e in 1..=row.len() {
                if e == row.len() || key(e) != key(start) {
                    parts.push(format!("experts {:<9} {}", range(start, e - 1), key(start)));
                    start = e;
                }
            }
            match layer_lines.last_mut() {
                Some((_, end, p)) if *end + 1 == layer && *p == parts => *end = layer,
                _ => layer_lines.push((layer, layer, parts)),
            }
        }
        let gpu_total: usize = placement
            .iter()
            .map(|r| r.iter().filter(|&&b| b).count())
            .sum();
        let all: usize = self.experts.iter().map(Vec::len).sum();
        let mut s = format!(
            "placement plan ({}): {gpu_total} routed experts on the GPU, {} in DRAM\n",
            self.source,
            all - gpu_total
        );
        self.describe_rules(&mut s);
        for (a, b, parts) in &layer_lines {
            let head = format!("  layers {:<8}", range(*a, *b));
            for (i, p) in parts.iter().enumerate() {
                let lead = if i == 0 {
                    head.clone()
                } else {
                    " ".repeat(head.len())
                };
                let _ = writeln!(s, "{lead} {p}");
            }
        }
        for (i, hits) in self.rule_hits.iter().enumerate() {
            if *hits == 0 {
                let _ = writeln!(
                    s,
                    "  note: the rule at {} matched no routed expert (attention, norms, routers, shared experts and embeddings always run on the GPU with --device cuda)",
                    self.rule_labels[i]
                );
            }
        }
        s
    }

    /// The rules under their sources, in the order tried: each source's leading comment (what the
    /// file says it is, e.g. the operator's node class and sizing) and each rule with the routed
    /// experts it decided.
    fn describe_rules(&self, s: &mut String) {
        let _ = writeln!(s, "  rules, first match wins:");
        for (n, src) in self.sources.iter().enumerate() {
            let count = self
                .rule_summaries
                .iter()
                .filter(|(from, ..)| Arc::ptr_eq(from, &src.name))
                .count();
            let plural = if count == 1 { "" } else { "s" };
            let _ = writeln!(s, "    {}. {} ({count} rule{plural})", n + 1, src.name);
            for line in &src.comment {
                let _ = writeln!(s, "         # {line}");
            }
            for (i, (from, line, summary)) in self.rule_summaries.iter().enumerate() {
                if !Arc::ptr_eq(from, &src.name) {
                    continue;
                }
                let at = match line {
                    0 => "flag".to_string(),
                    l => format!("line {l}"),
                };
                let _ = writeln!(
                    s,
                    "         {at:<9} {summary} -> {} routed experts",
                    self.rule_hits[i]
                );
            }
        }
    }
}

/// A format as `--expert-dtype` and rule files write it.
pub fn format_name(f: WeightFormat) -> String {
    match f {
        WeightFormat::Bf16 => "bf16".into(),
        WeightFormat::F16 => "f16".into(),
        WeightFormat::Fp8Block => "fp8".into(),
        WeightFormat::Int8 => "int8".into(),
        WeightFormat::Int4 { group: 32 } => "int4".into(),
        WeightFormat::Int4 { group } => format!("int4g{group}"),
        WeightFormat::Int4Min { group } => format!("int4m{group}"),
        WeightFormat::Int8Group { group } => format!("int8g{group}"),
        WeightFormat::Int8Min { group } => format!("int8m{group}"),
    }
}

fn range(a: usize, b: usize) -> String {
    if a == b {
        a.to_string()
    } else {
        format!("{a}-{b}")
    }
}
