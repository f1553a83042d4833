//! `moe-operator validate FILE…`: checks Kubernetes manifests offline. Each document must
//! deserialize into its k8s-openapi type (or `MoEDeployment`) without losing any field: a field the
//! type does not know (a typo, a wrong indent) is reported with its path. MoEDeployments also go
//! through the spec rules the CRD's CEL validations enforce.

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Secret, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::crd::MoEDeployment;
use crate::model_shape::resolve_shape;
use crate::validate::validate_spec;

/// A document that did not validate: where it is and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestProblem {
    pub document: String,
    pub message: String,
}

impl std::fmt::Display for ManifestProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.document, self.message)
    }
}

/// Paths present (non-null) in `original` but missing after the typed round trip.
fn dropped_fields(original: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (original, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                if value.is_null() {
                    continue;
                }
                let child = format!("{path}.{key}");
                match b.get(key) {
                    None => out.push(child),
                    Some(tv) => dropped_fields(value, tv, &child, out),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
                dropped_fields(x, y, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn check_typed<K: DeserializeOwned + Serialize>(value: &Value) -> Result<K, String> {
    let typed: K = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut dropped = Vec::new();
    dropped_fields(value, &back, "", &mut dropped);
    if dropped.is_empty() {
        Ok(typed)
    } else {
        Err(format!("unknown fields: {}", dropped.join(", ")))
    }
}

/// Validates one manifest (as JSON). Returns the kind on success.
pub fn validate_manifest(value: &Value) -> Result<String, String> {
    let kind = value
        .get("kind")
        .and_then(Value::as_str)
        .ok_or("missing kind")?
        .to_string();
    if value.get("apiVersion").and_then(Value::as_str).is_none() {
        return Err("missing apiVersion".into());
    }
    match kind.as_str() {
        "Namespace" => check_typed::<Namespace>(value).map(drop),
        "ServiceAccount" => check_typed::<ServiceAccount>(value).map(drop),
        "ConfigMap" => check_typed::<ConfigMap>(value).map(drop),
        "Secret" => check_typed::<Secret>(value).map(drop),
        "Service" => check_typed::<Service>(value).map(drop),
        "Node" => check_typed::<Node>(value).map(drop),
        "Deployment" => check_typed::<Deployment>(value).map(drop),
        "StatefulSet" => check_typed::<StatefulSet>(value).map(drop),
        "DaemonSet" => check_typed::<DaemonSet>(value).map(drop),
        "PodDisruptionBudget" => check_typed::<PodDisruptionBudget>(value).map(drop),
        "HorizontalPodAutoscaler" => check_typed::<HorizontalPodAutoscaler>(value).map(drop),
        "Lease" => check_typed::<Lease>(value).map(drop),
        "ClusterRole" => check_typed::<ClusterRole>(value).map(drop),
        "ClusterRoleBinding" => check_typed::<ClusterRoleBinding>(value).map(drop),
        "Role" => check_typed::<Role>(value).map(drop),
        "RoleBinding" => check_typed::<RoleBinding>(value).map(drop),
        "CustomResourceDefinition" => check_typed::<CustomResourceDefinition>(value).map(drop),
        "List" => value
            .get("items")
            .and_then(Value::as_array)
            .ok_or_else(|| "List without items".to_string())?
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| {
                validate_manifest(item)
                    .map(drop)
                    .map_err(|e| format!("items[{i}]: {e}"))
            }),
        "MoEDeployment" => {
            let md: MoEDeployment = check_typed(value)?;
            let name = md
                .metadata
                .name
                .clone()
                .ok_or("metadata.name is required")?;
            let errors = validate_spec(&md.spec, resolve_shape(&md.spec.model, &name).as_ref());
            if errors.is_empty() {
                Ok(())
            } else {
                Err(errors.join("; "))
            }
        }
        other => Err(format!("kind {other:?} is not one this validator knows")),
    }
    .map(|_| kind)
}

/// Validates every document of a YAML stream; `source` names it in messages.
pub fn validate_yaml_stream(text: &str, source: &str) -> Result<Vec<String>, Vec<ManifestProblem>> {
    let mut kinds = Vec::new();
    let mut problems = Vec::new();
    for (index, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let document = format!("{source} document {}", index + 1);
        let value = match serde_yaml::Value::deserialize(doc) {
            Ok(v) => v,
            Err(e) => {
                problems.push(ManifestProblem {
                    document,
                    message: format!("not valid YAML: {e}"),
                });
                break;
            }
        };
        if value.is_null() {
            continue;
        }
        let json = match serde_json::to_value(&value) {
            Ok(v) => v,
            Err(e) => {
                problems.push(ManifestProblem {
                    document,
                    message: e.to_string(),
                });
                continue;
            }
        };
        let label = json
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .map(|n| format!("{document} ({n})"))
            .unwrap_or(document);
        match validate_manifest(&json) {
            Ok(kind) => kinds.push(kind),
            Err(message) => problems.push(ManifestProblem {
                document: label,
                message,
            }),
        }
    }
    if problems.is_empty() {
        Ok(kinds)
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_a_valid_service() {
        let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {ports: [{name: http, port: 80}]}\n";
        assert_eq!(
            validate_yaml_stream(yaml, "t"),
            Ok(vec!["Service".to_string()])
        );
    }

    #[test]
    fn reports_unknown_fields_with_their_path() {
        let yaml = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  selector: {}\n  template:\n    spec:\n      containers: [{name: c, imagePullPolcy: Always}]\n";
        let problems = validate_yaml_stream(yaml, "t").unwrap_err();
        assert!(
            problems[0]
                .message
                .contains(".spec.template.spec.containers[0].imagePullPolcy"),
            "{problems:?}"
        );
    }

    #[test]
    fn reports_wrong_types_unknown_kinds_and_bad_specs() {
        let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {ports: [{port: eighty}]}\n---\napiVersion: x/v1\nkind: Gadget\n---\napiVersion: moe.inference.dev/v1alpha1\nkind: MoEDeployment\nmetadata: {name: m}\nspec: {model: {source: {}}}\n";
        let problems = validate_yaml_stream(yaml, "t").unwrap_err();
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[1].message.contains("Gadget"));
        assert!(problems[2].message.contains("exactly one of"));
    }
}
