//! Placement over node fixtures: GPU generations, DRAM, hugepages, taints, CPU features, sizing.

use k8s_openapi::api::core::v1::{Node, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::json;

use super::classes;
use super::node_facts::NodeFacts;
use super::sizing::{self, HugepageKind};
use super::*;
use crate::crd::{AutoOr, HugepageSize, MoEDeploymentSpec};
use crate::model_shape::resolve_shape;
use crate::quantity::{GIB, MIB};

/// A GPU node as NFD + GFD + the device plugin label it. `cc` = compute capability.
struct NodeFixture {
    name: &'static str,
    cc: Option<(u32, u32)>,
    gpu_mib: u64,
    gpus: u32,
    cpu: &'static str,
    memory: &'static str,
    hugepages_1gi: &'static str,
    hugepages_2mi: &'static str,
    avx512: bool,
    amx: bool,
    taints: serde_json::Value,
    unschedulable: bool,
}

impl NodeFixture {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            cc: Some((9, 0)),
            gpu_mib: 81559,
            gpus: 1,
            cpu: "64",
            memory: "512Gi",
            hugepages_1gi: "0",
            hugepages_2mi: "0",
            avx512: true,
            amx: false,
            taints: json!([]),
            unschedulable: false,
        }
    }

    /// A 24 GB Ada card (RTX 4090: SM 8.9, 24564 MiB) on the default host.
    fn ada_24g(name: &'static str) -> Self {
        Self {
            cc: Some((8, 9)),
            gpu_mib: 24564,
            ..Self::new(name)
        }
    }

    /// An RTX 4090 workstation: 32 CPUs, 128 GiB, 64 GiB of 1 GiB hugepages.
    fn rtx4090_host(name: &'static str) -> Self {
        Self {
            cpu: "32",
            memory: "128Gi",
            hugepages_1gi: "64Gi",
            ..Self::ada_24g(name)
        }
    }

    fn node(&self) -> Node {
        let mut labels = serde_json::Map::new();
        labels.insert("kubernetes.io/hostname".into(), json!(self.name));
        if self.avx512 {
            labels.insert(node_facts::LABEL_AVX512F.into(), json!("true"));
        }
        if self.amx {
            for l in node_facts::AMX_LABELS {
                labels.insert(l.into(), json!("true"));
            }
        }
        if let Some((major, minor)) = self.cc {
            labels.insert(node_facts::LABEL_GPU_MAJOR.into(), json!(major.to_string()));
            labels.insert(node_facts::LABEL_GPU_MINOR.into(), json!(minor.to_string()));
            labels.insert(
                node_facts::LABEL_GPU_MEMORY.into(),
                json!(self.gpu_mib.to_string()),
            );
        }
        serde_json::from_value(json!({
            "metadata": {"name": self.name, "labels": labels},
            "spec": {"taints": self.taints, "unschedulable": self.unschedulable},
            "status": {"allocatable": {
                "cpu": self.cpu, "memory": self.memory,
                "hugepages-1Gi": self.hugepages_1gi, "hugepages-2Mi": self.hugepages_2mi,
                "nvidia.com/gpu": self.gpus.to_string(), "pods": "110"
            }}
        }))
        .expect("fixture is a valid Node")
    }

    fn facts(&self) -> NodeFacts {
        NodeFacts::from_node(&self.node())
    }
}

fn spec(yaml: &str) -> MoEDeploymentSpec {
    serde_yaml::from_str(yaml).expect("test spec parses")
}

fn qwen_spec() -> MoEDeploymentSpec {
    spec("model: {source: {huggingFace: {repo: Qwen/Qwen3-30B-A3B}}}")
}

fn decide_for(spec: &MoEDeploymentSpec, nodes: &[NodeFixture]) -> PlacementDecision {
    let shape = resolve_shape(&spec.model, "test");
    sizing::check_spec(spec, shape.as_ref()).expect("spec sizes");
    let facts: Vec<NodeFacts> = nodes.iter().map(NodeFixture::facts).collect();
    decide(spec, shape.as_ref(), &facts)
}

