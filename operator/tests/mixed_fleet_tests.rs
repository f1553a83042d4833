//! Reconcile on a mixed fleet (tests/operator/fleets/mixed.yaml: an RTX 4090, a Blackwell RTX PRO
//! 6000 and an H200 with 64 GiB of DRAM, plus an RTX 3090 the model cannot use): one StatefulSet
//! per hardware class with its own sizing and an affinity for exactly that class, all behind one
//! Service, replicas spread over the classes, and status naming every class and every rejection.

mod fake_api;
mod harness;

use std::sync::Arc;

use fake_api::FakeApi;
use harness::{current, md, MD_PATH, STS_DIR as STS, SVC_PATH};
use moe_operator::controller::reconcile::reconcile;
use moe_operator::controller::Context;
use serde_json::{json, Value};

fn fleet_nodes() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/operator/fleets/mixed.yaml"
    );
    let text = std::fs::read_to_string(path).expect("mixed fleet fixture");
    let list: Value = serde_yaml::from_str(&text).expect("fleet parses");
    list["items"].as_array().unwrap().clone()
}

fn rtx_3090() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "ws-3090", "labels": {
            "feature.node.kubernetes.io/cpu-cpuid.AVX512F": "true",
            "nvidia.com/gpu.compute.major": "8",
            "nvidia.com/gpu.compute.minor": "6",
            "nvidia.com/gpu.memory": "24576",
            "nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-3090",
        }},
        "status": {"allocatable": {"cpu": "32", "memory": "125Gi", "nvidia.com/gpu": "1"}}
    })
}

fn setup(replicas: i32) -> (FakeApi, Arc<Context>) {
    let spec = json!({"replicas": replicas,
                      "model": {"source": {"huggingFace": {"repo": "Qwen/Qwen3-30B-A3B"}}}});
    let nodes: Vec<Value> = fleet_nodes().into_iter().chain([rtx_3090()]).collect();
    let (fake, ctx) = harness::cluster(nodes.clone(), md(spec));
    for node in &nodes {
        // Each node runs DaemonSet pods (device plugin, NFD, kube-proxy): 1.5 CPUs requested, so
        // 2 whole CPUs are not free.
        let name = node["metadata"]["name"].as_str().unwrap();
        let agents = format!("agents-{name}");
        let pod = harness::pod("kube-system", &agents, name, "1500m", "Running", json!({}));
        fake.insert(&harness::pod_path("kube-system", &agents), pod);
    }
    (fake, ctx)
}

fn required_expressions(sts: &Value) -> Vec<(String, String, Vec<String>)> {
    let terms = sts["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        .as_array()
        .unwrap();
    assert_eq!(terms.len(), 1, "one term: exactly this class");
    terms[0]["matchExpressions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["key"].as_str().unwrap().to_string(),
                r["operator"].as_str().unwrap().to_string(),
                r["values"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_string())
                    .collect(),
            )
        })
        .collect()
}

fn daemon_arg(sts: &Value, flag: &str) -> String {
    let args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap();
    let i = args.iter().position(|a| a == flag).unwrap();
    args[i + 1].as_str().unwrap().to_string()
}

