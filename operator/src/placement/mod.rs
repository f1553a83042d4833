//! Placement: which nodes can run a MoEDeployment, with what per-pod sizing, and why the others
//! cannot. Pure functions over `NodeFacts`; the controller and `moe-operator plan` share them.
//!
//! Steps: (1) hardware rules per node (schedulable, taints, selectors, AVX-512, GPU count, compute
//! capability, GPU memory); (2) each passing node proposes the sizing its hardware supports;
//! (3) the sizing that the most nodes can hold wins (ties: more GPU experts, then more CPU threads);
//! (4) nodes are checked against it for CPU, memory and hugepages. [`decide`] does this for one
//! group of nodes; [`classes::plan_fleet`] runs it per hardware class of a mixed fleet. Rejections read like the
//! scheduler's: "0/5 nodes are available: 3 insufficient memory, 2 without AVX-512."

pub mod classes;
pub mod matching;
pub mod node_facts;
pub mod sizing;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PreferredSchedulingTerm,
    Toleration,
};

use crate::crd::MoEDeploymentSpec;
use crate::model_shape::ResolvedShape;
use crate::quantity::{format_bytes, MIB};
use node_facts::{CapabilityPattern, ComputeCapability, NodeFacts};
use sizing::{HugepageKind, Sizing, SizingError};

/// Why one node cannot run the pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    Unschedulable,
    UntoleratedTaint(Vec<String>),
    SelectorMismatch,
    NoAvx512,
    InsufficientGpus {
        have: u64,
        need: u64,
    },
    NoGpuLabels,
    UnsupportedGpu(ComputeCapability),
    InsufficientGpuMemory {
        need_mib: u64,
        have_mib: u64,
    },
    GpuMemoryUnknown,
    InsufficientCpu {
        need: u64,
        have: u64,
    },
    InsufficientMemory {
        need: u64,
        have: u64,
    },
    InsufficientHugepages {
        kind: HugepageKind,
        need: u64,
        have: u64,
    },
}

