//! Mixed fleets: nodes grouped into hardware classes, one sizing (and one StatefulSet) per class.
//!
//! A class is what the scheduler can tell apart by labels — GPU compute capability, GPU memory and
//! product (GPU Feature Discovery), AVX-512 and AMX (Node Feature Discovery) — refined by what the
//! node offers as allocatable (CPUs, DRAM, hugepages): within one label group the sizing that the
//! most nodes hold forms the first class, and the nodes it leaves out for resources (e.g. an H200
//! with 64 GiB of DRAM next to H200s with 2 TiB) get another round, each round a further class
//! ("tier"). Tiers of one label group share the node affinity; the pod's resource requests keep a
//! larger tier off the smaller nodes.
//!
//! Replicas are split over the classes (see [`split_replicas`]): one per class while there are at
//! least as many replicas as classes, the rest in proportion to each class's qualifying nodes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
};

use super::node_facts::{
    ComputeCapability, NodeFacts, AMX_LABELS, LABEL_AVX512F, LABEL_GPU_MAJOR, LABEL_GPU_MEMORY,
    LABEL_GPU_MINOR, LABEL_GPU_PRODUCT,
};
use super::sizing::Sizing;
use super::{decide, NodeVerdict, PlacementDecision};
use crate::crd::MoEDeploymentSpec;
use crate::model_shape::ResolvedShape;

/// The label-visible hardware of a node: what a node affinity can require.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClassKey {
    pub compute_capability: Option<ComputeCapability>,
    pub gpu_memory_mib: Option<u64>,
    pub gpu_product: Option<String>,
    pub avx512: bool,
    /// One flag per [`AMX_LABELS`] entry.
    pub amx: [bool; 3],
}

impl ClassKey {
    pub fn of(node: &NodeFacts) -> Self {
        let flag = |l: &str| node.labels.get(l).is_some_and(|v| v == "true");
        Self {
            compute_capability: node.compute_capability.clone(),
            gpu_memory_mib: node.gpu_memory_mib,
            gpu_product: node.labels.get(LABEL_GPU_PRODUCT).cloned(),
            avx512: node.has_avx512(),
            amx: [
                flag(AMX_LABELS[0]),
                flag(AMX_LABELS[1]),
                flag(AMX_LABELS[2]),
            ],
        }
    }

    /// Short DNS-label part naming the class, e.g. `sm89-24g`, `sm120-96g-amx`.
    pub fn slug(&self) -> String {
        let mut s = match &self.compute_capability {
            Some(cc) => format!("sm{}{}", cc.major, cc.minor),
            None => "nogpu".into(),
        };
        if let Some(mib) = self.gpu_memory_mib {
            s.push_str(&format!("-{}g", (mib + 512) / 1024));
        }
        if self.amx.iter().all(|f| *f) {
            s.push_str("-amx");
        } else if self.amx.iter().any(|f| *f) {
            s.push_str("-amxpart");
        }
        s
    }

    /// Human-readable, e.g. `NVIDIA-H200 (SM 9.0, 143771 MiB, AVX-512)`.
    pub fn describe(&self) -> String {
        let gpu = self.gpu_product.clone().unwrap_or_else(|| {
            if self.compute_capability.is_some() {
                "GPU".into()
            } else {
                "node".into()
            }
        });
        let cc = self
            .compute_capability
            .as_ref()
            .map_or("no GPU labels".to_string(), |c| format!("SM {c}"));
        let mem = self
            .gpu_memory_mib
            .map_or(String::new(), |m| format!(", {m} MiB"));
        let cpu = match (self.avx512, self.amx.iter().all(|f| *f)) {
            (true, true) => ", AVX-512, AMX",
            (true, false) => ", AVX-512",
            (false, _) => ", no AVX-512",
        };
        format!("{gpu} ({cc}{mem}{cpu})")
    }

