//! What the reconcile tests share: an API fake holding GPU nodes and one MoEDeployment `ai/qwen`,
//! the controller context over it, and readers of what the reconcile left there.
//!
//! Each test file declares `mod fake_api; mod harness;` (integration tests are separate crates).
#![allow(dead_code)]

use std::sync::Arc;

use crate::fake_api::FakeApi;
use kube::runtime::events::Reporter;
use moe_operator::controller::Context;
use moe_operator::crd::MoEDeployment;
use moe_operator::metrics::Metrics;
use serde_json::{json, Value};

pub const MD_PATH: &str = "/apis/moe.inference.dev/v1alpha1/namespaces/ai/moedeployments/qwen";
pub const STS_DIR: &str = "/apis/apps/v1/namespaces/ai/statefulsets/";
/// The StatefulSet of the H100 class (SM 9.0, 80 GB).
pub const STS_PATH: &str = "/apis/apps/v1/namespaces/ai/statefulsets/qwen-sm90-80g";
pub const SVC_PATH: &str = "/api/v1/namespaces/ai/services/qwen";
pub const HPA_PATH: &str = "/apis/autoscaling/v2/namespaces/ai/horizontalpodautoscalers/qwen";

/// An H100 node as NFD and GFD label it: AVX-512, SM 9.0, 80 GB, 64 CPUs, 512 GiB.
pub fn h100(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "feature.node.kubernetes.io/cpu-cpuid.AVX512F": "true",
            "nvidia.com/gpu.compute.major": "9",
            "nvidia.com/gpu.compute.minor": "0",
            "nvidia.com/gpu.memory": "81559",
        }},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "1"}}
    })
}

/// The smallest spec: Qwen3-30B-A3B from Hugging Face, everything else defaulted.
pub fn qwen_spec() -> Value {
    json!({"model": {"source": {"huggingFace": {"repo": "Qwen/Qwen3-30B-A3B"}}}})
}

/// The MoEDeployment `ai/qwen` with `spec` as written.
pub fn md(spec: Value) -> Value {
    json!({"apiVersion": "moe.inference.dev/v1alpha1", "kind": "MoEDeployment",
           "metadata": {"name": "qwen", "namespace": "ai"}, "spec": spec})
}

/// The MoEDeployment as the API server stores it: schema defaults applied (here `replicas`, read
/// from the generated CRD so the test follows the schema).
pub fn stored(spec: Value) -> Value {
    let crd = moe_operator::crd::crd_value().unwrap();
    let default = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["replicas"]["default"]
        .clone();
    let mut spec = spec;
    if spec.get("replicas").is_none() && !default.is_null() {
        spec["replicas"] = default;
    }
    md(spec)
}

/// An API fake holding `nodes` and the MoEDeployment `md_object`, and a controller context over it.
pub fn cluster(
    nodes: impl IntoIterator<Item = Value>,
    md_object: Value,
) -> (FakeApi, Arc<Context>) {
    let fake = FakeApi::default();
    for node in nodes {
        let name = node["metadata"]["name"].as_str().unwrap().to_string();
        fake.insert(&format!("/api/v1/nodes/{name}"), node);
    }
    fake.insert(MD_PATH, md_object);
    let reporter = Reporter {
        controller: "moe-operator".into(),
        instance: Some("test".into()),
    };
    let ctx = Arc::new(Context::new(
        fake.client(),
        reporter,
        Metrics::new().unwrap(),
    ));
    (fake, ctx)
}

/// The MoEDeployment as stored now (what the next reconcile receives).
pub fn current(fake: &FakeApi) -> Arc<MoEDeployment> {
    Arc::new(serde_json::from_value(fake.get(MD_PATH).expect("MoEDeployment stored")).unwrap())
}

/// Status condition `type_` of a stored MoEDeployment.
pub fn condition<'a>(md: &'a Value, type_: &str) -> &'a Value {
    md["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("condition {type_} missing in {}", md["status"]))
}

/// Where the fake keeps pod `namespace/name`.
pub fn pod_path(namespace: &str, name: &str) -> String {
    format!("/api/v1/namespaces/{namespace}/pods/{name}")
}

/// A pod bound to `node` (none when empty) with one container requesting (and limited to) `cpu`.
pub fn pod(
    namespace: &str,
    name: &str,
    node: &str,
    cpu: &str,
    phase: &str,
    labels: Value,
) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "labels": labels},
           "spec": {"nodeName": node, "containers": [
               {"name": "c", "resources": {"requests": {"cpu": cpu}, "limits": {"cpu": cpu}}}]},
           "status": {"phase": phase}})
}
