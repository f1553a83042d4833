//! What placement reads from a Node: allocatable resources, Node Feature Discovery CPU labels and
//! GPU Feature Discovery labels, parsed once so the rules below work on plain numbers.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Taint};

use super::sizing::DAEMONSET_CPU_RESERVE;
use crate::quantity::{parse_bytes, parse_millicores};

pub const LABEL_AVX512F: &str = "feature.node.kubernetes.io/cpu-cpuid.AVX512F";
pub const AMX_LABELS: [&str; 3] = [
    "feature.node.kubernetes.io/cpu-cpuid.AMXBF16",
    "feature.node.kubernetes.io/cpu-cpuid.AMXTILE",
    "feature.node.kubernetes.io/cpu-cpuid.AMXINT8",
];
pub const LABEL_GPU_MAJOR: &str = "nvidia.com/gpu.compute.major";
pub const LABEL_GPU_MINOR: &str = "nvidia.com/gpu.compute.minor";
pub const LABEL_GPU_MEMORY: &str = "nvidia.com/gpu.memory";
pub const LABEL_GPU_PRODUCT: &str = "nvidia.com/gpu.product";
pub const RESOURCE_GPU: &str = "nvidia.com/gpu";
pub const RESOURCE_HUGEPAGES_1GI: &str = "hugepages-1Gi";
pub const RESOURCE_HUGEPAGES_2MI: &str = "hugepages-2Mi";

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl std::fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// One node as placement sees it. Missing or malformed values read as absent / zero, which makes
/// the node fail the matching rule with a reason rather than fail the whole reconcile.
#[derive(Clone, Debug, Default)]
pub struct NodeFacts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub unschedulable: bool,
    pub taints: Vec<Taint>,
    pub cpu_millis: u64,
    /// CPU requested here by other workloads' pods; `None` when not known (`plan` without a
    /// cluster), when a fixed reserve stands in for it.
    pub cpu_requested_millis: Option<u64>,
    pub memory_bytes: u64,
    pub hugepages_1gi_bytes: u64,
    pub hugepages_2mi_bytes: u64,
    pub gpus: u64,
    pub gpu_memory_mib: Option<u64>,
    pub compute_capability: Option<ComputeCapability>,
}

impl NodeFacts {
    pub fn from_node(node: &Node) -> Self {
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let spec = node.spec.clone().unwrap_or_default();
        let allocatable = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.clone())
            .unwrap_or_default();
        let bytes = |key: &str| {
            allocatable
                .get(key)
                .and_then(|q| parse_bytes(&q.0).ok())
                .unwrap_or(0)
        };
        let label_u64 = |key: &str| labels.get(key).and_then(|v| v.trim().parse::<u64>().ok());
        let compute_capability = match (label_u64(LABEL_GPU_MAJOR), label_u64(LABEL_GPU_MINOR)) {
            (Some(major), Some(minor)) => Some(ComputeCapability {
                major: major as u32,
                minor: minor as u32,
            }),
            _ => None,
        };
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            unschedulable: spec.unschedulable.unwrap_or(false),
            taints: spec.taints.unwrap_or_default(),
            cpu_millis: allocatable
                .get("cpu")
                .and_then(|q| parse_millicores(&q.0).ok())
                .unwrap_or(0),
            cpu_requested_millis: None,
            memory_bytes: bytes("memory"),
            hugepages_1gi_bytes: bytes(RESOURCE_HUGEPAGES_1GI),
            hugepages_2mi_bytes: bytes(RESOURCE_HUGEPAGES_2MI),
            gpus: allocatable
                .get(RESOURCE_GPU)
                .and_then(|q| q.0.trim().parse().ok())
                .unwrap_or(0),
            gpu_memory_mib: label_u64(LABEL_GPU_MEMORY),
            compute_capability,
            labels,
        }
    }

    pub fn has_avx512(&self) -> bool {
        self.labels.get(LABEL_AVX512F).is_some_and(|v| v == "true")
    }

    /// Number of AMX feature labels present (0..=3); AMX tiles make CPU expert matmuls much faster.
    pub fn amx_level(&self) -> usize {
        AMX_LABELS
            .iter()
            .filter(|l| self.labels.get(**l).is_some_and(|v| v == "true"))
            .count()
    }

    /// Whole CPUs of the node's allocatable.
    pub fn whole_cpus(&self) -> u64 {
        self.cpu_millis / 1000
    }

    /// Whole CPUs a Guaranteed pod can still request here: allocatable minus what other pods
    /// request, or, when that is not known, allocatable minus a reserve for DaemonSets.
    pub fn free_whole_cpus(&self) -> u64 {
        match self.cpu_requested_millis {
            Some(used) => self.cpu_millis.saturating_sub(used) / 1000,
            None => self.whole_cpus().saturating_sub(DAEMONSET_CPU_RESERVE),
        }
    }

    /// Whole CPUs a pod of a given size must fit in: the free ones when other pods' requests are
    /// known, else all of allocatable (the reserve is only a sizing guess).
    pub fn schedulable_cpus(&self) -> u64 {
        match self.cpu_requested_millis {
            Some(_) => self.free_whole_cpus(),
            None => self.whole_cpus(),
        }
    }
}

/// Accepted capability patterns such as "8.9" or "12.x".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapabilityPattern {
    pub major: u32,
    /// `None` accepts every minor version ("12.x").
    pub minor: Option<u32>,
}

impl CapabilityPattern {
    pub fn parse(text: &str) -> Option<Self> {
        let (major, minor) = text.trim().split_once('.')?;
        let major = major.parse().ok()?;
        let minor = match minor {
            "x" | "X" | "*" => None,
            m => Some(m.parse().ok()?),
        };
        Some(Self { major, minor })
    }

    pub fn accepts(&self, cc: &ComputeCapability) -> bool {
        self.major == cc.major && self.minor.is_none_or(|m| m == cc.minor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_patterns() {
        let cc = |major, minor| ComputeCapability { major, minor };
        let p89 = CapabilityPattern::parse("8.9").unwrap();
        let p12 = CapabilityPattern::parse("12.x").unwrap();
        assert!(p89.accepts(&cc(8, 9)));
        assert!(!p89.accepts(&cc(8, 6)));
        assert!(p12.accepts(&cc(12, 0)));
        assert!(p12.accepts(&cc(12, 1)));
        assert!(!p12.accepts(&cc(10, 0)));
        assert_eq!(CapabilityPattern::parse("nine"), None);
        assert_eq!(CapabilityPattern::parse("9"), None);
    }
}
