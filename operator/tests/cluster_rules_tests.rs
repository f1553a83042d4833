//! Reconcile against the API fake's server-side rules: a fleet of identical GPU nodes, objects the
//! operator does not own, immutable StatefulSet fields, fields dropped from the desired state, the
//! scale subresource an HPA reads, and the scale-from-zero activator.

mod fake_api;
mod harness;

use std::sync::Arc;

use fake_api::FakeApi;
use harness::{
    current, h100, pod, qwen_spec as qwen, stored, HPA_PATH, MD_PATH, STS_PATH, SVC_PATH,
};
use http::Method;
use kube::runtime::events::Reporter;
use moe_operator::controller::reconcile::reconcile;
use moe_operator::controller::Context;
use moe_operator::crd::MoEDeployment;
use moe_operator::metrics::Metrics;
use serde_json::{json, Value};

const BACKEND_PATH: &str = "/api/v1/namespaces/ai/services/qwen-backend";
const ACTIVATOR_PATH: &str = "/apis/apps/v1/namespaces/ai/deployments/qwen-activator";

fn setup(spec: Value, nodes: &[&str]) -> (FakeApi, Arc<Context>) {
    harness::cluster(nodes.iter().map(|n| h100(n)), stored(spec))
}

fn degraded_message(fake: &FakeApi) -> String {
    let md = fake.get(MD_PATH).unwrap();
    md["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Degraded")
        .map(|c| c["message"].as_str().unwrap_or("").to_string())
        .unwrap_or_default()
}

#[tokio::test]
async fn three_identical_nodes_give_a_label_affinity_that_survives_fleet_changes() {
    let (fake, ctx) = setup(qwen(), &["gpu-1", "gpu-2", "gpu-3"]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let sts = fake.get(STS_PATH).expect("StatefulSet applied");
    let terms = &sts["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
    for term in terms.as_array().unwrap() {
        // core `validateNodeSelectorTerm`: matchFields allows only metadata.name with one value;
        // we use none at all.
        assert!(term.get("matchFields").is_none(), "{term}");
        for req in term["matchExpressions"].as_array().unwrap() {
            let values = req["values"].as_array().map_or(0, |v| v.len());
            match req["operator"].as_str().unwrap() {
                "In" | "NotIn" => assert!(values >= 1, "{req}"),
                "Gt" | "Lt" => {
                    assert_eq!(values, 1, "{req}");
                    req["values"][0].as_str().unwrap().parse::<i64>().unwrap();
                }
                other => panic!("unexpected operator {other}"),
            }
        }
    }
    let generation = sts["metadata"]["generation"].clone();
    // A fourth node joins and one is cordoned: the pod template does not change, so no replica
    // restarts (each would reload the model).
    fake.insert("/api/v1/nodes/gpu-4", h100("gpu-4"));
    fake.update("/api/v1/nodes/gpu-1", |n| {
        n["spec"] = json!({"unschedulable": true})
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let after = fake.get(STS_PATH).unwrap();
    assert_eq!(after["metadata"]["generation"], generation);
    assert_eq!(after["spec"]["template"], sts["spec"]["template"]);
}

#[tokio::test]
async fn the_hpa_reads_a_nonzero_scale_and_its_writes_resize_the_statefulset() {
    let mut spec = qwen();
    spec["autoscaling"] = json!({"provider": "hpa", "minReplicas": 1, "maxReplicas": 4});
    let (fake, ctx) = setup(spec, &["gpu-1"]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert!(fake.get(HPA_PATH).is_some());
    let client = fake.client();
    let api: kube::Api<MoEDeployment> = kube::Api::namespaced(client, "ai");
    // What the HPA controller reads first: a scale of 0 would disable it.
    let scale = api.get_scale("qwen").await.unwrap();
    assert_eq!(scale.spec.unwrap().replicas, Some(1));
    assert_eq!(
        scale.status.unwrap().selector.as_deref(),
        Some("app.kubernetes.io/instance=qwen,app.kubernetes.io/name=moe-daemon")
    );
    // The HPA scales to 3 through the subresource; the next reconcile resizes the StatefulSet.
    let patch = kube::api::Patch::Merge(json!({"spec": {"replicas": 3}}));
    api.patch_scale("qwen", &Default::default(), &patch)
        .await
        .unwrap();
    assert_eq!(fake.get(MD_PATH).unwrap()["metadata"]["generation"], 2);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert_eq!(fake.get(STS_PATH).unwrap()["spec"]["replicas"], 3);
}

#[tokio::test]
async fn a_service_someone_else_made_is_reported_not_adopted() {
    let (fake, ctx) = setup(qwen(), &["gpu-1"]);
    let theirs = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "qwen", "namespace": "ai"},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}});
    fake.apply_as("kubectl", SVC_PATH, theirs.clone());
    assert!(reconcile(current(&fake), ctx.clone()).await.is_err());
    let svc = fake.get(SVC_PATH).unwrap();
    assert_eq!(svc["spec"]["selector"], json!({"app": "theirs"}));
    assert!(svc["metadata"].get("ownerReferences").is_none());
    assert!(
        degraded_message(&fake).contains("not controlled by this MoEDeployment"),
        "{}",
        degraded_message(&fake)
    );
}

#[tokio::test]
async fn an_hpa_someone_else_made_is_not_deleted() {
    let (fake, ctx) = setup(qwen(), &["gpu-1"]);
    let theirs = json!({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "qwen", "namespace": "ai"},
        "spec": {"maxReplicas": 2, "scaleTargetRef": {"kind": "Deployment", "name": "other"}}});
    fake.apply_as("kubectl", HPA_PATH, theirs);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert!(fake.get(HPA_PATH).is_some(), "the user's HPA stays");
    assert_eq!(fake.count(Method::DELETE, "/horizontalpodautoscalers/"), 0);
}