fn verdict<'a>(d: &'a PlacementDecision, name: &str) -> &'a NodeVerdict {
    d.nodes
        .iter()
        .find(|v| v.name == name)
        .expect("node in decision")
}

#[test]
fn compute_capability_86_rejected_89_90_120_accepted() {
    let ampere = NodeFixture {
        cc: Some((8, 6)),
        ..NodeFixture::new("a6000")
    };
    let ada = NodeFixture {
        cc: Some((8, 9)),
        gpu_mib: 49140,
        ..NodeFixture::new("l40s")
    };
    let hopper = NodeFixture::new("h100");
    let blackwell = NodeFixture {
        cc: Some((12, 0)),
        gpu_mib: 97887,
        ..NodeFixture::new("rtx-pro-6000")
    };
    let d = decide_for(&qwen_spec(), &[ampere, ada, hopper, blackwell]);
    assert_eq!(
        verdict(&d, "a6000").rejections,
        vec![Rejection::UnsupportedGpu(node_facts::ComputeCapability {
            major: 8,
            minor: 6
        })]
    );
    let mut names = d.qualified_names();
    names.sort();
    assert_eq!(names, vec!["h100", "l40s", "rtx-pro-6000"]);
    assert_eq!(
        d.summary(),
        "3/4 nodes are available: 1 unsupported GPU compute capability."
    );
}

#[test]
fn custom_capability_list_narrows_the_set() {
    let mut s = qwen_spec();
    s.resources.gpu.compute_capabilities = vec!["9.0".into()];
    let ada = NodeFixture {
        cc: Some((8, 9)),
        ..NodeFixture::new("ada")
    };
    let d = decide_for(&s, &[ada, NodeFixture::new("hopper")]);
    assert_eq!(d.qualified_names(), vec!["hopper"]);
}

#[test]
fn scheduler_style_summary_counts_reasons() {
    let mut s = qwen_spec();
    s.resources.memory = Some(Quantity("600Gi".into()));
    let nodes = [
        NodeFixture::new("m1"),
        NodeFixture::new("m2"),
        NodeFixture::new("m3"),
        NodeFixture {
            avx512: false,
            memory: "1Ti",
            ..NodeFixture::new("e1")
        },
        NodeFixture {
            avx512: false,
            memory: "1Ti",
            ..NodeFixture::new("e2")
        },
    ];
    let d = decide_for(&s, &nodes);
    assert_eq!(
        d.summary(),
        "0/5 nodes are available: 3 insufficient memory, 2 without AVX-512."
    );
    assert_eq!(
        verdict(&d, "m1").rejections[0].to_string(),
        "insufficient memory: needs 600Gi, allocatable 512Gi"
    );
    assert!(d.sizing.is_none() || d.qualified().next().is_none());
}

#[test]
fn gpu_count_and_missing_gfd_labels() {
    let mut s = qwen_spec();
    s.resources.gpu.count = 2;
    let one_gpu = NodeFixture::new("one");
    let no_labels = NodeFixture {
        cc: None,
        gpus: 2,
        ..NodeFixture::new("nolabels")
    };
    let two = NodeFixture {
        gpus: 2,
        ..NodeFixture::new("two")
    };
    let d = decide_for(&s, &[one_gpu, no_labels, two]);
    assert_eq!(d.qualified_names(), vec!["two"]);
    assert_eq!(
        verdict(&d, "one").rejections,
        vec![Rejection::InsufficientGpus { have: 1, need: 2 }]
    );
    assert_eq!(
        verdict(&d, "nolabels").rejections,
        vec![Rejection::NoGpuLabels]
    );
}

