//! The Services (OpenAI endpoint and the StatefulSet's headless governing Service) and the
//! PodDisruptionBudget.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{BuildInput, HTTP_PORT};

pub(crate) fn http_port() -> ServicePort {
    ServicePort {
        name: Some("http".into()),
        port: HTTP_PORT,
        target_port: Some(IntOrString::String("http".into())),
        protocol: Some("TCP".into()),
        app_protocol: Some("http".into()),
        ..Default::default()
    }
}

/// ClusterIP Service serving the OpenAI API on port `http`: the replicas, or the activator in
/// front of them when the deployment can scale to zero.
pub fn service(input: &BuildInput) -> Service {
    let selector = if input.uses_activator() {
        input.activator_selector_labels()
    } else {
        input.selector_labels()
    };
    Service {
        metadata: input.object_meta(input.name()),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(selector),
            ports: Some(vec![http_port()]),
            ..Default::default()
        }),
        status: None,
    }
}

/// Headless Service that gives each replica a stable DNS name; lists loading pods too so the
/// builtin autoscaler and operators can reach every replica.
pub fn headless_service(input: &BuildInput) -> Service {
    Service {
        metadata: input.object_meta(input.headless_service_name()),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(input.selector_labels()),
            ports: Some(vec![http_port()]),
            ..Default::default()
        }),
        status: None,
    }
}

/// At most one replica voluntarily disrupted at a time. Pods still loading (not Ready) may always be
/// evicted, so a drain never waits on a model load.
pub fn pod_disruption_budget(input: &BuildInput) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: input.object_meta(input.name()),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(input.selector_labels()),
                match_expressions: None,
            }),
            unhealthy_pod_eviction_policy: Some("AlwaysAllow".into()),
            ..Default::default()
        }),
        status: None,
    }
}