impl Rejection {
    /// The phrase counted in the summary line ("3 insufficient memory").
    pub fn summary_phrase(&self) -> String {
        match self {
            Rejection::Unschedulable => "unschedulable".into(),
            Rejection::UntoleratedTaint(_) => "with untolerated taints".into(),
            Rejection::SelectorMismatch => "not matching the pod's node selector/affinity".into(),
            Rejection::NoAvx512 => "without AVX-512".into(),
            Rejection::InsufficientGpus { .. } => "insufficient nvidia.com/gpu".into(),
            Rejection::NoGpuLabels => "without GPU Feature Discovery labels".into(),
            Rejection::UnsupportedGpu(_) => "unsupported GPU compute capability".into(),
            Rejection::InsufficientGpuMemory { .. } | Rejection::GpuMemoryUnknown => {
                "insufficient GPU memory".into()
            }
            Rejection::InsufficientCpu { .. } => "insufficient cpu".into(),
            Rejection::InsufficientMemory { .. } => "insufficient memory".into(),
            Rejection::InsufficientHugepages { kind, .. } => {
                format!("insufficient {}", kind.resource_name())
            }
        }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::UntoleratedTaint(keys) => {
                write!(f, "untolerated taints: {}", keys.join(", "))
            }
            Rejection::InsufficientGpus { have, need } => {
                write!(
                    f,
                    "insufficient nvidia.com/gpu: needs {need}, allocatable {have}"
                )
            }
            Rejection::UnsupportedGpu(cc) => {
                write!(f, "GPU compute capability {cc} is not accepted")
            }
            Rejection::InsufficientGpuMemory { need_mib, have_mib } => {
                write!(
                    f,
                    "insufficient GPU memory: needs {need_mib} MiB per GPU, has {have_mib} MiB"
                )
            }
            Rejection::GpuMemoryUnknown => {
                write!(f, "GPU memory unknown (no nvidia.com/gpu.memory label)")
            }
            Rejection::InsufficientCpu { need, have } => {
                write!(
                    f,
                    "insufficient cpu: needs {need} whole CPUs, {have} available"
                )
            }
            Rejection::InsufficientMemory { need, have } => write!(
                f,
                "insufficient memory: needs {}, allocatable {}",
                format_bytes(*need),
                format_bytes(*have)
            ),
            Rejection::InsufficientHugepages { kind, need, have } => write!(
                f,
                "insufficient {}: needs {}, allocatable {}",
                kind.resource_name(),
                format_bytes(*need),
                format_bytes(*have)
            ),
            other => f.write_str(&other.summary_phrase()),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct NodeVerdict {
    pub name: String,
    pub rejections: Vec<Rejection>,
    /// Higher is better: AMX, then more GPU memory.
    pub score: u64,
    pub compute_capability: Option<ComputeCapability>,
}

impl NodeVerdict {
    pub fn qualifies(&self) -> bool {
        self.rejections.is_empty()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlacementDecision {
    /// Every node, best first; qualifying nodes have no rejections.
    pub nodes: Vec<NodeVerdict>,
    /// Chosen per-pod sizing; `None` when no node's hardware qualified.
    pub sizing: Option<Sizing>,
}

/// Tolerations the pods carry: the user's plus one for the usual GPU-node taint.
pub fn effective_tolerations(spec: &MoEDeploymentSpec) -> Vec<Toleration> {
    let mut tolerations = spec.pod.tolerations.clone();
    tolerations.push(Toleration {
        key: Some(node_facts::RESOURCE_GPU.into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Default::default()
    });
    tolerations
}

fn hardware_rejections(
    spec: &MoEDeploymentSpec,
    node: &NodeFacts,
    tolerations: &[Toleration],
) -> Vec<Rejection> {
    let mut out = Vec::new();
    if node.unschedulable {
        out.push(Rejection::Unschedulable);
    }
    let taints = matching::untolerated_taints(node, tolerations);
    if !taints.is_empty() {
        out.push(Rejection::UntoleratedTaint(taints));
    }
    if !matching::matches_pod_selectors(node, &spec.pod.node_selector, spec.pod.affinity.as_ref()) {
        out.push(Rejection::SelectorMismatch);
    }
    if !node.has_avx512() {
        out.push(Rejection::NoAvx512);
    }
    let gpu = &spec.resources.gpu;
    if node.gpus < gpu.count as u64 {
        out.push(Rejection::InsufficientGpus {
            have: node.gpus,
            need: gpu.count as u64,
        });
    }
    let patterns: Vec<CapabilityPattern> = gpu
        .compute_capabilities
        .iter()
        .filter_map(|c| CapabilityPattern::parse(c))
        .collect();
    match &node.compute_capability {
        None => out.push(Rejection::NoGpuLabels),
        Some(cc) if !patterns.iter().any(|p| p.accepts(cc)) => {
            out.push(Rejection::UnsupportedGpu(cc.clone()))
        }
        Some(_) => {}
    }
    if let Some(min) = gpu.min_memory_mib {
        match node.gpu_memory_mib {
            None => out.push(Rejection::GpuMemoryUnknown),
            Some(have) if have < min => out.push(Rejection::InsufficientGpuMemory {
                need_mib: min,
                have_mib: have,
            }),
            Some(_) => {}
        }
    }
    out
}

/// Resource checks of one node against a chosen sizing.
fn resource_rejections(node: &NodeFacts, sizing: &Sizing) -> Vec<Rejection> {
    let mut out = Vec::new();
    if let Some(have_mib) = node.gpu_memory_mib {
        let need_mib = sizing.gpu_bytes_per_gpu.div_ceil(MIB);
        // In bytes, as the plan computes `usable` (a plan may fill it to the byte).
        let usable = ((have_mib * MIB) as f64 * sizing::GPU_USABLE_FRACTION) as u64;
        if sizing.gpu_bytes_per_gpu > usable {
            out.push(Rejection::InsufficientGpuMemory { need_mib, have_mib });
        }
    }
    if (sizing.cpus as u64) > node.schedulable_cpus() {
        out.push(Rejection::InsufficientCpu {
            need: sizing.cpus as u64,
            have: node.schedulable_cpus(),
        });
    }
    if sizing.memory_bytes > node.memory_bytes {
        out.push(Rejection::InsufficientMemory {
            need: sizing.memory_bytes,
            have: node.memory_bytes,
        });
    }
    if let Some((kind, need)) = sizing.hugepages {
        let have = kind.available_on(node);
        if need > have {
            out.push(Rejection::InsufficientHugepages { kind, need, have });
        }
    }
    out
}

fn sizing_rejection(err: SizingError) -> Rejection {
    match err {
        SizingError::GpuMemoryUnknown => Rejection::GpuMemoryUnknown,
        SizingError::DenseWeightsDoNotFit {
            needed_mib,
            available_mib,
        } => Rejection::InsufficientGpuMemory {
            need_mib: needed_mib,
            have_mib: available_mib,
        },
        SizingError::GpuPlan(e) => {
            let (need_mib, have_mib) = e.shortfall_mib();
            Rejection::InsufficientGpuMemory { need_mib, have_mib }
        }
        SizingError::TooFewCpus { whole_cpus } => Rejection::InsufficientCpu {
            need: sizing::MIN_CPUS,
            have: whole_cpus,
        },
    }
}

fn score(node: &NodeFacts) -> u64 {
    node.amx_level() as u64 * 1_000_000 + node.gpu_memory_mib.unwrap_or(0).min(999_999)
}

/// Decides placement. `check_spec` must have passed for the same spec and shape.
pub fn decide(
    spec: &MoEDeploymentSpec,
    shape: Option<&ResolvedShape>,
    nodes: &[NodeFacts],
) -> PlacementDecision {
    let tolerations = effective_tolerations(spec);
    let mut verdicts: Vec<NodeVerdict> = Vec::with_capacity(nodes.len());
    let mut proposals: Vec<Sizing> = Vec::new();
    for node in nodes {
        let mut rejections = hardware_rejections(spec, node, &tolerations);
        if rejections.is_empty() {
            match sizing::size_for_node(spec, shape, node) {
                Ok(s) => {
                    if !proposals.contains(&s) {
                        proposals.push(s);
                    }
                }
                Err(e) => rejections.push(sizing_rejection(e)),
            }
        }
        verdicts.push(NodeVerdict {
            name: node.name.clone(),
            rejections,
            score: score(node),
            compute_capability: node.compute_capability.clone(),
        });
    }

    let hardware_ok: Vec<usize> = (0..nodes.len())
        .filter(|&i| verdicts[i].qualifies())
        .collect();
    let fits = |s: &Sizing| {
        hardware_ok
            .iter()
            .filter(|&&i| resource_rejections(&nodes[i], s).is_empty())
            .count()
    };
    let sizing = proposals.into_iter().max_by_key(|s| {
        (
            fits(s),
            s.gpu_experts_per_layer.unwrap_or(0),
            s.cpu_threads,
            std::cmp::Reverse(s.memory_bytes),
        )
    });
    if let Some(chosen) = &sizing {
        for &i in &hardware_ok {
            verdicts[i].rejections = resource_rejections(&nodes[i], chosen);
        }
    }
    verdicts.sort_by(|a, b| {
        b.qualifies()
            .cmp(&a.qualifies())
            .then(b.score.cmp(&a.score))
            .then(a.name.cmp(&b.name))
    });
    PlacementDecision {
        nodes: verdicts,
        sizing,
    }
}

impl PlacementDecision {
    pub fn qualified(&self) -> impl Iterator<Item = &NodeVerdict> {
        self.nodes.iter().filter(|v| v.qualifies())
    }

    pub fn qualified_names(&self) -> Vec<String> {
        self.qualified().map(|v| v.name.clone()).collect()
    }

    /// Scheduler-style line, e.g. "0/5 nodes are available: 3 insufficient memory, 2 without AVX-512."
    pub fn summary(&self) -> String {
        let available = self.qualified().count();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for verdict in &self.nodes {
            for r in &verdict.rejections {
                *counts.entry(r.summary_phrase()).or_default() += 1;
            }
        }
        let mut parts: Vec<(String, usize)> = counts.into_iter().collect();
        parts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let reasons: Vec<String> = parts.iter().map(|(p, n)| format!("{n} {p}")).collect();
        if reasons.is_empty() {
            format!("{available}/{} nodes are available.", self.nodes.len())
        } else {
            format!(
                "{available}/{} nodes are available: {}.",
                self.nodes.len(),
                reasons.join(", ")
            )
        }
    }
}

/// The user's node affinity AND ours. Required terms are OR'd by the scheduler, so the result is
/// every (user term, our term) pair with their requirements concatenated; preferences add up.
pub fn merge_node_affinity(
    user: Option<&NodeAffinity>,
    ours: Option<NodeAffinity>,
) -> Option<NodeAffinity> {
    let Some(user) = user else { return ours };
    let Some(ours) = ours else {
        return Some(user.clone());
    };
    let concat = |a: &Option<Vec<NodeSelectorRequirement>>,
                  b: &Option<Vec<NodeSelectorRequirement>>| {
        let v: Vec<NodeSelectorRequirement> = a.iter().chain(b.iter()).flatten().cloned().collect();
        (!v.is_empty()).then_some(v)
    };
    let required = match (
        &user.required_during_scheduling_ignored_during_execution,
        &ours.required_during_scheduling_ignored_during_execution,
    ) {
        (Some(u), Some(o)) => Some(NodeSelector {
            node_selector_terms: u
                .node_selector_terms
                .iter()
                .flat_map(|ut| {
                    o.node_selector_terms
                        .iter()
                        .map(move |ot| NodeSelectorTerm {
                            match_expressions: concat(&ut.match_expressions, &ot.match_expressions),
                            match_fields: concat(&ut.match_fields, &ot.match_fields),
                        })
                })
                .collect(),
        }),
        (u, o) => u.clone().or_else(|| o.clone()),
    };
    let preferred: Vec<PreferredSchedulingTerm> = user
        .preferred_during_scheduling_ignored_during_execution
        .iter()
        .chain(
            ours.preferred_during_scheduling_ignored_during_execution
                .iter(),
        )
        .flatten()
        .cloned()
        .collect();
    Some(NodeAffinity {
        required_during_scheduling_ignored_during_execution: required,
        preferred_during_scheduling_ignored_during_execution: (!preferred.is_empty())
            .then_some(preferred),
    })
}