#[test]
fn taints_unschedulable_and_tolerations() {
    let tainted = NodeFixture {
        taints: json!([{"key": "dedicated", "value": "batch", "effect": "NoSchedule"}]),
        ..NodeFixture::new("tainted")
    };
    let gpu_tainted = NodeFixture {
        taints: json!([{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]),
        ..NodeFixture::new("gpu-tainted")
    };
    let cordoned = NodeFixture {
        unschedulable: true,
        ..NodeFixture::new("cordoned")
    };
    let mut s = qwen_spec();
    let d = decide_for(&s, &[tainted, gpu_tainted, cordoned]);
    assert_eq!(
        d.qualified_names(),
        vec!["gpu-tainted"],
        "the GPU taint is tolerated by default"
    );
    assert_eq!(
        verdict(&d, "tainted").rejections,
        vec![Rejection::UntoleratedTaint(vec!["dedicated".into()])]
    );
    assert_eq!(
        verdict(&d, "cordoned").rejections,
        vec![Rejection::Unschedulable]
    );

    s.pod.tolerations.push(Toleration {
        key: Some("dedicated".into()),
        operator: Some("Equal".into()),
        value: Some("batch".into()),
        effect: Some("NoSchedule".into()),
        toleration_seconds: None,
    });
    let tainted = NodeFixture {
        taints: json!([{"key": "dedicated", "value": "batch", "effect": "NoSchedule"}]),
        ..NodeFixture::new("tainted")
    };
    assert_eq!(
        decide_for(&s, &[tainted]).qualified_names(),
        vec!["tainted"]
    );
}

#[test]
fn node_selector_filters_candidates() {
    let mut s = qwen_spec();
    s.pod
        .node_selector
        .insert("kubernetes.io/hostname".into(), "b".into());
    let d = decide_for(&s, &[NodeFixture::new("a"), NodeFixture::new("b")]);
    assert_eq!(d.qualified_names(), vec!["b"]);
    assert_eq!(
        verdict(&d, "a").rejections,
        vec![Rejection::SelectorMismatch]
    );
}

fn plan_for(spec: &MoEDeploymentSpec, nodes: &[NodeFixture]) -> classes::FleetPlan {
    let facts: Vec<NodeFacts> = nodes.iter().map(|n| n.facts()).collect();
    let shape = resolve_shape(&spec.model, "x");
    classes::plan_fleet(spec, shape.as_ref(), &facts)
}

#[test]
fn amx_and_plain_nodes_are_separate_classes() {
    let plain = NodeFixture::new("plain");
    let amx = NodeFixture {
        amx: true,
        ..NodeFixture::new("sapphire")
    };
    let d = decide_for(&qwen_spec(), &[plain, amx]);
    assert_eq!(d.qualified_names(), vec!["sapphire", "plain"]);
    let fleet = plan_for(
        &qwen_spec(),
        &[
            NodeFixture::new("plain"),
            NodeFixture {
                amx: true,
                ..NodeFixture::new("sapphire")
            },
        ],
    );
    let ids: Vec<&str> = fleet.classes.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, vec!["sm90-80g", "sm90-80g-amx"]);
}

