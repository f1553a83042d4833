//! The operator's GPU sizing and the daemon's start-up plan are one plan. For every example deployment
//! and every hardware class of the sample cluster: the operator's rendered `moe-daemon serve` arguments
//! parse with the daemon's CLI, the engine options they give plan (with the model's config.json read
//! as the engine reads it) exactly the GPU bytes, experts, dense dtype, embedding home and KV size the
//! operator estimated (margin 0: the same function on the same inputs). That the daemon then allocates
//! what its plan says is the GPU test `consumer_gpu::plan_matches_allocation_for_every_example`
//! (within 3% + 64 MiB at start, the peak within the plan + 64 MiB).
//!
//! Placement rules are resolved by the daemon against tensor names; the operator then passes
//! `--gpu-experts auto` and the daemon fills each layer around the rules' pins within the same budget
//! and KV size, so with rules the daemon's experts and bytes are at most the operator's.
//!
//! Each class's own rule file (the ConfigMap the operator renders) is read by the daemon's parser from
//! where the pod mounts it, after the deployment's rules; without rules of the user's it plans exactly
//! the operator's sizing (also when it pins experts, as for `uniform` placement), and the daemon's
//! printed plan names the file, its leading comment (the class and its sizing) and each rule.
use clap::Parser;
use moe_daemon::cli::serve::ServeArgs;
use moe_daemon::engine::gpu::memory;
use moe_daemon::engine::placement::{plan_placement, PlacementStrategy};
use moe_daemon::engine::placement_rules::RuleSet;
use moe_daemon::model::config::ModelConfig;
use moe_operator::builders::{class_rules, workload, BuildInput, ClassBuild};
use moe_operator::crd::{ExpertPlacementStrategy, MoEDeployment};
use std::path::Path;

#[derive(Parser)]
struct Daemon {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    Serve(Box<ServeArgs>),
}

