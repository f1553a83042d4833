//! Scale from zero: the always-on activator Deployment (`moe-operator activator`) that the
//! OpenAI Service points at when `autoscaling.scaleToZero` is set, and the `<name>-backend`
//! Service through which it reaches ready replicas. See `crate::activator` for the proxy itself.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, PodSecurityContext, PodSpec, PodTemplateSpec, ResourceRequirements,
    SeccompProfile, Service, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

use super::network::http_port;
use super::workload::{container_security_context, http_probe, startup_budget_seconds};
use super::{BuildInput, HTTP_PORT, LABEL_INSTANCE, LABEL_NAME};
use crate::activator::HEALTH_PATH;

pub const ACTIVATOR_APP: &str = "moe-activator";
/// Held requests × largest body is the activator's worst-case memory: 256 × 4 MiB = 1 GiB.
const MAX_WAITING: u32 = 256;
const MAX_BODY_BYTES: u32 = 4 << 20;
/// Extra seconds a held request may wait beyond the model's startup budget (scheduling, pull).
const WAIT_MARGIN_SECONDS: u64 = 300;

impl BuildInput {
    /// True when the deployment may scale to zero and so needs the activator in front.
    pub fn uses_activator(&self) -> bool {
        self.md
            .spec
            .autoscaling
            .as_ref()
            .is_some_and(|a| a.scale_to_zero)
    }

    pub fn activator_name(&self) -> String {
        format!("{}-activator", self.name())
    }

    pub fn backend_service_name(&self) -> String {
        format!("{}-backend", self.name())
    }

    pub fn activator_selector_labels(&self) -> BTreeMap<String, String> {
        [
            (LABEL_NAME.to_string(), ACTIVATOR_APP.to_string()),
            (LABEL_INSTANCE.to_string(), self.name()),
        ]
        .into()
    }
}

/// ClusterIP Service over the ready replicas only: the activator's upstream.
pub fn backend_service(input: &BuildInput) -> Service {
    Service {
        metadata: input.object_meta(input.backend_service_name()),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(input.selector_labels()),
            ports: Some(vec![http_port()]),
            ..Default::default()
        }),
        status: None,
    }
}

/// One activator replica: it holds no state but the requests in flight, and while it restarts the
/// Service has no endpoint for a few seconds, which clients see as a refused connection.
pub fn activator_deployment(input: &BuildInput) -> Deployment {
    let mut labels = input.labels();
    labels.extend(input.activator_selector_labels());
    let upstream = format!(
        "http://{}.{}.svc:{HTTP_PORT}",
        input.backend_service_name(),
        input.namespace
    );
    let wait = startup_budget_seconds(input) + WAIT_MARGIN_SECONDS;
    let args: Vec<String> = [
        "activator",
        "--listen",
        &format!("0.0.0.0:{HTTP_PORT}"),
        "--upstream",
        &upstream,
        "--wait-timeout-seconds",
        &wait.to_string(),
        "--max-waiting",
        &MAX_WAITING.to_string(),
        "--max-body-bytes",
        &MAX_BODY_BYTES.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let requests: BTreeMap<String, Quantity> = [
        ("cpu".to_string(), Quantity("100m".into())),
        ("memory".to_string(), Quantity("128Mi".into())),
    ]
    .into();
    let limits: BTreeMap<String, Quantity> =
        [("memory".to_string(), Quantity("1536Mi".into()))].into();
    let container = Container {
        name: "activator".into(),
        image: Some(input.activator_image.clone()),
        args: Some(args),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: HTTP_PORT,
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        resources: Some(ResourceRequirements {
            requests: Some(requests),
            limits: Some(limits),
            ..Default::default()
        }),
        readiness_probe: Some(http_probe(HEALTH_PATH, 5, 3, 2)),
        liveness_probe: Some(http_probe(HEALTH_PATH, 10, 3, 2)),
        security_context: Some(container_security_context()),
        ..Default::default()
    };
    let annotations: BTreeMap<String, String> = [
        ("prometheus.io/scrape".to_string(), "true".to_string()),
        ("prometheus.io/port".to_string(), HTTP_PORT.to_string()),
        ("prometheus.io/path".to_string(), "/metrics".to_string()),
    ]
    .into();
    Deployment {
        metadata: input.object_meta(input.activator_name()),
        spec: DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(input.activator_selector_labels()),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    annotations: Some(annotations),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    priority_class_name: input.md.spec.pod.priority_class_name.clone(),
                    image_pull_secrets: (!input.md.spec.pod.image_pull_secrets.is_empty())
                        .then(|| input.md.spec.pod.image_pull_secrets.clone()),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(super::workload::NON_ROOT_UID),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            localhost_profile: None,
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        status: None,
    }
}