#[test]
fn class_affinity_is_one_term_of_labels_and_names_no_node() {
    let ada = NodeFixture {
        cc: Some((8, 9)),
        gpu_mib: 49140,
        ..NodeFixture::new("ada-1")
    };
    let fleet = plan_for(
        &qwen_spec(),
        &[NodeFixture::new("h-2"), ada, NodeFixture::new("h-1")],
    );
    assert_eq!(fleet.classes.len(), 2);
    for class in &fleet.classes {
        let required = class
            .key
            .node_affinity()
            .required_during_scheduling_ignored_during_execution
            .unwrap();
        assert_eq!(required.node_selector_terms.len(), 1);
        let term = &required.node_selector_terms[0];
        assert_eq!(term.match_fields, None, "node names must not be pinned");
        for e in term.match_expressions.as_ref().unwrap() {
            assert!(!e.key.contains("hostname"), "{e:?}");
            assert_eq!(e.values.as_ref().map(|v| v.len()), Some(1), "{e:?}");
        }
    }
    let hopper = fleet.classes.iter().find(|c| c.id == "sm90-80g").unwrap();
    assert_eq!(hopper.nodes, vec!["h-1", "h-2"]);
    // Adding a third identical node changes neither the classes' affinity nor their sizing.
    let nodes = [
        NodeFixture::new("h-1"),
        NodeFixture::new("h-2"),
        NodeFixture::new("h-3"),
    ];
    let three = plan_for(&qwen_spec(), &nodes);
    let two = plan_for(&qwen_spec(), &nodes[..2]);
    assert_eq!(three.classes.len(), 1);
    assert_eq!(three.classes[0].key, two.classes[0].key);
    assert_eq!(three.classes[0].sizing, two.classes[0].sizing);
}

#[test]
fn each_class_affinity_selects_exactly_its_own_nodes() {
    let nodes = [
        NodeFixture::new("h-1"),
        NodeFixture {
            amx: true,
            ..NodeFixture::new("h-amx")
        },
        NodeFixture {
            cc: Some((8, 9)),
            gpu_mib: 49140,
            ..NodeFixture::new("ada-1")
        },
        NodeFixture {
            hugepages_1gi: "96Gi",
            ..NodeFixture::ada_24g("ada-24g")
        },
        NodeFixture {
            cc: Some((8, 6)),
            ..NodeFixture::new("ampere-1")
        },
    ];
    let fleet = plan_for(&qwen_spec(), &nodes);
    assert_eq!(fleet.classes.len(), 4, "{:?}", fleet.classes);
    assert_eq!(fleet.rejected.len(), 1);
    assert!(fleet.rejected[0]
        .reason
        .contains("unsupported GPU compute capability"));
    for class in &fleet.classes {
        let affinity = k8s_openapi::api::core::v1::Affinity {
            node_affinity: Some(class.key.node_affinity()),
            ..Default::default()
        };
        for node in &nodes {
            let facts = node.facts();
            assert_eq!(
                super::matching::matches_pod_selectors(
                    &facts,
                    &Default::default(),
                    Some(&affinity)
                ),
                class.nodes.contains(&facts.name),
                "class {} node {}",
                class.id,
                facts.name
            );
        }
    }
    // The 24 GB class keeps fewer experts on the GPU than the 48 GB one.
    let experts = |id: &str| {
        fleet
            .classes
            .iter()
            .find(|c| c.id == id)
            .unwrap()
            .sizing
            .gpu_experts_per_layer
            .unwrap()
    };
    assert!(experts("sm89-24g") < experts("sm89-48g"));
    assert_eq!(experts("sm90-80g"), 128);
}

#[test]
fn nodes_left_out_for_resources_form_a_further_tier() {
    // Same labels. Two nodes have 1 GiB hugepages for the spilled experts but little DRAM; the
    // third has no hugepages and plenty of DRAM. The sizing two nodes hold (experts in hugepages)
    // cannot run on the third, which gets its own tier (experts in plain DRAM).
    let gpu24 = |name: &'static str, hp: &'static str, memory: &'static str| NodeFixture {
        hugepages_1gi: hp,
        memory,
        ..NodeFixture::ada_24g(name)
    };
    let fleet = plan_for(
        &qwen_spec(),
        &[
            gpu24("a", "96Gi", "32Gi"),
            gpu24("b", "96Gi", "32Gi"),
            gpu24("c", "0", "512Gi"),
        ],
    );
    let ids: Vec<&str> = fleet.classes.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, vec!["sm89-24g", "sm89-24g-t2"], "{:?}", fleet.classes);
    assert_eq!(fleet.classes[1].nodes, vec!["c"]);
    assert!(fleet.classes[0].sizing.hugepages.is_some());
    assert!(fleet.classes[1].sizing.hugepages.is_none());
}

