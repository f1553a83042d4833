use super::*;
use crate::engine::placement::{plan_placement, PlacementStrategy};
use crate::model::ModelConfig;
use serde_json::json;

/// GLM-4.5-Air's layout at a small size: 4 layers, the first dense, 16 experts.
fn glm() -> ModelConfig {
    ModelConfig::from_json(&json!({"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 100,
        "head_dim": 32, "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))
    .unwrap()
}

fn smallthinker() -> ModelConfig {
    ModelConfig::from_json(&json!({"architectures": ["SmallThinkerForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 100,
        "moe_num_primary_experts": 8, "moe_num_active_primary_experts": 2, "moe_ffn_hidden_size": 16,
        "rope_layout": [0, 1, 1, 1], "sliding_window_layout": [0, 1, 1, 1], "sliding_window_size": 5}))
    .unwrap()
}

/// The uniform placement of `gpu_experts` of `experts` per MoE layer of `cfg`, with `plan`'s pins.
fn uniform_placement(
    cfg: &ModelConfig,
    experts: usize,
    gpu_experts: usize,
    plan: &PlacementPlan,
) -> Vec<Vec<bool>> {
    plan_placement(
        PlacementStrategy::Uniform,
        &cfg.moe_layers,
        experts,
        gpu_experts,
        None,
        0,
        Some(&plan.pins()),
    )
    .unwrap()
}

/// Qwen3-30B-A3B's shape (48 layers, 128 experts), weights never loaded.
fn qwen3_30b() -> ModelConfig {
    ModelConfig::from_json(
        &json!({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
        "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 48,
        "vocab_size": 151936, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "intermediate_size": 6144, "rope_theta": 1000000.0}),
    )
    .unwrap()
}

fn parse(text: &str) -> Result<RuleSet, String> {
    RuleSet::parse("rules.yaml", text).map_err(|e| e.to_string())
}

fn decode_of(plan: &PlacementPlan, layer: usize, e: usize) -> Option<Residency> {
    plan.experts[layer][e].decode
}

#[test]
fn glm_serve_file_reproduces_ktransformers_experts_on_cpu_for_decode_gpu_for_prefill() {
    let rules = parse(include_str!(
        "../../../../examples/placement/glm4moe-serve.yaml"
    ))
    .unwrap();
    let plan = rules.resolve(&glm()).unwrap();
    assert!(plan.experts[0].is_empty(), "layer 0 is dense");
    for layer in 1..4 {
        for e in 0..16 {
            let c = plan.experts[layer][e];
            assert_eq!(c.decode, Some(Residency::Cpu), "layer {layer} expert {e}");
            assert_eq!(c.prefill, PrefillDevice::Gpu);
        }
    }
    // decode: cpu pins every expert to DRAM, whatever --gpu-experts asks
    let placement = uniform_placement(&glm(), 16, 8, &plan);
    assert!(placement.iter().flatten().all(|&g| !g));
    assert!(plan.unused_rules.is_empty());
}

#[test]
fn smallthinker_serve_file_matches_its_block_sparse_moe_names() {
    let rules = parse(include_str!(
        "../../../../examples/placement/smallthinker-serve.yaml"
    ))
    .unwrap();
    let plan = rules.resolve(&smallthinker()).unwrap();
    assert!(plan
        .experts
        .iter()
        .flatten()
        .all(|c| c.decode == Some(Residency::Cpu)));
    // the GLM file names `.mlp.experts`, which SmallThinker does not have: nothing matches
    let glm_rules = parse(include_str!(
        "../../../../examples/placement/glm4moe-serve.yaml"
    ))
    .unwrap();
    let plan = glm_rules.resolve(&smallthinker()).unwrap();
    assert!(plan.experts.iter().flatten().all(|c| c.decode.is_none()));
    assert_eq!(plan.unused_rules, vec![9]);
}

#[test]
fn n_cpu_moe_file_and_flag_agree_with_llama_cpp_layer_split() {
    let cfg = qwen3_30b();
    let file = parse(include_str!(
        "../../../../examples/placement/n-cpu-moe-24.yaml"
    ))
    .unwrap()
    .resolve(&cfg)
    .unwrap();
    let flag = RuleSet::n_cpu_moe(24).resolve(&cfg).unwrap();
    for layer in 0..48 {
        let want = if layer < 24 {
            Residency::Cpu
        } else {
            Residency::Gpu
        };
        for e in [0, 77, 127] {
            assert_eq!(
                decode_of(&file, layer, e),
                Some(want),
                "file, layer {layer}"
            );
            assert_eq!(
                decode_of(&flag, layer, e),
                Some(want),
                "flag, layer {layer}"
            );
        }
    }
    // more layers than the model has: every layer in DRAM (as llama.cpp)
    let all = RuleSet::n_cpu_moe(99).resolve(&glm()).unwrap();
    assert!(all.experts[1..]
        .iter()
        .flatten()
        .all(|c| c.decode == Some(Residency::Cpu)));
}

#[test]
fn first_matching_rule_wins_and_names_experts_layers_and_tensors() {
    let rules = parse(
        r#"
- match: {layers: 2, experts: "0-3"}
  decode: gpu
- match: {name: 'experts\.5\.down_proj'}
  decode: gpu
- match: {name: '^blk\.3\.ffn_gate_exps'}
  decode: cpu
  prefill: cpu
  dtype: int8
- match: {name: '.*'}
  decode: cpu
- match: {layers: 1}
  decode: gpu
"#,
    )
    .unwrap();
    let plan = rules.resolve(&glm()).unwrap();
    assert_eq!(decode_of(&plan, 2, 3), Some(Residency::Gpu));
    assert_eq!(decode_of(&plan, 2, 4), Some(Residency::Cpu));
    assert_eq!(decode_of(&plan, 1, 5), Some(Residency::Gpu), "tensor name");
    assert_eq!(
        decode_of(&plan, 3, 5),
        Some(Residency::Gpu),
        "rule 2 before rule 3"
    );
    let c = plan.experts[3][0];
    assert_eq!(
        (c.prefill, c.dtype),
        (PrefillDevice::Cpu, Some(WeightFormat::Int8))
    );
    assert_eq!(plan.layer_dtype[3], Some(WeightFormat::Int8));
    assert_eq!(
        plan.unused_rules,
        vec![12],
        "rule 5 is hidden by the catch-all"
    );
}

#[test]
fn errors_carry_line_and_column() {
    let cases = [
        (
            "- match: {name: '(unclosed'}\n  decode: gpu\n",
            "rules.yaml:1:",
            "not a valid regex",
        ),
        (
            "- match:\n    layers: 3-1\n  decode: gpu\n",
            "rules.yaml:2:13",
            "runs backwards",
        ),
        (
            "- match: {layers: 0}\n  decode: gpuu\n",
            "rules.yaml:2:11",
            "not gpu, cpu or auto",
        ),
        (
            "- match: {layers: 0}\n  dtype: int3\n",
            "rules.yaml:2:10",
            "dtype",
        ),
        (
            "- match: {layers: 0}\n  devise: gpu\n",
            "rules.yaml:2:",
            "devise",
        ),
        (
            "- match: {}\n  decode: gpu\n",
            "rules.yaml:1:",
            "at least one of",
        ),
        (
            "- match: {layers: 0}\n  prefill: npu\n",
            "rules.yaml:2:12",
            "not gpu or cpu",
        ),
        ("", "rules.yaml:1:1", "empty"),
        ("[]", "rules.yaml:1:1", "no rules"),
        (
            "- match: {layers: 0\n",
            "rules.yaml:",
            "expected a list of rules",
        ),
        (
            "- match: {layers: x}\n  decode: gpu\n",
            "rules.yaml:1:19",
            "not an index",
        ),
    ];
    for (text, at, what) in cases {
        let e = parse(text).unwrap_err();
        assert!(e.starts_with(at) && e.contains(what), "{text:?}: {e}");
    }
}

#[test]
fn rules_are_checked_against_the_model() {
    // (rules, where the error points, what it says)
    let refused: [(&str, &str, &[&str]); 4] = [
        (
            "- match:\n    layers: 0-4\n  decode: gpu\n",
            "rules.yaml:2:13",
            &["beyond the model's 4 layers"],
        ),
        (
            "- match: {experts: 16}\n  decode: gpu\n",
            "rules.yaml:1:",
            &["expert 16"],
        ),
        (
            "- match: {layers: 1}\n  decode: gpu\n  dtype: int4\n",
            "rules.yaml:3:10",
            &["GPU are bf16"],
        ),
        // two formats for DRAM experts of one layer
        (
            "- match: {layers: 1, experts: 0-7}\n  dtype: int4\n- match: {layers: 1}\n  dtype: int8\n",
            "",
            &["layer 1", "share one format"],
        ),
    ];
    for (rules, at, says) in refused {
        let e = parse(rules)
            .unwrap()
            .resolve(&glm())
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(at) && says.iter().all(|s| e.contains(s)),
            "{rules}: {e}"
        );
    }
    // ... unless the others live on the GPU
    let ok = parse(
        "- match: {layers: 1, experts: 0-7}\n  dtype: int4\n- match: {layers: 1}\n  decode: gpu\n",
    )
    .unwrap();
    assert_eq!(
        ok.resolve(&glm()).unwrap().layer_dtype[1],
        Some(WeightFormat::Int4 { group: 32 })
    );
}

#[test]
fn hostile_input_is_bounded() {
    let huge = "- match: {layers: 0}\n  decode: gpu\n".repeat(MAX_RULES + 1);
    assert!(parse(&huge).unwrap_err().contains("more than"));
    let e = parse("- match: {layers: '0-4294967295'}\n  decode: gpu\n").unwrap_err();
    assert!(e.contains("above"), "{e}");
    // catastrophic backtracking gives up instead of hanging (counted as no match)
    let r = parse("- match: {name: '^(a+)+\\1$'}\n  decode: gpu\n").unwrap();
    let plan = r.resolve(&glm()).unwrap();
    assert!(plan.experts.iter().flatten().all(|c| c.decode.is_none()));
}

#[test]
fn plan_lists_runs_of_layers_and_experts() {
    let rules = RuleSet::parse(
        "examples/placement/qwen3-30b-hot-int4.yaml",
        include_str!("../../../../examples/placement/qwen3-30b-hot-int4.yaml"),
    )
    .unwrap();
    let cfg = qwen3_30b();
    let plan = rules.resolve(&cfg).unwrap();
    let placement = uniform_placement(&cfg, 128, 32, &plan);
    let counts: Vec<usize> = placement
        .iter()
        .map(|r| r.iter().filter(|&&g| g).count())
        .collect();
    assert_eq!(counts[..4], [128; 4]);
    assert_eq!(counts[4..], [32; 44]);
    let text = plan.describe(&placement, "as-stored");
    assert!(text.contains("layers 0-3"), "{text}");
    assert!(text.contains("layers 4-39"), "{text}");
    assert!(text.contains("layers 40-47"), "{text}");
    assert!(text.contains("int4"), "{text}");
    assert!(text.contains("prefill cpu"), "{text}");
    assert_eq!(
        text.lines().filter(|l| l.contains("layers ")).count(),
        3,
        "{text}"
    );
    // docs/PLACEMENT.md shows this plan: keep it what the daemon prints
    let docs = include_str!("../../../../docs/PLACEMENT.md");
    let shown: Vec<&str> = docs
        .lines()
        .skip_while(|l| {
            !l.starts_with("placement plan (examples/placement/qwen3-30b-hot-int4.yaml)")
        })
        .take_while(|l| !l.starts_with("```"))
        .collect();
    assert_eq!(shown.len(), 15, "the docs' example plan");
    for line in shown {
        assert!(
            text.lines().any(|l| l.trim_end() == line),
            "docs line {line:?} not in\n{text}"
        );
    }
}

/// An operator-style rule file: a leading comment naming the node class and its sizing, then rules.
const CLASS_RULES: &str =
    "# moe-operator sizing for node class sm90-140g: NVIDIA-H200 (SM 9.0, 143771 MiB, AVX-512, AMX)
# 32 of 128 routed experts per layer on the GPU
- match: {experts: 0-31}
  decode: gpu
- match: {name: \".*\"}
  decode: cpu
";

#[test]
fn joined_sources_try_the_users_rules_first_and_the_plan_names_each_rules_source() {
    let user = RuleSet::parse(
        "MOE_PLACEMENT_RULES",
        "- match: {layers: 0-3}\n  decode: cpu\n",
    )
    .unwrap();
    let class = RuleSet::parse("/etc/moe/sizing/sm90-140g.yaml", CLASS_RULES).unwrap();
    let rules = RuleSet::join([user, class]).unwrap();
    assert_eq!(
        rules.source,
        "MOE_PLACEMENT_RULES + /etc/moe/sizing/sm90-140g.yaml"
    );
    let cfg = qwen3_30b();
    let plan = rules.resolve(&cfg).unwrap();
    // the user's rule decides layers 0-3 (all in DRAM) although the class rule pins 0-31 to the GPU
    for e in [0, 31, 127] {
        assert_eq!(decode_of(&plan, 2, e), Some(Residency::Cpu), "expert {e}");
    }
    assert_eq!(decode_of(&plan, 4, 0), Some(Residency::Gpu));
    assert_eq!(decode_of(&plan, 4, 31), Some(Residency::Gpu));
    assert_eq!(decode_of(&plan, 4, 32), Some(Residency::Cpu));
    let pins = plan.layer_pins();
    assert_eq!((pins[0].gpu, pins[0].dram), (0, 128));
    assert_eq!((pins[47].gpu, pins[47].dram), (32, 96));
    let placement = uniform_placement(&cfg, 128, 32, &plan);
    let text = plan.describe(&placement, "as-stored");
    let expect = [
        "placement plan (MOE_PLACEMENT_RULES + /etc/moe/sizing/sm90-140g.yaml): 1408 routed experts on the GPU, 4736 in DRAM",
        "    1. MOE_PLACEMENT_RULES (1 rule)",
        "         line 1    {layers: 0-3} decode cpu -> 512 routed experts",
        "    2. /etc/moe/sizing/sm90-140g.yaml (2 rules)",
        "         # moe-operator sizing for node class sm90-140g: NVIDIA-H200 (SM 9.0, 143771 MiB, AVX-512, AMX)",
        "         # 32 of 128 routed experts per layer on the GPU",
        "         line 3    {experts: 0-31} decode gpu -> 1408 routed experts",
        "         line 5    {name: '.*'} decode cpu -> 4224 routed experts",
        "rule MOE_PLACEMENT_RULES:1",
        "rule /etc/moe/sizing/sm90-140g.yaml:3",
        "rule /etc/moe/sizing/sm90-140g.yaml:5",
    ];
    for e in expect {
        assert!(text.contains(e), "{e:?} not in\n{text}");
    }
    assert!(!text.contains("note:"), "{text}");
}

#[test]
fn an_error_in_a_later_source_names_that_source() {
    let user = parse("- match: {layers: 0-3}\n  decode: cpu\n").unwrap();
    let bad = RuleSet::parse(
        "class.yaml",
        "# sizing\n- match: {layers: 60-63}\n  decode: gpu\n",
    )
    .unwrap();
    let err = RuleSet::join([user, bad])
        .unwrap()
        .resolve(&qwen3_30b())
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("class.yaml:2:"), "{err}");
    assert!(
        err.contains("layer 63 is beyond the model's 48 layers"),
        "{err}"
    );
    // a rule that matches nothing in a later source is reported with its source
    let user = parse("- match: {name: \".*\"}\n  decode: cpu\n").unwrap();
    let class = RuleSet::parse("class.yaml", CLASS_RULES).unwrap();
    let cfg = qwen3_30b();
    let plan = RuleSet::join([user, class]).unwrap().resolve(&cfg).unwrap();
    let text = plan.describe(&vec![vec![false; 128]; 48], "as-stored");
    assert!(
        text.contains("note: the rule at class.yaml:3 matched no routed expert"),
        "{text}"
    );
    assert!(text.contains("-> 0 routed experts"), "{text}");
}

#[test]
fn a_sources_leading_comment_is_kept_short() {
    let long = "x".repeat(300);
    let mut text = format!("---\n\n# {long}\n");
    for i in 0..40 {
        text.push_str(&format!("# line {i}\n"));
    }
    text.push_str("- match: {layers: 0}\n  decode: cpu\n# not leading\n");
    let rules = parse(&text).unwrap();
    let comment = &rules.sources[0].comment;
    assert_eq!(comment.len(), 12);
    assert!(comment[0].chars().count() <= 201, "{}", comment[0]);
    assert!(comment[0].ends_with('…'));
    assert_eq!(comment[11], "line 10");
    assert!(parse("- match: {layers: 0}\n  decode: cpu\n")
        .unwrap()
        .sources[0]
        .comment
        .is_empty());
}
