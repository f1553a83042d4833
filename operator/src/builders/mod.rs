//! Pure builders: a MoEDeployment plus a placement decision in, the Kubernetes objects the operator
//! applies out. No API calls here; the controller and `moe-operator plan` both call
//! [`desired_objects`].

pub mod activation;
pub mod autoscaling;
pub mod class_rules;
pub mod network;
#[cfg(test)]
mod tests;
pub mod workload;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, NodeAffinity, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::DynamicObject;
use kube::Resource;

use crate::crd::{AutoscalingProvider, MoEDeployment};
use crate::model_shape::ResolvedShape;
use crate::placement::classes::split_replicas;
use crate::placement::sizing::Sizing;

pub const HTTP_PORT: i32 = 8000;
pub const FIELD_MANAGER: &str = "moe-operator";
pub const LABEL_NAME: &str = "app.kubernetes.io/name";
/// The daemon pods' `app.kubernetes.io/name`.
pub const DAEMON_APP_NAME: &str = "moe-daemon";
pub const LABEL_INSTANCE: &str = "app.kubernetes.io/instance";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const LABEL_DEPLOYMENT: &str = "moe.inference.dev/deployment";
/// Pod label naming the hardware class whose StatefulSet owns the pod.
pub const LABEL_HARDWARE_CLASS: &str = "moe.inference.dev/hardware-class";
/// Longest StatefulSet name: its pods carry `controller-revision-hash: <name>-<10 chars>`, a label
/// value of at most 63 characters.
pub const MAX_STATEFULSET_NAME: usize = 52;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BuildError {
    #[error("metadata.name is missing")]
    MissingName,
    #[error("spec.model.source sets no source")]
    NoModelSource,
    #[error("model.cache.size is required when the model shape is unknown")]
    CacheSizeNeedsShape,
    #[error("KEDA autoscaling needs autoscaling.prometheus.serverAddress")]
    KedaNeedsPrometheus,
}

/// Everything the builders read. `owner` is `None` for offline plans of unsaved resources.
#[derive(Clone, Debug)]
pub struct BuildInput {
    pub md: MoEDeployment,
    pub namespace: String,
    pub shape: Option<ResolvedShape>,
    /// Hardware classes, best first; one StatefulSet each. Never empty for a build.
    pub classes: Vec<ClassBuild>,
    pub owner: Option<OwnerReference>,
    /// Image of the activator Deployment (the operator's own image).
    pub activator_image: String,
}

/// One hardware class as the builders see it.
#[derive(Clone, Debug)]
pub struct ClassBuild {
    /// DNS-label-safe class id, e.g. `sm89-24g`.
    pub id: String,
    /// The class's hardware as the labels tell it, e.g. `NVIDIA-H200 (SM 9.0, 143771 MiB, AVX-512)`.
    pub description: String,
    pub sizing: Sizing,
    pub node_affinity: Option<NodeAffinity>,
    /// Qualifying nodes of the class: the weight of its replica share.
    pub nodes: usize,
}

impl BuildInput {
    /// `<name>-<class id>`, shortened with a hash of the full name when longer than
    /// [`MAX_STATEFULSET_NAME`].
    pub fn statefulset_name(&self, class: &ClassBuild) -> String {
        let full = format!("{}-{}", self.name(), class.id);
        if full.len() <= MAX_STATEFULSET_NAME {
            return full;
        }
        // FNV-1a: stable across builds and platforms, unlike std's hasher.
        let hash = full.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        let suffix = format!("-{:06x}-{}", hash & 0xff_ffff, class.id);
        let keep = MAX_STATEFULSET_NAME.saturating_sub(suffix.len());
        let prefix: String = self.name().chars().take(keep).collect();
        format!("{}{suffix}", prefix.trim_end_matches('-'))
    }

    /// The shared pod selector plus the class label: what one class's StatefulSet selects.
    pub fn class_selector_labels(&self, class: &ClassBuild) -> BTreeMap<String, String> {
        let mut labels = self.selector_labels();
        labels.insert(LABEL_HARDWARE_CLASS.into(), class.id.clone());
        labels
    }

    /// [`Self::replicas`] split over the classes (rule in `placement::classes::split_replicas`).
    pub fn class_replicas(&self) -> Vec<i32> {
        let counts: Vec<usize> = self.classes.iter().map(|c| c.nodes).collect();
        split_replicas(self.replicas(), &counts)
    }

    pub fn name(&self) -> String {
        self.md.metadata.name.clone().unwrap_or_default()
    }

    pub fn headless_service_name(&self) -> String {
        format!("{}-pods", self.name())
    }

    pub fn selector_labels(&self) -> BTreeMap<String, String> {
        [
            (LABEL_NAME.to_string(), DAEMON_APP_NAME.to_string()),
            (LABEL_INSTANCE.to_string(), self.name()),
        ]
        .into()
    }