#[test]
fn user_affinity_is_anded_with_ours() {
    use k8s_openapi::api::core::v1::{
        NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    };
    let term = |key: &str| NodeSelectorTerm {
        match_expressions: Some(vec![NodeSelectorRequirement {
            key: key.into(),
            operator: "Exists".into(),
            values: None,
        }]),
        match_fields: None,
    };
    let user = NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: vec![term("zone-a"), term("zone-b")],
        }),
        preferred_during_scheduling_ignored_during_execution: None,
    };
    let ours = NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: vec![term("gpu-x"), term("gpu-y")],
        }),
        preferred_during_scheduling_ignored_during_execution: None,
    };
    let merged = super::merge_node_affinity(Some(&user), Some(ours.clone())).unwrap();
    let terms = merged
        .required_during_scheduling_ignored_during_execution
        .unwrap()
        .node_selector_terms;
    let keys: Vec<Vec<String>> = terms
        .iter()
        .map(|t| {
            t.match_expressions
                .as_ref()
                .unwrap()
                .iter()
                .map(|e| e.key.clone())
                .collect()
        })
        .collect();
    assert_eq!(
        keys,
        vec![
            vec!["zone-a", "gpu-x"],
            vec!["zone-a", "gpu-y"],
            vec!["zone-b", "gpu-x"],
            vec!["zone-b", "gpu-y"]
        ]
    );
    assert_eq!(
        super::merge_node_affinity(None, Some(ours.clone())),
        Some(ours)
    );
}

#[test]
fn auto_puts_all_qwen_experts_on_an_80gb_gpu() {
    let d = decide_for(&qwen_spec(), &[NodeFixture::new("h100")]);
    let s = d.sizing.expect("sizing");
    assert_eq!(s.gpu_experts_per_layer, Some(128));
    assert_eq!(s.hugepages, None);
    assert_eq!(s.memory_bytes, 4 * GIB);
    assert_eq!((s.cpus, s.cpu_threads), (62, 61));
}

#[test]
fn auto_on_a_24gb_gpu_spills_experts_to_hugepages() {
    // RTX 4090, the shared plan (the daemon's): 0.9 × 24564 MiB less bf16 dense weights and table
    // (3.0 GiB), two 32K sequences of bf16 KV (6 GiB), a 2048-token step's buffers (the fused
    // long-prefill attention needs no score blocks), CUDA graphs and layerwise prefill's staging
    // (2.2 GiB) leaves room for 25 of 128 experts per layer.
    let node = NodeFixture::rtx4090_host("rtx4090");
    let d = decide_for(&qwen_spec(), &[node]);
    let s = d.sizing.expect("sizing");
    assert_eq!(s.gpu_experts_per_layer, Some(25));
    let plan = s.gpu_plan.expect("known model: the shared plan");
    assert_eq!(plan.dense_dtype, moe_sizing::DenseDtype::Bf16);
    assert!(!plan.host_embeddings && plan.kv_tokens >= 2 * 32768);
    assert!(s.gpu_bytes_per_gpu as f64 <= 24564.0 * 1048576.0 * 0.9);
    // 103 experts × 9 MiB = 927 MiB per layer, one mapping per layer → 1 GiB page each: 48 pages
    // for 43.5 GiB of experts (4.5 GiB empty, within the 1/8 the daemon accepts for 1 GiB pages).
    assert_eq!(s.hugepages, Some((HugepageKind::OneGi, 48 * GIB)));
    // 4 GiB runtime + 5% of the DRAM experts.
    assert_eq!(s.memory_bytes, 6321 * crate::quantity::MIB);
    assert_eq!((s.cpus, s.cpu_threads), (30, 29));
    assert!(d.nodes[0].qualifies());
}