    /// Required node affinity selecting exactly this label class (never node names): AVX-512, the
    /// compute capability, the exact GPU memory and product labels, and each AMX label present or
    /// absent as on the class's nodes (`NotIn [true]` also matches nodes without the label).
    pub fn node_affinity(&self) -> NodeAffinity {
        let req = |key: &str, op: &str, value: String| NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(vec![value]),
        };
        let mut exprs = vec![req(LABEL_AVX512F, "In", "true".into())];
        if let Some(cc) = &self.compute_capability {
            exprs.push(req(LABEL_GPU_MAJOR, "In", cc.major.to_string()));
            exprs.push(req(LABEL_GPU_MINOR, "In", cc.minor.to_string()));
        }
        if let Some(mib) = self.gpu_memory_mib {
            exprs.push(req(LABEL_GPU_MEMORY, "In", mib.to_string()));
        }
        if let Some(product) = &self.gpu_product {
            exprs.push(req(LABEL_GPU_PRODUCT, "In", product.clone()));
        }
        for (label, present) in AMX_LABELS.iter().zip(self.amx) {
            exprs.push(req(
                label,
                if present { "In" } else { "NotIn" },
                "true".into(),
            ));
        }
        NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(exprs),
                    match_fields: None,
                }],
            }),
            preferred_during_scheduling_ignored_during_execution: None,
        }
    }
}

/// A class that gets a StatefulSet.
#[derive(Clone, Debug, PartialEq)]
pub struct HardwareClass {
    /// Unique within the deployment; part of the StatefulSet name and its pod label.
    pub id: String,
    pub key: ClassKey,
    pub description: String,
    pub sizing: Sizing,
    /// Nodes of this class able to run its sizing.
    pub nodes: Vec<String>,
}