fn read(rel: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

const EXAMPLES: [&str; 5] = [
    "qwen3-30b-a3b",
    "glm-4.5-air",
    "deepseek-v3",
    "smallthinker-21b",
    "glm-5.3-flash",
];

/// What one class's daemon plans from the operator's arguments and rule files.
struct ClassPlan {
    plan: moe_sizing::MemoryPlan,
    /// The plan the daemon prints at start: rule sources, comments, rules.
    printed: String,
    user_rules: bool,
}

/// Parses the class's `moe-daemon serve` arguments with the daemon's CLI (mounted rule files read from
/// where they come from: the example's ConfigMap source, the class's rendered ConfigMap) and plans.
fn daemon_plan(
    ex: &str,
    md: &MoEDeployment,
    input: &BuildInput,
    class: &ClassBuild,
    cfg: &ModelConfig,
    shape: &moe_sizing::ModelShape,
    scratch: &Path,
) -> ClassPlan {
    let mut args = workload::daemon_args(input, class, "/models/m");
    let rules = md.spec.placement.rules.as_ref();
    let mounted = format!("{}/rules.yaml", workload::RULES_MOUNT);
    let rendered = class_rules::class_rules(input, class);
    let class_file = rendered.as_ref().map(|r| {
        let file = scratch.join(&r.key);
        std::fs::write(&file, &r.text).unwrap();
        // the daemon's own parser reads the rendered text
        RuleSet::parse(&r.path(), &r.text)
            .unwrap_or_else(|e| panic!("{ex} {}: {e}\n{}", class.id, r.text));
        (r.path(), file)
    });
    for a in args.iter_mut() {
        if *a == mounted {
            *a = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../examples/placement")
                .join(configmap_source(ex))
                .display()
                .to_string();
        } else if let Some((path, file)) = &class_file {
            if a == path {
                *a = file.display().to_string();
            }
        }
    }
    if let Some(text) = rules.and_then(|r| r.inline.clone()) {
        // `=`: the text starts with `- ` (a YAML list), which clap would read as a flag
        args.push(format!("--placement-rules-yaml={text}"));
    }
    let parsed =
        Daemon::try_parse_from(std::iter::once("moe-daemon".to_string()).chain(args.clone()))
            .unwrap_or_else(|e| panic!("{ex} {}: {e}\n{}", class.id, args.join(" ")));
    let Cmd::Serve(serve) = parsed.cmd;
    let context = serve.max_model_len.unwrap_or(cfg.max_position_embeddings);
    let opts = serve
        .engine
        .serving_options(context, serve.max_running, serve.max_batch_tokens)
        .unwrap();
    let budget = opts
        .gpu_memory_limit
        .expect("the operator passes the GPU's memory as --gpu-memory-limit");
    let resolved = opts.placement_rules.as_ref().map(|r| {
        r.resolve(cfg)
            .unwrap_or_else(|e| panic!("{ex} {}: {e}", class.id))
    });
    let pins = resolved
        .as_ref()
        .map(|r| r.layer_pins())
        .unwrap_or_default();
    assert_eq!(
        rules.is_some() || class_file.is_some(),
        !pins.is_empty(),
        "{ex}"
    );
    let plan = memory::plan(&opts, shape, budget, &pins)
        .unwrap_or_else(|e| panic!("{ex} {}: the daemon refuses: {e}", class.id));
    // Where the daemon's strategy puts the experts within the plan (`frequency` starts as `uniform`
    // until routing statistics exist), printed as the daemon prints it at start.
    let strategy = match opts.placement {
        PlacementStrategy::Frequency => PlacementStrategy::Uniform,
        s => s,
    };
    let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    let printed = resolved.map_or(String::new(), |r| {
        let placement = plan_placement(
            strategy,
            &cfg.moe_layers,
            experts,
            plan.gpu_experts_per_layer as usize,
            None,
            opts.placement_seed,
            Some(&r.pins()),
        )
        .unwrap();
        let placed = placement.iter().flatten().filter(|&&g| g).count() as u64;
        assert_eq!(placed, plan.gpu_experts_total, "{ex} {}", class.id);
        r.describe(&placement, "as-stored")
    });
    ClassPlan {
        plan,
        printed,
        user_rules: rules.is_some(),
    }
}

#[test]
fn operator_sizing_is_the_daemons_plan_for_every_example() {
    let nodes = moe_operator::plan::parse_nodes(&read("examples/nodes.yaml"), "nodes").unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let mut on_24gb = Vec::new();
    let mut with_rules = Vec::new();
    let mut pinned_by_class = 0;
    for ex in EXAMPLES {
        let example =
            moe_operator::plan::parse_deployment(&read(&format!("examples/{ex}.yaml")), ex)
                .unwrap();
        // As shipped, and with `uniform` placement and no rules or live placement (the class's rules
        // then pin the lowest expert ids).
        let mut uniform = example.clone();
        uniform.spec.placement.rules = None;
        uniform.spec.placement.live_placement = false;
        uniform.spec.placement.expert_placement = ExpertPlacementStrategy::Uniform;
        for md in [example, uniform] {
            let desired =
                moe_operator::desired::compute_desired(&md, "llm", &nodes, None, None).unwrap();
            let input = desired
                .build_input
                .as_ref()
                .unwrap_or_else(|| panic!("{ex}: no node qualifies"));
            let objects = desired.objects.as_ref().unwrap();
            let sized = desired
                .shape
                .as_ref()
                .and_then(|s| s.detail.clone())
                .unwrap();
            let (_, config) = moe_sizing::known::match_known([ex]).unwrap();
            let cfg = ModelConfig::from_json(&config).unwrap();
            let qkv_bias = matches!(
                sized.attention,
                moe_sizing::Attention::Gqa { qkv_bias: true, .. }
            );
            let shape = memory::shape_of(&cfg, qkv_bias, sized.checkpoint);
            assert_eq!(
                shape, sized,
                "{ex}: the operator sizes another shape than the engine loads"
            );
            assert!(!input.classes.is_empty());
            // one rule file per class, each in its own ConfigMap
            assert_eq!(objects.class_rules.len(), input.classes.len(), "{ex}");
            for class in &input.classes {
                let ClassPlan {
                    plan,
                    printed,
                    user_rules,
                } = daemon_plan(ex, &md, input, class, &cfg, &shape, scratch.path());
                let choice = class.sizing.gpu_plan.unwrap();
                println!(
                    "{ex} on {} (operator: {} MiB): {}",
                    class.id,
                    class.sizing.gpu_bytes_per_gpu >> 20,
                    plan.describe()
                );
                println!("{printed}");
                // the daemon prints the class's file, its comment and its rules
                let file = format!("/{}.yaml ", class.id);
                assert!(
                    printed
                        .lines()
                        .any(|l| l.contains(&file) && l.contains(". ")),
                    "{ex} {}:\n{printed}",
                    class.id
                );
                assert!(
                    printed.contains(&format!(
                        "# Written by moe-operator for MoEDeployment llm/{}, node class {}:",
                        md.metadata.name.as_deref().unwrap(),
                        class.id
                    )),
                    "{printed}"
                );
                let experts = Some(plan.node_experts_per_layer as u32);
                if user_rules {
                    assert!(
                        printed.contains("1. MOE_PLACEMENT_RULES") || printed.contains("1. /"),
                        "{printed}"
                    );
                    assert!(
                        plan.total() <= class.sizing.gpu_bytes_per_gpu,
                        "{ex} {}",
                        class.id
                    );
                    assert!(
                        experts <= class.sizing.gpu_experts_per_layer,
                        "{ex} {}",
                        class.id
                    );
                    with_rules.push((ex, class.id.clone(), plan.gpu_experts_total));
                } else {
                    assert_eq!(
                        plan.total(),
                        class.sizing.gpu_bytes_per_gpu,
                        "{ex} {}",
                        class.id
                    );
                    assert_eq!(
                        plan.gpu_experts_total,
                        class.sizing.gpu_experts_per_layer.unwrap() as u64 * shape.moe_layers(),
                        "{ex} {}",
                        class.id
                    );
                    if printed.contains("decode gpu -> ") && printed.contains("decode cpu -> ") {
                        pinned_by_class += 1;
                    }
                }
                assert_eq!(
                    (plan.dense_dtype, plan.host_embeddings, plan.kv_tokens),
                    (choice.dense_dtype, choice.host_embeddings, choice.kv_tokens),
                    "{ex} {}",
                    class.id
                );
                assert!(plan.kv_tokens >= md.spec.serving.max_model_len as u64);
                if class.id.contains("24g") && !user_rules {
                    on_24gb.push((ex, plan.dense_dtype, plan.host_embeddings));
                }
            }
        }
    }
    // A 24 GB Ada node (genoa-4090-1) qualifies for GLM-4.5-Air at 64K positions once the dense
    // weights are quantized and the embeddings stay in host memory, and for SmallThinker-21B as is.
    println!("24 GB classes: {on_24gb:?}");
    assert!(on_24gb
        .iter()
        .any(|(ex, d, host)| *ex == "glm-4.5-air" && *d != moe_sizing::DenseDtype::Bf16 && *host));
    assert!(on_24gb.iter().any(|(ex, ..)| *ex == "smallthinker-21b"));
    // Rules reach the daemon's plan: Qwen3's pin the first four layers' 128 experts to the GPU; GLM's
    // (KTransformers' Glm4Moe-serve) keep every routed expert in DRAM.
    println!("GPU experts with rules: {with_rules:?}");
    assert!(with_rules
        .iter()
        .any(|(ex, _, n)| *ex == "qwen3-30b-a3b" && *n >= 4 * 128));
    assert!(with_rules
        .iter()
        .any(|(ex, _, n)| *ex == "glm-4.5-air" && *n == 0));
    // Some class splits its layers between the GPU and DRAM with pinned rules, and plans exactly
    // the operator's bytes.
    assert!(pinned_by_class > 0);
}

/// The file an example's placement-rules ConfigMap is created from (its comment says so).
fn configmap_source(example: &str) -> &'static str {
    match example {
        "glm-4.5-air" => "glm4moe-serve.yaml",
        other => panic!("{other}: no rule file known for its ConfigMap"),
    }
}