#[test]
fn live_placement_keeps_every_expert_in_dram() {
    // Live re-placement keeps a DRAM copy of the GPU experts too (they can move back), so DRAM holds
    // all 128 × 48 experts × 9 MiB = 54 GiB instead of the DRAM experts' 44.3 GiB. A layer's 1152 MiB
    // would take two 1 GiB pages (96 GiB for 54: the daemon would not use them), and this node has no
    // 2 MiB pages, so the experts count against memory; with 2 MiB pages they go there.
    let node = NodeFixture::rtx4090_host("rtx4090");
    let mut spec = qwen_spec();
    let without = decide_for(&spec, std::slice::from_ref(&node))
        .sizing
        .unwrap();
    assert_eq!(without.hugepages, Some((HugepageKind::OneGi, 48 * GIB)));
    spec.placement.live_placement = true;
    let d = decide_for(&spec, &[node]);
    let s = d.sizing.expect("sizing");
    assert_eq!(s.hugepages, None);
    assert!(s.memory_bytes >= 4 * GIB + 54 * GIB, "{}", s.memory_bytes);
    let with_2mi = NodeFixture {
        hugepages_2mi: "60Gi",
        ..NodeFixture::rtx4090_host("rtx4090")
    };
    let s = decide_for(&spec, &[with_2mi]).sizing.unwrap();
    // 48 layers × (576 + 1) pages of 2 MiB
    assert_eq!(s.hugepages, Some((HugepageKind::TwoMi, 48 * 577 * 2 * MIB)));
    assert!(s.memory_bytes < without.memory_bytes + GIB);
}

#[test]
fn hugepages_auto_falls_back_to_2mi_then_off() {
    let base = |name, h1, h2| NodeFixture {
        hugepages_1gi: h1,
        hugepages_2mi: h2,
        ..NodeFixture::ada_24g(name)
    };
    let two_mi = decide_for(&qwen_spec(), &[base("two", "0", "50Gi")])
        .sizing
        .unwrap();
    assert_eq!(two_mi.hugepages.map(|h| h.0), Some(HugepageKind::TwoMi));
    let none = decide_for(&qwen_spec(), &[base("none", "0", "0")])
        .sizing
        .unwrap();
    assert_eq!(none.hugepages, None);
    assert!(
        none.memory_bytes > 40 * GIB,
        "experts count against memory when hugepages are off"
    );
}

/// SmallThinker-21B with every expert in DRAM: 64 × 11.25 MiB = 720 MiB per layer. 1 GiB pages would
/// leave 30 % of 52 GiB empty (the daemon's own rule uses 1 GiB pages only within 1/8), so a node with
/// both kinds gives the pod 2 MiB pages: 52 layers × (360 + 1) pages, not the total's 18,720.
#[test]
fn smallthinker_experts_go_to_2mi_pages_not_half_empty_1gi_ones() {
    let mut spec =
        spec("model: {source: {huggingFace: {repo: PowerInfer/SmallThinker-21BA3B-Instruct}}}");
    spec.placement.gpu_experts_per_layer = AutoOr::Count(0);
    let node = NodeFixture {
        hugepages_1gi: "64Gi",
        hugepages_2mi: "64Gi",
        ..NodeFixture::ada_24g("both")
    };
    let s = decide_for(&spec, &[node]).sizing.expect("sizing");
    assert_eq!(s.gpu_experts_per_layer, Some(0));
    assert_eq!(s.hugepages, Some((HugepageKind::TwoMi, 52 * 361 * 2 * MIB)));
    assert_eq!(
        sizing::hugepage_bytes(HugepageKind::OneGi, 52, 720 * MIB),
        52 * GIB
    );
    // explicit 1Gi: what the daemon maps, whole pages per layer
    spec.placement.hugepages.size = HugepageSize::OneGi;
    let node = NodeFixture {
        hugepages_1gi: "64Gi",
        ..NodeFixture::ada_24g("one")
    };
    let s = decide_for(&spec, &[node]).sizing.expect("sizing");
    assert_eq!(s.hugepages, Some((HugepageKind::OneGi, 52 * GIB)));
}