/// A label class none of whose nodes can run the model, with the scheduler-style reason.
#[derive(Clone, Debug, PartialEq)]
pub struct RejectedClass {
    pub description: String,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct FleetPlan {
    /// Best first: more GPU experts per layer, then more nodes.
    pub classes: Vec<HardwareClass>,
    pub rejected: Vec<RejectedClass>,
    /// Every node's verdict, all classes together (qualifying nodes first).
    pub overall: PlacementDecision,
}

/// Groups the nodes into classes and sizes each one.
pub fn plan_fleet(
    spec: &MoEDeploymentSpec,
    shape: Option<&ResolvedShape>,
    nodes: &[NodeFacts],
) -> FleetPlan {
    let mut groups: BTreeMap<ClassKey, Vec<NodeFacts>> = BTreeMap::new();
    for node in nodes {
        groups
            .entry(ClassKey::of(node))
            .or_default()
            .push(node.clone());
    }
    let mut classes = Vec::new();
    let mut rejected = Vec::new();
    let mut verdicts: Vec<NodeVerdict> = Vec::with_capacity(nodes.len());
    for (key, members) in groups {
        let first = decide(spec, shape, &members);
        let mut final_verdicts: BTreeMap<String, NodeVerdict> = first
            .nodes
            .iter()
            .map(|v| (v.name.clone(), v.clone()))
            .collect();
        let mut round = first.clone();
        let mut remaining = members.clone();
        let mut tier = 0;
        // Each round takes the nodes the previous sizing left out for resources only.
        while let Some(sizing) = round.sizing.clone() {
            let qualified = round.qualified_names();
            if qualified.is_empty() {
                break;
            }
            tier += 1;
            for name in &qualified {
                if let Some(v) = round.nodes.iter().find(|v| &v.name == name) {
                    final_verdicts.insert(name.clone(), v.clone());
                }
            }
            let slug = key.slug();
            classes.push(HardwareClass {
                id: if tier == 1 {
                    slug
                } else {
                    format!("{slug}-t{tier}")
                },
                key: key.clone(),
                description: key.describe(),
                sizing,
                nodes: qualified.clone(),
            });
            remaining.retain(|n| !qualified.contains(&n.name));
            if remaining.is_empty() {
                break;
            }
            round = decide(spec, shape, &remaining);
        }
        if tier == 0 {
            rejected.push(RejectedClass {
                description: key.describe(),
                reason: first.summary(),
            });
        }
        verdicts.extend(final_verdicts.into_values());
    }
    classes.sort_by(|a, b| {
        b.sizing
            .gpu_experts_per_layer
            .cmp(&a.sizing.gpu_experts_per_layer)
            .then(b.nodes.len().cmp(&a.nodes.len()))
            .then(a.id.cmp(&b.id))
    });
    dedupe_ids(&mut classes);
    verdicts.sort_by(|a, b| {
        b.qualifies()
            .cmp(&a.qualifies())
            .then(b.score.cmp(&a.score))
            .then(a.name.cmp(&b.name))
    });
    let overall = PlacementDecision {
        nodes: verdicts,
        sizing: classes.first().map(|c| c.sizing.clone()),
    };
    FleetPlan {
        classes,
        rejected,
        overall,
    }
}

/// Two label groups can share a slug (GPU memory rounded to GiB, unlabelled products): suffix them.
fn dedupe_ids(classes: &mut [HardwareClass]) {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for class in classes.iter_mut() {
        let n = seen.entry(class.id.clone()).or_default();
        *n += 1;
        if *n > 1 {
            class.id = format!("{}-{}", class.id, n);
        }
    }
}

/// Splits `total` replicas over classes given in preference order with their qualifying node
/// counts. When `total` is at least the number of classes, each class gets one and the rest is
/// shared in proportion to the node counts (largest remainder, ties to the earlier class), except
/// that a class gets more replicas than it has nodes only when every class is full; with fewer
/// replicas than classes, the first `total` classes get one each.
pub fn split_replicas(total: i32, node_counts: &[usize]) -> Vec<i32> {
    let k = node_counts.len();
    let mut out = vec![0i32; k];
    if k == 0 || total <= 0 {
        return out;
    }
    let total = total as usize;
    if total < k {
        for slot in out.iter_mut().take(total) {
            *slot = 1;
        }
        return out;
    }
    let rest = total - k;
    let nodes: usize = node_counts.iter().sum::<usize>().max(1);
    let mut given = 0;
    let mut remainders: Vec<(usize, usize)> = Vec::with_capacity(k);
    for (i, &n) in node_counts.iter().enumerate() {
        let share = rest * n / nodes;
        out[i] = 1 + share as i32;
        given += share;
        remainders.push((rest * n % nodes, i));
    }
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in remainders.iter().take(rest - given) {
        out[i] += 1;
    }
    // A replica beyond its class's node count would stay Pending while another class has an idle
    // node: move it there (to the earliest such class), as long as any class has room.
    loop {
        let over = (0..k)
            .rev()
            .find(|&i| out[i] as usize > node_counts[i].max(1));
        let room = (0..k).find(|&j| (out[j] as usize) < node_counts[j]);
        match (over, room) {
            (Some(i), Some(j)) => {
                out[i] -= 1;
                out[j] += 1;
            }
            _ => return out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_split_one_per_class_then_by_nodes() {
        assert_eq!(split_replicas(0, &[1, 1, 1]), vec![0, 0, 0]);
        assert_eq!(split_replicas(2, &[1, 1, 1]), vec![1, 1, 0]);
        assert_eq!(split_replicas(3, &[1, 1, 1]), vec![1, 1, 1]);
        // 7 = 3 + 4 shared 6:2:0 → 3, 1, 0.
        assert_eq!(split_replicas(7, &[6, 2, 0]), vec![4, 2, 1]);
        // 4 = 2 + 2 shared 1:1 → one each.
        assert_eq!(split_replicas(4, &[1, 1]), vec![2, 2]);
        // Remainder 1 of 3 : 1 goes to the larger remainder.
        assert_eq!(split_replicas(3, &[3, 1]), vec![2, 1]);
        // One node per class: a fourth replica has nowhere idle to go, so the first class takes it.
        assert_eq!(split_replicas(4, &[1, 1, 1]), vec![2, 1, 1]);
        // 5 = 2 + 3 shared 1:9 → 0 and 2, the remainder to the second.
        assert_eq!(split_replicas(5, &[1, 9]), vec![1, 4]);
        // Proportional share over a class's nodes moves to a class with room.
        assert_eq!(split_replicas(6, &[4, 1, 1]), vec![4, 1, 1]);
        assert_eq!(split_replicas(8, &[2, 1, 5]), vec![2, 1, 5]);
        for total in 0..40 {
            let s = split_replicas(total, &[5, 3, 2, 1]);
            assert_eq!(s.iter().sum::<i32>(), total, "{total}: {s:?}");
        }
        assert!(split_replicas(5, &[]).is_empty());
    }
}
