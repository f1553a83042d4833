//! From a MoEDeployment and the cluster's nodes to the desired state: validation, model shape,
//! placement decision and the objects to apply. Shared by the controller and `moe-operator plan`.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::builders::{desired_objects, BuildError, BuildInput, DesiredObjects};
use crate::crd::{MoEDeployment, ModelShape, ResolvedPlacementStatus};
use crate::crd_bounds::check_name;
use crate::model_shape::resolve_shape;
use crate::placement::node_facts::NodeFacts;
use crate::placement::{decide, PlacementDecision};
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
    pub shape: Option<ModelShape>,
    pub decision: PlacementDecision,
    /// `None` when no node qualifies: nothing new is applied.
    pub objects: Option<DesiredObjects>,
    pub build_input: Option<BuildInput>,
}

impl DesiredState {
    pub fn resolved_placement(&self) -> Option<ResolvedPlacementStatus> {
        let sizing = self.decision.sizing.as_ref()?;
        Some(ResolvedPlacementStatus {
            gpu_experts_per_layer: sizing.gpu_experts_per_layer.unwrap_or(0),
            cpu_threads: sizing.cpu_threads,
            memory: format_bytes(sizing.memory_bytes),
            hugepages: sizing
                .hugepages
                .map(|(kind, bytes)| format!("{} {}", format_bytes(bytes), kind.resource_name())),
        })
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

pub fn compute_desired(
    md: &MoEDeployment,
    namespace: &str,
    nodes: &[Node],
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
    let facts: Vec<NodeFacts> = nodes.iter().map(NodeFacts::from_node).collect();
    let decision = decide(&md.spec, shape.as_ref(), &facts);
    let (objects, build_input) = match (&decision.sizing, decision.qualified().next()) {
        (Some(sizing), Some(_)) => {
            let input = BuildInput {
                md: md.clone(),
                namespace: namespace.to_string(),
                shape: shape.clone(),
                sizing: sizing.clone(),
                node_affinity: decision.node_affinity(md.spec.resources.gpu.min_memory_mib),
                owner,
                activator_image: activator_image(),
            };
            (Some(desired_objects(&input)?), Some(input))
        }
        _ => (None, None),
    };
    Ok(DesiredState {
        shape,
        decision,
        objects,
        build_input,
    })
}