#[test]
fn explicit_hugepages_missing_rejects_node() {
    let mut s = qwen_spec();
    s.placement.hugepages.size = HugepageSize::OneGi;
    s.placement.hugepages.amount = Some(Quantity("40Gi".into()));
    let d = decide_for(
        &s,
        &[NodeFixture {
            hugepages_1gi: "16Gi",
            ..NodeFixture::new("small")
        }],
    );
    assert_eq!(
        d.nodes[0].rejections,
        vec![Rejection::InsufficientHugepages {
            kind: HugepageKind::OneGi,
            need: 40 * GIB,
            have: 16 * GIB
        }]
    );
    assert_eq!(
        d.summary(),
        "0/1 nodes are available: 1 insufficient hugepages-1Gi."
    );
}

#[test]
fn deepseek_v3_needs_big_dram_and_rejects_small_nodes() {
    let s = spec("model: {source: {huggingFace: {repo: deepseek-ai/DeepSeek-V3}}}");
    let big = NodeFixture {
        memory: "1536Gi",
        hugepages_1gi: "700Gi",
        amx: true,
        ..NodeFixture::new("big")
    };
    let small = NodeFixture {
        memory: "256Gi",
        ..NodeFixture::new("small")
    };
    let d = decide_for(&s, &[big, small]);
    assert_eq!(d.qualified_names(), vec!["big"]);
    let experts = d.sizing.as_ref().unwrap().gpu_experts_per_layer.unwrap();
    assert!(
        (1..40).contains(&experts),
        "a few DeepSeek experts per layer fit on 80 GB: {experts}"
    );
    // The chosen sizing keeps ~600 GiB of experts in 1 GiB hugepages, which the small node lacks.
    assert!(
        matches!(
            verdict(&d, "small").rejections[..],
            [Rejection::InsufficientHugepages {
                kind: HugepageKind::OneGi,
                ..
            }]
        ),
        "{:?}",
        verdict(&d, "small").rejections
    );
    let mut no_hugepages = s.clone();
    no_hugepages.placement.hugepages.size = HugepageSize::Off;
    let small = NodeFixture {
        memory: "256Gi",
        ..NodeFixture::new("small")
    };
    let d = decide_for(&no_hugepages, &[small]);
    assert!(matches!(
        d.nodes[0].rejections[..],
        [Rejection::InsufficientMemory { .. }]
    ));
}

#[test]
fn explicit_gpu_experts_beyond_gpu_memory_rejects() {
    let mut s = spec("model: {source: {huggingFace: {repo: zai-org/GLM-4.5-Air}}}");
    s.placement.gpu_experts_per_layer = AutoOr::Count(128);
    s.placement.hugepages.size = HugepageSize::Off;
    let d = decide_for(&s, &[NodeFixture::new("h100")]);
    assert!(matches!(
        d.nodes[0].rejections[..],
        [Rejection::InsufficientGpuMemory { .. }]
    ));
}

#[test]
fn dense_weights_larger_than_gpu_reject_the_node() {
    let s = spec("model: {source: {huggingFace: {repo: deepseek-ai/DeepSeek-V3}}}");
    let small_gpu = NodeFixture {
        cc: Some((8, 9)),
        gpu_mib: 16384,
        memory: "2Ti",
        ..NodeFixture::new("l4ish")
    };
    let d = decide_for(&s, &[small_gpu]);
    assert!(matches!(
        d.nodes[0].rejections[..],
        [Rejection::InsufficientGpuMemory { .. }]
    ));
    assert!(d.sizing.is_none());
}

