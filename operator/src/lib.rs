//! moe-operator: the `MoEDeployment` CRD, hardware-aware placement, pure object builders and the
//! kube-rs controller that applies them.

pub mod activator;
pub mod autoscaler;
pub mod builders;
pub mod controller;
pub mod crd;
pub mod crd_bounds;
pub mod desired;
pub mod leader;
pub mod manifests;
pub mod metrics;
pub mod model_shape;
pub mod node_cache;
pub mod placement;
pub mod plan;
pub mod pod_cache;
pub mod quantity;
pub mod server;
pub mod validate;
pub mod yaml_out;