#[tokio::test]
async fn adding_a_cache_recreates_the_statefulset_keeping_its_pods() {
    let (fake, ctx) = setup(qwen(), &["gpu-1"]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let claim = |fake: &FakeApi| {
        fake.get(STS_PATH).unwrap()["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]
            ["requests"]["storage"]
            .clone()
    };
    assert_ne!(claim(&fake), "80Gi", "the derived cache size");
    // Adding model.cache changes the claim template, which the API server refuses to change in
    // place (the fake answers 422 as it does).
    fake.update(MD_PATH, |md| {
        md["spec"]["model"]["cache"] = json!({"size": "80Gi"});
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let sts = fake.get(STS_PATH).unwrap();
    assert_eq!(
        sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"],
        "80Gi"
    );
    let delete = fake
        .requests()
        .into_iter()
        .find(|r| r.method == Method::DELETE && r.path == STS_PATH)
        .expect("old StatefulSet deleted");
    assert_eq!(delete.body.unwrap()["propagationPolicy"], "Orphan");
}

#[tokio::test]
async fn fields_dropped_from_the_desired_state_are_removed() {
    let mut spec = qwen();
    spec["pod"] = json!({"annotations": {"team": "llm"}});
    let (fake, ctx) = setup(spec, &["gpu-1"]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    // the user's annotation beside the operator's own (the class rules' hash)
    let team = |fake: &FakeApi| {
        fake.get(STS_PATH).unwrap()["spec"]["template"]["metadata"]["annotations"]
            .get("team")
            .cloned()
    };
    assert_eq!(team(&fake), Some(json!("llm")));
    fake.update(MD_PATH, |md| {
        md["spec"]["pod"] = json!({});
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert_eq!(team(&fake), None);
    assert!(!fake
        .owned_fields(STS_PATH, "moe-operator")
        .iter()
        .any(|f| f.contains("annotations") && f.contains("team")));
}

#[tokio::test]
async fn scale_to_zero_puts_the_activator_in_front_and_takes_it_away_again() {
    let mut spec = qwen();
    spec["autoscaling"] =
        json!({"provider": "builtin", "minReplicas": 0, "maxReplicas": 2, "scaleToZero": true});
    let (fake, ctx) = setup(spec, &["gpu-1"]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let activator = fake.get(ACTIVATOR_PATH).expect("activator Deployment");
    let args = &activator["spec"]["template"]["spec"]["containers"][0]["args"];
    assert_eq!(args[0], "activator");
    assert!(args
        .as_array()
        .unwrap()
        .contains(&json!("http://qwen-backend.ai.svc:8000")));
    assert_eq!(
        fake.get(SVC_PATH).unwrap()["spec"]["selector"]["app.kubernetes.io/name"],
        "moe-activator"
    );
    assert_eq!(
        fake.get(BACKEND_PATH).unwrap()["spec"]["selector"]["app.kubernetes.io/name"],
        "moe-daemon"
    );
    fake.update(MD_PATH, |md| {
        md["spec"]["autoscaling"] =
            json!({"provider": "builtin", "minReplicas": 1, "maxReplicas": 2});
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert!(fake.get(ACTIVATOR_PATH).is_none());
    assert!(fake.get(BACKEND_PATH).is_none());
    assert_eq!(
        fake.get(SVC_PATH).unwrap()["spec"]["selector"]["app.kubernetes.io/name"],
        "moe-daemon"
    );
}

#[tokio::test]
async fn invalid_names_are_reported_before_anything_is_applied() {
    let fake = FakeApi::default();
    fake.insert("/api/v1/nodes/gpu-1", h100("gpu-1"));
    let path = "/apis/moe.inference.dev/v1alpha1/namespaces/ai/moedeployments/glm-4.5";
    let mut md = stored(qwen());
    md["metadata"]["name"] = "glm-4.5".into();
    fake.insert(path, md);
    let reporter = Reporter {
        controller: "moe-operator".into(),
        instance: None,
    };
    let ctx = Arc::new(Context::new(
        fake.client(),
        reporter,
        Metrics::new().unwrap(),
    ));
    let md: MoEDeployment = serde_json::from_value(fake.get(path).unwrap()).unwrap();
    reconcile(Arc::new(md), ctx).await.unwrap();
    assert!(fake
        .get("/apis/apps/v1/namespaces/ai/statefulsets/glm-4.5")
        .is_none());
    let stored = fake.get(path).unwrap();
    assert!(
        stored["status"].to_string().contains("DNS-1035"),
        "{}",
        stored["status"]
    );
}

fn cpu_request(sts: &Value) -> Value {
    sts["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"].clone()
}

#[tokio::test]
async fn cpus_are_sized_from_what_other_pods_leave_free_on_the_node() {
    let (fake, ctx) = setup(qwen(), &["gpu-1"]);
    let pods = "/api/v1/namespaces";
    // Another team's pod and the DaemonSets: 10.5 of the node's 64 CPUs.
    fake.insert(
        &format!("{pods}/batch/pods/train-0"),
        pod("batch", "train-0", "gpu-1", "10", "Running", json!({})),
    );
    fake.insert(
        &format!("{pods}/kube-system/pods/proxy-gpu-1"),
        pod(
            "kube-system",
            "proxy-gpu-1",
            "gpu-1",
            "500m",
            "Running",
            json!({}),
        ),
    );
    // Not counted: a finished job, a pod on no node, and this deployment's own replica (its CPUs
    // are the ones being sized).
    fake.insert(
        &format!("{pods}/batch/pods/done-0"),
        pod("batch", "done-0", "gpu-1", "8", "Succeeded", json!({})),
    );
    fake.insert(
        &format!("{pods}/batch/pods/waiting-0"),
        pod("batch", "waiting-0", "", "8", "Pending", json!({})),
    );
    let own = json!({"app.kubernetes.io/name": "moe-daemon", "app.kubernetes.io/instance": "qwen"});
    fake.insert(
        &format!("{pods}/ai/pods/qwen-sm90-80g-0"),
        pod("ai", "qwen-sm90-80g-0", "gpu-1", "62", "Running", own),
    );
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let sts = fake.get(STS_PATH).expect("StatefulSet applied");
    assert_eq!(cpu_request(&sts), json!("53"), "64 − 10.5, whole CPUs");
    let listed = fake
        .requests()
        .into_iter()
        .filter(|r| r.method == Method::GET && r.path == "/api/v1/pods")
        .collect::<Vec<_>>();
    assert!(
        listed.iter().all(|r| r.query.contains("fieldSelector=")),
        "bound, running pods only"
    );

    // The other team's pod ends: its CPUs are free again at the next reconcile.
    fake.update(&format!("{pods}/batch/pods/train-0"), |p| {
        p["status"]["phase"] = json!("Failed")
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert_eq!(cpu_request(&fake.get(STS_PATH).unwrap()), json!("63"));
}

#[tokio::test]
async fn a_node_with_too_few_free_cpus_is_rejected_with_the_reason() {
    let (fake, ctx) = setup(qwen(), &["gpu-1"]);
    fake.insert(
        "/api/v1/namespaces/batch/pods/hog",
        pod("batch", "hog", "gpu-1", "63", "Running", json!({})),
    );
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert!(fake.get(STS_PATH).is_none());
    let msg = degraded_message(&fake);
    assert!(msg.contains("insufficient cpu"), "{msg}");
}