#[test]
fn chosen_sizing_is_the_one_most_nodes_hold() {
    // Two 48 GB nodes and one 96 GB node: the 96 GB sizing would leave more DRAM experts for the
    // small nodes' GPUs to miss; the 48 GB sizing runs on all three.
    let ada = |name| NodeFixture {
        cc: Some((8, 9)),
        gpu_mib: 49140,
        ..NodeFixture::new(name)
    };
    let big = NodeFixture {
        cc: Some((12, 0)),
        gpu_mib: 97887,
        ..NodeFixture::new("big")
    };
    let s = spec("model: {source: {huggingFace: {repo: zai-org/GLM-4.5-Air}}}");
    let d = decide_for(&s, &[ada("a1"), ada("a2"), big]);
    assert_eq!(d.qualified().count(), 3, "{}", d.summary());
}

#[test]
fn explicit_cpu_threads_and_too_few_cpus() {
    let mut s = qwen_spec();
    s.placement.cpu_threads = AutoOr::Count(40);
    let d = decide_for(
        &s,
        &[NodeFixture {
            cpu: "32",
            ..NodeFixture::new("n")
        }],
    );
    assert_eq!(
        d.nodes[0].rejections,
        vec![Rejection::InsufficientCpu { need: 41, have: 32 }]
    );
    let tiny = decide_for(
        &qwen_spec(),
        &[NodeFixture {
            cpu: "3500m",
            ..NodeFixture::new("tiny")
        }],
    );
    assert!(matches!(
        tiny.nodes[0].rejections[..],
        [Rejection::InsufficientCpu { .. }]
    ));
}

#[test]
fn unknown_model_needs_memory_and_defers_gpu_experts_to_the_daemon() {
    let mut s = spec("model: {source: {hostPath: {path: /models/custom}}}");
    assert_eq!(
        sizing::check_spec(&s, None),
        Err(sizing::SpecSizingError::MemoryNeedsShape)
    );
    s.resources.memory = Some(Quantity("96Gi".into()));
    let d = decide_for(&s, &[NodeFixture::new("n")]);
    let sizing = d.sizing.unwrap();
    assert_eq!(sizing.gpu_experts_per_layer, None);
    assert_eq!(sizing.memory_bytes, 96 * GIB);
    s.resources.memory = Some(Quantity("lots".into()));
    assert!(matches!(
        sizing::check_spec(&s, None),
        Err(sizing::SpecSizingError::BadQuantity { .. })
    ));
}

#[test]
fn empty_cluster_summary() {
    let d = decide_for(&qwen_spec(), &[]);
    assert_eq!(d.summary(), "0/0 nodes are available.");
    assert!(d.sizing.is_none());
}

#[test]
fn two_gpus_are_planned_per_gpu_with_the_experts_of_both() {
    // Qwen3-30B-A3B on 24 GB cards: one card holds 23 experts per layer (see above); two cards
    // tensor-parallel hold half the attention, KV and lm_head each, so each holds more experts and
    // the node more than twice as many.
    let card = |name, gpus| NodeFixture {
        gpus,
        hugepages_2mi: "64Gi",
        ..NodeFixture::rtx4090_host(name)
    };
    let one = decide_for(&qwen_spec(), &[card("one", 1)])
        .sizing
        .expect("one GPU");
    let mut s = qwen_spec();
    s.resources.gpu.count = 2;
    let two = decide_for(&s, &[card("two", 2)]).sizing.expect("two GPUs");
    let (e1, e2) = (
        one.gpu_experts_per_layer.unwrap(),
        two.gpu_experts_per_layer.unwrap(),
    );
    assert!(e2 > 2 * e1, "{e1} experts on one GPU, {e2} on two");
    assert!(two.gpu_bytes_per_gpu as f64 <= 24564.0 * 1048576.0 * 0.9);
    // fewer experts stay in DRAM: fewer hugepages (2 MiB ones: a layer's ~700 MiB would leave 1 GiB
    // pages a third empty)
    assert!(two.hugepages.unwrap().1 < one.hugepages.unwrap().1);
}