#[tokio::test]
async fn every_hardware_class_gets_its_own_statefulset_behind_one_service() {
    let (fake, ctx) = setup(3);
    reconcile(current(&fake), ctx.clone()).await.unwrap();

    let ws = fake
        .get(&format!("{STS}qwen-sm89-24g"))
        .expect("the RTX 4090 class is served");
    let bw = fake
        .get(&format!("{STS}qwen-sm120-96g-amx"))
        .expect("the Blackwell class is served");
    let h200 = fake
        .get(&format!("{STS}qwen-sm90-140g"))
        .expect("the small-DRAM H200 class is served");
    assert!(fake.get(&format!("{STS}qwen-sm86-24g")).is_none());

    // Each class sized for its own hardware: the 4090 keeps part of the experts on the GPU and
    // the rest in 1 GiB hugepages; the big GPUs hold all 128 experts and need 4 GiB of DRAM.
    let experts: u32 = daemon_arg(&ws, "--gpu-experts").parse().unwrap();
    assert!((1..128).contains(&experts), "{experts}");
    assert_eq!(daemon_arg(&ws, "--hugepages"), "1G");
    assert!(
        ws["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
            .get("hugepages-1Gi")
            .is_some()
    );
    assert_eq!(daemon_arg(&bw, "--gpu-experts"), "128");
    assert_eq!(daemon_arg(&h200, "--gpu-experts"), "128");
    assert_eq!(
        h200["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"],
        "4Gi"
    );
    // CPU threads follow each class's free CPUs (allocatable less the DaemonSet pods' requests).
    assert_eq!(daemon_arg(&ws, "--cpu-threads"), "29");
    assert_eq!(daemon_arg(&bw, "--cpu-threads"), "61");
    assert_eq!(daemon_arg(&h200, "--cpu-threads"), "45");

    // Affinity for exactly that class, by labels: the 4090's GPU memory and product, no AMX.
    let exprs = required_expressions(&ws);
    let has = |k: &str, op: &str, v: &str| {
        exprs
            .iter()
            .any(|(key, o, vals)| key == k && o == op && vals == &[v.to_string()])
    };
    assert!(has("nvidia.com/gpu.compute.major", "In", "8"));
    assert!(has("nvidia.com/gpu.compute.minor", "In", "9"));
    assert!(has("nvidia.com/gpu.memory", "In", "24564"));
    assert!(has(
        "nvidia.com/gpu.product",
        "In",
        "NVIDIA-GeForce-RTX-4090"
    ));
    assert!(has(
        "feature.node.kubernetes.io/cpu-cpuid.AMXBF16",
        "NotIn",
        "true"
    ));
    assert!(required_expressions(&bw)
        .iter()
        .any(|(k, o, _)| k == "feature.node.kubernetes.io/cpu-cpuid.AMXBF16" && o == "In"));

    // One replica per class, each StatefulSet selecting only its own pods, the Service all of them.
    let svc_selector = fake.get(SVC_PATH).unwrap()["spec"]["selector"].clone();
    let mut classes = std::collections::BTreeSet::new();
    for sts in [&ws, &bw, &h200] {
        assert_eq!(sts["spec"]["replicas"], 1);
        let selector = sts["spec"]["selector"]["matchLabels"].as_object().unwrap();
        let pod_labels = sts["spec"]["template"]["metadata"]["labels"]
            .as_object()
            .unwrap();
        for (k, v) in selector {
            assert_eq!(pod_labels.get(k), Some(v));
        }
        for (k, v) in svc_selector.as_object().unwrap() {
            assert_eq!(pod_labels.get(k), Some(v), "the Service selects {k}");
        }
        classes.insert(selector["moe.inference.dev/hardware-class"].to_string());
        assert_eq!(sts["spec"]["serviceName"], "qwen-pods");
    }
    assert_eq!(classes.len(), 3, "class selectors do not overlap");

    let status = &fake.get(MD_PATH).unwrap()["status"];
    let listed: Vec<&str> = status["classes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["statefulSet"].as_str().unwrap())
        .collect();
    assert_eq!(listed.len(), 3, "{status}");
    assert!(listed.contains(&"qwen-sm89-24g"));
    let rejected = status["rejectedClasses"].as_array().unwrap();
    assert_eq!(rejected.len(), 1, "{status}");
    assert!(rejected[0]["hardware"]
        .as_str()
        .unwrap()
        .contains("RTX-3090"));
    assert!(
        rejected[0]["reason"]
            .as_str()
            .unwrap()
            .contains("unsupported GPU compute capability"),
        "{}",
        rejected[0]
    );
}

#[tokio::test]
async fn fewer_replicas_than_classes_go_to_the_classes_with_more_gpu_experts() {
    let (fake, ctx) = setup(1);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let replicas =
        |name: &str| fake.get(&format!("{STS}{name}")).unwrap()["spec"]["replicas"].clone();
    assert_eq!(replicas("qwen-sm89-24g"), 0);
    let big = replicas("qwen-sm120-96g-amx").as_i64().unwrap()
        + replicas("qwen-sm90-140g").as_i64().unwrap();
    assert_eq!(big, 1);
}

#[tokio::test]
async fn a_class_leaving_the_cluster_loses_its_statefulset() {
    const CM: &str = "/api/v1/namespaces/ai/configmaps/";
    let (fake, ctx) = setup(3);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert!(fake.get(&format!("{STS}qwen-sm89-24g")).is_some());
    // each class's placement rules, in a ConfigMap the operator owns
    let rules = fake
        .get(&format!("{CM}qwen-sm89-24g-placement"))
        .expect("the class's rule file");
    assert!(rules["data"]["sm89-24g.yaml"]
        .as_str()
        .unwrap()
        .starts_with("# Written by moe-operator for MoEDeployment ai/qwen, node class sm89-24g:"));
    assert_eq!(
        rules["metadata"]["ownerReferences"][0]["kind"],
        "MoEDeployment"
    );
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(fake.client());
    nodes.delete("ws-4090", &Default::default()).await.unwrap();
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert!(fake.get(&format!("{STS}qwen-sm89-24g")).is_none());
    // its rule file goes with it; the other classes keep theirs
    assert!(fake.get(&format!("{CM}qwen-sm89-24g-placement")).is_none());
    assert!(fake.get(&format!("{CM}qwen-sm90-140g-placement")).is_some());
    // The other classes keep their StatefulSets and now share the three replicas.
    let total: i64 = ["qwen-sm120-96g-amx", "qwen-sm90-140g"]
        .iter()
        .map(|n| {
            fake.get(&format!("{STS}{n}")).unwrap()["spec"]["replicas"]
                .as_i64()
                .unwrap()
        })
        .sum();
    assert_eq!(total, 3);
}

#[tokio::test]
async fn a_replica_the_scheduler_cannot_place_reaches_the_status() {
    let (fake, ctx) = setup(3);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let condition = |fake: &FakeApi, type_: &str| {
        fake.get(MD_PATH).unwrap()["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == type_)
            .cloned()
            .unwrap()
    };
    assert_eq!(condition(&fake, "Scheduled")["status"], "True");
    // The StatefulSet controller created a pod; the scheduler found no room for it.
    fake.insert(
        "/api/v1/namespaces/ai/pods/qwen-sm89-24g-0",
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "qwen-sm89-24g-0", "namespace": "ai",
                            "labels": {"app.kubernetes.io/name": "moe-daemon",
                                       "app.kubernetes.io/instance": "qwen"}},
               "status": {"phase": "Pending", "conditions": [{
                   "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                   "message": "0/4 nodes are available: 1 Insufficient cpu, 3 node(s) didn't match Pod's node affinity/selector."}]}}),
    );
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let scheduled = condition(&fake, "Scheduled");
    assert_eq!(scheduled["status"], "False");
    assert_eq!(scheduled["reason"], "FailedScheduling");
    assert!(scheduled["message"]
        .as_str()
        .unwrap()
        .starts_with("qwen-sm89-24g-0: 0/4 nodes are available: 1 Insufficient cpu"));
    assert_eq!(condition(&fake, "Degraded")["reason"], "FailedScheduling");
}
