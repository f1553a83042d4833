//! `moe-operator plan`: an offline dry run. Reads a MoEDeployment and a file of Node objects
//! (a `List`, a `NodeList` or several YAML documents, e.g. `kubectl get nodes -o yaml`) and prints
//! the placement decision with per-node reasons, then the objects the operator would apply.

use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

use crate::crd::{
    HardwareClassStatus, MoEDeployment, RejectedClassStatus, ResolvedPlacementStatus,
};
use crate::desired::{compute_desired, DesiredError};
use crate::yaml_out;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{what}: not valid YAML: {source}")]
    Yaml {
        what: String,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("{what}: {message}")]
    Input { what: String, message: String },
    #[error(transparent)]
    Desired(#[from] DesiredError),
    #[error("cannot render objects: {0}")]
    Render(String),
}

fn yaml_error(what: &str) -> impl FnOnce(serde_yaml::Error) -> PlanError + '_ {
    move |source| PlanError::Yaml {
        what: what.to_string(),
        source,
    }
}

/// Parses the single MoEDeployment document of `text`.
pub fn parse_deployment(text: &str, what: &str) -> Result<MoEDeployment, PlanError> {
    let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(yaml_error(what))?;
    let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
    if kind != "MoEDeployment" {
        return Err(PlanError::Input {
            what: what.into(),
            message: format!("expected kind MoEDeployment, found {kind:?}"),
        });
    }
    let md: MoEDeployment = serde_yaml::from_value(value).map_err(yaml_error(what))?;
    if md.metadata.name.as_deref().unwrap_or("").is_empty() {
        return Err(PlanError::Input {
            what: what.into(),
            message: "metadata.name is required".into(),
        });
    }
    Ok(md)
}

/// Parses Node objects from a List/NodeList or a multi-document YAML stream.
pub fn parse_nodes(text: &str, what: &str) -> Result<Vec<Node>, PlanError> {
    let mut nodes = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let value = serde_yaml::Value::deserialize(doc).map_err(yaml_error(what))?;
        if value.is_null() {
            continue;
        }
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("")
            .to_string();
        match kind.as_str() {
            "List" | "NodeList" => {
                let items = value
                    .get("items")
                    .and_then(|i| i.as_sequence())
                    .cloned()
                    .unwrap_or_default();
                for item in items {
                    nodes.push(node_from_value(item, what)?);
                }
            }
            "Node" => nodes.push(node_from_value(value, what)?),
            other => {
                return Err(PlanError::Input {
                    what: what.into(),
                    message: format!("expected Node objects, found kind {other:?}"),
                })
            }
        }
    }
    Ok(nodes)
}

fn node_from_value(value: serde_yaml::Value, what: &str) -> Result<Node, PlanError> {
    let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("Node");
    if kind != "Node" {
        return Err(PlanError::Input {
            what: what.into(),
            message: format!("list item of kind {kind:?} is not a Node"),
        });
    }
    serde_yaml::from_value(value).map_err(yaml_error(what))
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PlanReport {
    summary: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    resolved: Option<ResolvedPlacementStatus>,
    /// One StatefulSet per hardware class, each with its sizing and replica share.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    classes: Vec<HardwareClassStatus>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rejected_classes: Vec<RejectedClassStatus>,
    nodes: Vec<NodeReport>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct NodeReport {
    name: String,
    qualifies: bool,
    score: u64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    reasons: Vec<String>,
}

/// The full plan as YAML documents: the placement report, then each object.
pub fn plan(deployment_yaml: &str, nodes_yaml: &str) -> Result<String, PlanError> {
    let md = parse_deployment(deployment_yaml, "deployment")?;
    let nodes = parse_nodes(nodes_yaml, "nodes")?;
    let namespace = md
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let desired = compute_desired(&md, &namespace, &nodes, None, None)?;
    let report = PlanReport {
        summary: desired.decision.summary(),
        resolved: desired.resolved_placement(),
        classes: desired.class_statuses(),
        rejected_classes: desired.rejected_classes(),
        nodes: desired
            .decision
            .nodes
            .iter()
            .map(|v| NodeReport {
                name: v.name.clone(),
                qualifies: v.qualifies(),
                score: v.score,
                reasons: v.rejections.iter().map(|r| r.to_string()).collect(),
            })
            .collect(),
    };
    let render = |e: &dyn std::fmt::Display| PlanError::Render(e.to_string());
    let mut out = String::from("# placement decision\n");
    let report = serde_json::to_value(&report).map_err(|e| render(&e))?;
    out.push_str(&yaml_out::to_yaml(&report));
    match &desired.objects {
        None => out.push_str("# no node qualifies: no objects would be applied\n"),
        Some(objects) => {
            for value in objects.to_values().map_err(|e| render(&e))? {
                out.push_str("---\n");
                out.push_str(&yaml_out::to_yaml(&value));
            }
        }
    }
    Ok(out)
}