    pub fn labels(&self) -> BTreeMap<String, String> {
        let mut labels = self.selector_labels();
        labels.insert(LABEL_MANAGED_BY.into(), FIELD_MANAGER.into());
        labels.insert(LABEL_DEPLOYMENT.into(), self.name());
        labels
    }

    pub fn object_meta(&self, name: String) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels()),
            owner_references: self.owner.clone().map(|o| vec![o]),
            ..Default::default()
        }
    }

    /// Replicas for the StatefulSet: the spec's (which autoscalers write through the scale
    /// subresource), else the autoscaling minimum, else 1; always within the autoscaling bounds.
    pub fn replicas(&self) -> i32 {
        let spec = &self.md.spec;
        match &spec.autoscaling {
            None => spec.replicas.unwrap_or(1).max(0),
            Some(a) => {
                let floor = if a.scale_to_zero {
                    0
                } else {
                    a.min_replicas.max(1)
                };
                spec.replicas
                    .unwrap_or(a.min_replicas)
                    .clamp(floor, a.max_replicas.max(floor))
            }
        }
    }

    /// In-cluster OpenAI base URL.
    pub fn endpoint(&self) -> String {
        format!(
            "http://{}.{}.svc:{HTTP_PORT}/v1",
            self.name(),
            self.namespace
        )
    }
}

/// The objects one MoEDeployment owns.
#[derive(Clone, Debug)]
pub struct DesiredObjects {
    /// One per hardware class, in the order of `BuildInput::classes`.
    pub statefulsets: Vec<StatefulSet>,
    /// The placement rule file of each class whose sizing fixed an expert count (mounted into that
    /// class's pods; see [`class_rules`]).
    pub class_rules: Vec<ConfigMap>,
    pub service: Service,
    pub headless_service: Service,
    pub pdb: PodDisruptionBudget,
    pub hpa: Option<HorizontalPodAutoscaler>,
    pub keda_scaled_object: Option<DynamicObject>,
    /// Scale from zero: the activator and the Service it forwards to.
    pub activator: Option<Deployment>,
    pub backend_service: Option<Service>,
}

pub fn desired_objects(input: &BuildInput) -> Result<DesiredObjects, BuildError> {
    if input.md.metadata.name.is_none() {
        return Err(BuildError::MissingName);
    }
    let provider = input.md.spec.autoscaling.as_ref().map(|a| a.provider);
    let statefulsets = input
        .classes
        .iter()
        .zip(input.class_replicas())
        .map(|(class, replicas)| workload::statefulset(input, class, replicas))
        .collect::<Result<Vec<_>, _>>()?;
    let class_rules = input
        .classes
        .iter()
        .filter_map(|class| {
            class_rules::class_rules(input, class)
                .map(|r| class_rules::config_map(input, class, &r))
        })
        .collect();
    Ok(DesiredObjects {
        statefulsets,
        class_rules,
        service: network::service(input),
        headless_service: network::headless_service(input),
        pdb: network::pod_disruption_budget(input),
        hpa: (provider == Some(AutoscalingProvider::Hpa))
            .then(|| autoscaling::hpa(input))
            .flatten(),
        keda_scaled_object: match provider {
            Some(AutoscalingProvider::Keda) => Some(autoscaling::keda_scaled_object(input)?),
            _ => None,
        },
        activator: input
            .uses_activator()
            .then(|| activation::activator_deployment(input)),
        backend_service: input
            .uses_activator()
            .then(|| activation::backend_service(input)),
    })
}

/// Owner reference for objects a stored MoEDeployment owns (needs its uid).
pub fn owner_reference(md: &MoEDeployment) -> Option<OwnerReference> {
    md.controller_owner_ref(&())
}

impl DesiredObjects {
    /// All objects as JSON values with apiVersion and kind, in apply order.
    pub fn to_values(&self) -> Result<Vec<serde_json::Value>, serde_json::Error> {
        fn typed<K: Resource<DynamicType = ()> + serde::Serialize>(
            obj: &K,
        ) -> Result<serde_json::Value, serde_json::Error> {
            let mut v = serde_json::to_value(obj)?;
            if let Some(map) = v.as_object_mut() {
                map.insert("apiVersion".into(), K::api_version(&()).into());
                map.insert("kind".into(), K::kind(&()).into());
            }
            Ok(v)
        }
        let mut out = vec![typed(&self.headless_service)?];
        if let Some(backend) = &self.backend_service {
            out.push(typed(backend)?);
        }
        if let Some(activator) = &self.activator {
            out.push(typed(activator)?);
        }
        out.extend([typed(&self.service)?]);
        for cm in &self.class_rules {
            out.push(typed(cm)?);
        }
        for sts in &self.statefulsets {
            out.push(typed(sts)?);
        }
        out.push(typed(&self.pdb)?);
        if let Some(hpa) = &self.hpa {
            out.push(typed(hpa)?);
        }
        if let Some(so) = &self.keda_scaled_object {
            out.push(serde_json::to_value(so)?);
        }
        Ok(out)
    }
}
