//! From a MoEDeployment and the cluster's nodes to the desired state: validation, model shape,
//! placement decision and the objects to apply. Shared by the controller and `moe-operator plan`.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::builders::{desired_objects, BuildError, BuildInput, ClassBuild, DesiredObjects};
use crate::crd::{
    HardwareClassStatus, MoEDeployment, RejectedClassStatus, ResolvedPlacementStatus,
};
use crate::crd_bounds::check_name;
use crate::model_shape::{resolve_shape, ResolvedShape};
use crate::placement::classes::{plan_fleet, FleetPlan};
use crate::placement::node_facts::NodeFacts;
use crate::placement::sizing::Sizing;
use crate::placement::PlacementDecision;
use crate::pod_cache::CpuRequests;
use crate::quantity::format_bytes;
use crate::validate::validate_spec;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DesiredError {
    #[error("invalid spec: {}", .0.join("; "))]
    InvalidSpec(Vec<String>),
    #[error(transparent)]
    Build(#[from] BuildError),
}

#[derive(Clone, Debug)]
pub struct DesiredState {
    pub shape: Option<ResolvedShape>,
    /// Every node's verdict across all classes; `sizing` is the first (best) class's.
    pub decision: PlacementDecision,
    /// The hardware classes and the rejected ones.
    pub fleet: FleetPlan,
    /// `None` when no node qualifies: nothing new is applied.
    pub objects: Option<DesiredObjects>,
    pub build_input: Option<BuildInput>,
}

fn resolved(sizing: &Sizing) -> ResolvedPlacementStatus {
    ResolvedPlacementStatus {
        gpu_experts_per_layer: sizing.gpu_experts_per_layer.unwrap_or(0),
        cpu_threads: sizing.cpu_threads,
        memory: format_bytes(sizing.memory_bytes),
        hugepages: sizing
            .hugepages
            .map(|(kind, bytes)| format!("{} {}", format_bytes(bytes), kind.resource_name())),
    }
}

impl DesiredState {
    /// What `auto` became for the best class (the first StatefulSet).
    pub fn resolved_placement(&self) -> Option<ResolvedPlacementStatus> {
        self.decision.sizing.as_ref().map(resolved)
    }

    /// Status of every class that got a StatefulSet, with its replica share.
    pub fn class_statuses(&self) -> Vec<HardwareClassStatus> {
        let Some(input) = &self.build_input else {
            return Vec::new();
        };
        self.fleet
            .classes
            .iter()
            .zip(&input.classes)
            .zip(input.class_replicas())
            .map(|((class, build), replicas)| HardwareClassStatus {
                name: class.id.clone(),
                hardware: class.description.clone(),
                stateful_set: input.statefulset_name(build),
                nodes: class.nodes.clone(),
                replicas,
                placement: resolved(&class.sizing),
                placement_rules: crate::builders::class_rules::class_rules(input, build)
                    .map(|r| r.config_map_name),
            })
            .collect()
    }

    /// Label classes none of whose nodes can run the model, each with the reason.
    pub fn rejected_classes(&self) -> Vec<RejectedClassStatus> {
        self.fleet
            .rejected
            .iter()
            .map(|r| RejectedClassStatus {
                hardware: r.description.clone(),
                reason: r.reason.clone(),
            })
            .collect()
    }
}

/// The operator's own image, which the activator Deployments run: `MOE_OPERATOR_IMAGE` (set by the
/// Helm chart) or the release image of this version.
pub fn activator_image() -> String {
    std::env::var("MOE_OPERATOR_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_OPERATOR_IMAGE.to_string())
}

pub const DEFAULT_OPERATOR_IMAGE: &str = concat!(
    "ghcr.io/moe-hybrid/moe-operator:",
    env!("CARGO_PKG_VERSION")
);

/// `cpu_in_use`: CPU requested on each node by other workloads' pods (`None`: not known, as in
/// `plan`; a fixed reserve stands in for it).
pub fn compute_desired(
    md: &MoEDeployment,
    namespace: &str,
    nodes: &[Node],
    cpu_in_use: Option<&CpuRequests>,
    owner: Option<OwnerReference>,
) -> Result<DesiredState, DesiredError> {
    let name = md.metadata.name.clone().ok_or(BuildError::MissingName)?;
    let shape = resolve_shape(&md.spec.model, &name);
    let mut errors = validate_spec(&md.spec, shape.as_ref());
    if let Err(e) = check_name(&name) {
        errors.insert(0, e);
    }
    if !errors.is_empty() {
        return Err(DesiredError::InvalidSpec(errors));
    }
    let facts: Vec<NodeFacts> = nodes
        .iter()
        .map(|n| {
            let mut facts = NodeFacts::from_node(n);
            facts.cpu_requested_millis = cpu_in_use.map(|u| u.on(&facts.name));
            facts
        })
        .collect();
    let fleet = plan_fleet(&md.spec, shape.as_ref(), &facts);
    let decision = fleet.overall.clone();
    let (objects, build_input) = if fleet.classes.is_empty() {
        (None, None)
    } else {
        let input = BuildInput {
            md: md.clone(),
            namespace: namespace.to_string(),
            shape: shape.clone(),
            classes: fleet
                .classes
                .iter()
                .map(|c| ClassBuild {
                    id: c.id.clone(),
                    description: c.description.clone(),
                    sizing: c.sizing.clone(),
                    node_affinity: Some(c.key.node_affinity()),
                    nodes: c.nodes.len(),
                })
                .collect(),
            owner,
            activator_image: activator_image(),
        };
        (Some(desired_objects(&input)?), Some(input))
    };
    Ok(DesiredState {
        shape,
        decision,
        fleet,
        objects,
        build_input,
    })
}
