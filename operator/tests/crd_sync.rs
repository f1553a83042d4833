//! The checked-in CRD (`crds/moedeployment.yaml`) must equal what `moe-operator crd` prints, and
//! carry the scale subresource, printer columns and CEL rules the API relies on.

use kube::CustomResourceExt;
use moe_operator::crd::{crd_yaml, MoEDeployment};

const CRD_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/moedeployment.yaml");
const CHART_CRD_PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../charts/moe-operator/crds/moedeployment.yaml"
);
const REGENERATE: &str = "cargo run -p moe-operator -- crd > crds/moedeployment.yaml && cp crds/moedeployment.yaml charts/moe-operator/crds/";

#[test]
fn checked_in_crd_is_current() {
    let generated = crd_yaml().expect("CRD renders");
    for path in [CRD_PATH, CHART_CRD_PATH] {
        let stored = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            stored == generated,
            "{path} is stale; regenerate it with:\n  {REGENERATE}"
        );
    }
}

#[test]
fn crd_has_names_subresources_and_columns() {
    let crd = MoEDeployment::crd();
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("moedeployments.moe.inference.dev")
    );
    assert_eq!(crd.spec.names.short_names, Some(vec!["moed".to_string()]));
    let version = &crd.spec.versions[0];
    assert_eq!(version.name, "v1alpha1");
    let sub = version.subresources.as_ref().expect("subresources");
    assert!(sub.status.is_some());
    let scale = sub.scale.as_ref().expect("scale subresource");
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(
        scale.label_selector_path.as_deref(),
        Some(".status.selector")
    );
    let columns: Vec<&str> = version
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        columns,
        ["Model", "Replicas", "Ready", "Status", "Endpoint", "Age"]
    );
}

#[test]
fn crd_carries_the_cel_rules() {
    let yaml = crd_yaml().expect("CRD renders");
    for rule in [
        "self.minReplicas <= self.maxReplicas",
        "self == oldSelf",
        "[has(self.huggingFace), has(self.pvc), has(self.hostPath), has(self.url)].filter(x, x).size() == 1",
        "self.provider != 'keda' || has(self.prometheus)",
        "has(self.model.cache) == has(oldSelf.model.cache)",
        moe_operator::crd_bounds::NAME_RULE,
    ] {
        let quoted = rule.replace('\'', "''");
        assert!(yaml.contains(rule) || yaml.contains(&quoted), "rule missing: {rule}");
    }
}

/// Every integer the API server stores must fit the Rust type that reads it back.
#[test]
fn every_integer_in_the_schema_is_bounded() {
    fn walk(v: &serde_json::Value, path: &str, unbounded: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if m.get("type").and_then(|t| t.as_str()) == Some("integer")
                    && (m.get("maximum").is_none() || m.get("minimum").is_none())
                {
                    unbounded.push(path.to_string());
                }
                for (k, c) in m {
                    walk(c, &format!("{path}.{k}"), unbounded);
                }
            }
            serde_json::Value::Array(a) => {
                for (i, c) in a.iter().enumerate() {
                    walk(c, &format!("{path}[{i}]"), unbounded);
                }
            }
            _ => {}
        }
    }
    let crd = moe_operator::crd::crd_value().expect("CRD renders");
    let mut unbounded = Vec::new();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    walk(schema, "", &mut unbounded);
    assert_eq!(unbounded, Vec::<String>::new());
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(schema["properties"]["replicas"]["default"], 1);
    assert_eq!(
        schema["properties"]["autoscaling"]["properties"]["scaleDownDelaySeconds"]["maximum"],
        3600.0
    );
}
