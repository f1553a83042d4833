//! Queue-depth autoscaling objects for the `hpa` and `keda` providers. Both scale the
//! MoEDeployment through its scale subresource, so `spec.replicas` stays the one source of truth.

use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, HPAScalingRules, HorizontalPodAutoscaler,
    HorizontalPodAutoscalerBehavior, HorizontalPodAutoscalerSpec, MetricIdentifier, MetricSpec,
    MetricTarget, PodsMetricSource,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::Resource;
use serde_json::json;

use super::{BuildError, BuildInput};
use crate::crd::MoEDeployment;

pub const QUEUE_METRIC: &str = "moe:num_requests_waiting";
/// Upper bound of an HPA's `stabilizationWindowSeconds`.
pub const MAX_STABILIZATION_WINDOW_SECONDS: u32 = 3600;

fn scale_target(input: &BuildInput) -> CrossVersionObjectReference {
    CrossVersionObjectReference {
        api_version: Some(MoEDeployment::api_version(&()).to_string()),
        kind: MoEDeployment::kind(&()).to_string(),
        name: input.name(),
    }
}

/// autoscaling/v2 HPA on the per-pod metric `moe:num_requests_waiting` (served by prometheus-adapter).
pub fn hpa(input: &BuildInput) -> Option<HorizontalPodAutoscaler> {
    let a = input.md.spec.autoscaling.as_ref()?;
    Some(HorizontalPodAutoscaler {
        metadata: input.object_meta(input.name()),
        spec: HorizontalPodAutoscalerSpec {
            scale_target_ref: scale_target(input),
            min_replicas: Some(a.min_replicas.max(1)),
            max_replicas: a.max_replicas,
            metrics: Some(vec![MetricSpec {
                type_: "Pods".into(),
                pods: Some(PodsMetricSource {
                    metric: MetricIdentifier {
                        name: QUEUE_METRIC.into(),
                        selector: None,
                    },
                    target: MetricTarget {
                        type_: "AverageValue".into(),
                        average_value: Some(Quantity(a.target_queue_depth.to_string())),
                        ..Default::default()
                    },
                }),
                ..Default::default()
            }]),
            behavior: Some(HorizontalPodAutoscalerBehavior {
                scale_down: Some(HPAScalingRules {
                    // The API server allows 0..=3600 (autoscaling `validateStabilizationWindowSeconds`).
                    stabilization_window_seconds: Some(
                        a.scale_down_delay_seconds
                            .min(MAX_STABILIZATION_WINDOW_SECONDS) as i32,
                    ),
                    ..Default::default()
                }),
                scale_up: Some(HPAScalingRules {
                    stabilization_window_seconds: Some(0),
                    ..Default::default()
                }),
            }),
        },
        status: None,
    })
}

pub fn keda_api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("keda.sh", "v1alpha1", "ScaledObject"),
        "scaledobjects",
    )
}

/// PromQL summing the waiting requests of this deployment's pods and, with scale to zero, of its
/// activator (the only series that is non-zero while no replica exists). `or vector(0)` keeps the
/// query answering 0 instead of "no data" when no pod reports yet.
pub fn queue_query(input: &BuildInput) -> String {
    // StatefulSet pods are `<statefulset>-<ordinal>`, one StatefulSet per hardware class.
    let mut alternatives: Vec<String> = input
        .classes
        .iter()
        .map(|c| format!("{}-[0-9]+", input.statefulset_name(c)))
        .collect();
    if input.uses_activator() {
        alternatives.push(format!("{}-activator-.+", input.name()));
    }
    let pods = alternatives.join("|");
    format!(
        "sum({QUEUE_METRIC}{{namespace=\"{}\",pod=~\"{pods}\"}}) or vector(0)",
        input.namespace
    )
}

/// KEDA ScaledObject with a Prometheus trigger (KEDA types are not in k8s-openapi).
pub fn keda_scaled_object(input: &BuildInput) -> Result<DynamicObject, BuildError> {
    let a = input
        .md
        .spec
        .autoscaling
        .as_ref()
        .ok_or(BuildError::KedaNeedsPrometheus)?;
    let prometheus = a
        .prometheus
        .as_ref()
        .ok_or(BuildError::KedaNeedsPrometheus)?;
    let min = if a.scale_to_zero {
        0
    } else {
        a.min_replicas.max(1)
    };
    let target = scale_target(input);
    let mut obj = DynamicObject::new(&input.name(), &keda_api_resource()).within(&input.namespace);
    obj.metadata = input.object_meta(input.name());
    obj.data = json!({
        "spec": {
            "scaleTargetRef": {
                "apiVersion": target.api_version,
                "kind": target.kind,
                "name": target.name,
            },
            "minReplicaCount": min,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": a.scale_down_delay_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {"stabilizationWindowSeconds": a.scale_down_delay_seconds.min(MAX_STABILIZATION_WINDOW_SECONDS)}
                    }
                }
            },
            "triggers": [{
                "type": "prometheus",
                "metadata": {
                    "serverAddress": prometheus.server_address,
                    "query": queue_query(input),
                    "threshold": a.target_queue_depth.to_string(),
                    "activationThreshold": "0",
                }
            }]
        }
    });
    Ok(obj)
}
