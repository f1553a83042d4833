//! Reconcile against the in-memory API fake: create, spec change, status, deletion without a
//! finalizer, 409 conflict retry, API errors, unschedulable and invalid specs, provider switches.

mod fake_api;
mod harness;

use std::sync::Arc;

use fake_api::FakeApi;
use harness::{condition, current, md as md_value, HPA_PATH, MD_PATH, STS_PATH, SVC_PATH};
use http::Method;
use moe_operator::controller::reconcile::{reconcile, LEGACY_FINALIZER};
use moe_operator::controller::{Context, Error};
use moe_operator::crd::MoEDeployment;
use serde_json::{json, Value};

const HEADLESS_PATH: &str = "/api/v1/namespaces/ai/services/qwen-pods";
const PDB_PATH: &str = "/apis/policy/v1/namespaces/ai/poddisruptionbudgets/qwen";

/// An H100 node with no 1 GiB hugepages reserved, with or without AVX-512.
fn gpu_node(name: &str, avx512: bool) -> Value {
    let mut node = harness::h100(name);
    if !avx512 {
        node["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove("feature.node.kubernetes.io/cpu-cpuid.AVX512F");
    }
    node["status"]["allocatable"]["hugepages-1Gi"] = "0".into();
    node
}

fn qwen_spec() -> Value {
    json!({"model": {"source": {"huggingFace": {"repo": "Qwen/Qwen3-30B-A3B"}}, "servedName": "qwen3"}})
}

fn setup(spec: Value, nodes_with_avx: &[(&str, bool)]) -> (FakeApi, Arc<Context>) {
    let nodes = nodes_with_avx.iter().map(|(n, avx)| gpu_node(n, *avx));
    harness::cluster(nodes, md_value(spec))
}

/// A reconcile and the periodic resync after it (both must be idempotent).
async fn reconcile_twice(fake: &FakeApi, ctx: &Arc<Context>) -> Result<(), Error> {
    reconcile(current(fake), ctx.clone()).await?;
    reconcile(current(fake), ctx.clone()).await.map(drop)
}

#[tokio::test]
async fn create_applies_owned_objects_and_status() {
    let (fake, ctx) = setup(qwen_spec(), &[("gpu-1", true), ("gpu-2", true)]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert_eq!(
        fake.get(MD_PATH).unwrap()["metadata"].get("finalizers"),
        None,
        "no finalizer: deletion never waits on the operator"
    );
    for path in [STS_PATH, SVC_PATH, HEADLESS_PATH, PDB_PATH] {
        let obj = fake
            .get(path)
            .unwrap_or_else(|| panic!("{path} not applied"));
        let owner = &obj["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "MoEDeployment", "{path}");
        assert_eq!(owner["controller"], true);
    }
    let applies: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.method == Method::PATCH && r.path == STS_PATH)
        .collect();
    assert!(applies[0].content_type.contains("apply-patch"));
    assert!(
        applies[0].query.contains("fieldManager=moe-operator")
            && applies[0].query.contains("force=true")
    );

    let md = fake.get(MD_PATH).unwrap();
    assert_eq!(condition(&md, "Scheduled")["status"], "True");
    assert_eq!(condition(&md, "ModelReady")["reason"], "Loading");
    assert_eq!(md["status"]["endpoint"], "http://qwen.ai.svc:8000/v1");
    assert_eq!(md["status"]["nodes"], json!(["gpu-1", "gpu-2"]));
    assert_eq!(md["status"]["observedGeneration"], 1);
    assert_eq!(md["status"]["placement"]["gpuExpertsPerLayer"], 128);
    assert!(
        fake.count(Method::POST, "/events") >= 1,
        "a Scheduled event is published"
    );
}

#[tokio::test]
async fn spec_change_updates_the_statefulset() {
    let (fake, ctx) = setup(qwen_spec(), &[("gpu-1", true)]);
    reconcile_twice(&fake, &ctx).await.unwrap();
    fake.update(MD_PATH, |md| {
        md["spec"]["serving"] = json!({"maxNumSeqs": 64});
        md["metadata"]["generation"] = 2.into();
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let args =
        fake.get(STS_PATH).unwrap()["spec"]["template"]["spec"]["containers"][0]["args"].clone();
    let args: Vec<String> = serde_json::from_value(args).unwrap();
    let i = args.iter().position(|a| a == "--max-num-seqs").unwrap();
    assert_eq!(args[i + 1], "64");
    assert_eq!(
        fake.get(MD_PATH).unwrap()["status"]["observedGeneration"],
        2
    );
}

#[tokio::test]
async fn status_follows_statefulset_readiness() {
    let (fake, ctx) = setup(qwen_spec(), &[("gpu-1", true)]);
    reconcile_twice(&fake, &ctx).await.unwrap();
    fake.update(STS_PATH, |sts| {
        sts["status"] = json!({"replicas": 1, "readyReplicas": 1})
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let md = fake.get(MD_PATH).unwrap();
    assert_eq!(md["status"]["readyReplicas"], 1);
    assert_eq!(condition(&md, "Ready")["status"], "True");
    assert_eq!(condition(&md, "ModelReady")["reason"], "ModelLoaded");
    assert_eq!(condition(&md, "Degraded")["status"], "False");
}

#[tokio::test]
async fn a_finalizer_left_by_older_versions_is_removed_and_deletion_is_immediate() {
    let (fake, ctx) = setup(qwen_spec(), &[("gpu-1", true)]);
    fake.update(MD_PATH, |md| {
        md["metadata"]["finalizers"] = json!(["example.com/other", LEGACY_FINALIZER])
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert_eq!(
        fake.get(MD_PATH).unwrap()["metadata"]["finalizers"],
        json!(["example.com/other"]),
        "only our own finalizer goes"
    );
    fake.update(MD_PATH, |md| md["metadata"]["finalizers"] = json!([]));
    let client = fake.client();
    let api: kube::Api<MoEDeployment> = kube::Api::namespaced(client, "ai");
    api.delete("qwen", &Default::default()).await.unwrap();
    assert!(fake.get(MD_PATH).is_none(), "nothing holds the object");
}

#[tokio::test]
async fn conflict_on_apply_is_retried() {
    let (fake, ctx) = setup(qwen_spec(), &[("gpu-1", true)]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let before = fake.count(Method::PATCH, "/statefulsets/qwen");
    fake.fail(Method::PATCH, "/statefulsets/qwen", 409, 2);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert_eq!(
        fake.count(Method::PATCH, "/statefulsets/qwen") - before,
        3,
        "two conflicts, then success"
    );
    assert!(fake.get(STS_PATH).is_some());
}

#[tokio::test]
async fn api_errors_surface_and_are_recorded_in_status() {
    let (fake, ctx) = setup(qwen_spec(), &[("gpu-1", true)]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();

    fake.fail(Method::GET, "/api/v1/nodes", 500, 1);
    let err = reconcile(current(&fake), ctx.clone()).await.unwrap_err();
    assert!(err.to_string().contains("kubernetes API"), "{err}");

    fake.fail(Method::PATCH, "/statefulsets/qwen", 500, 1);
    assert!(reconcile(current(&fake), ctx.clone()).await.is_err());
    let md = fake.get(MD_PATH).unwrap();
    assert_eq!(condition(&md, "Degraded")["reason"], "ApplyFailed");

    // The next reconcile recovers.
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let md = fake.get(MD_PATH).unwrap();
    assert_eq!(condition(&md, "Degraded")["status"], "False");
}

#[tokio::test]
async fn no_qualifying_nodes_reports_why() {
    let (fake, ctx) = setup(qwen_spec(), &[("a", false), ("b", false), ("c", true)]);
    fake.update("/api/v1/nodes/c", |n| {
        n["spec"] = json!({"unschedulable": true})
    });
    reconcile_twice(&fake, &ctx).await.unwrap();
    assert!(fake.get(STS_PATH).is_none());
    let md = fake.get(MD_PATH).unwrap();
    let scheduled = condition(&md, "Scheduled");
    assert_eq!(scheduled["status"], "False");
    assert_eq!(
        scheduled["message"],
        "0/3 nodes are available: 2 without AVX-512, 1 unschedulable."
    );
}

#[tokio::test]
async fn invalid_spec_is_reported_not_applied() {
    let spec = json!({"model": {"source": {"hostPath": {"path": "/models/custom"}}}});
    let (fake, ctx) = setup(spec, &[("gpu-1", true)]);
    reconcile_twice(&fake, &ctx).await.unwrap();
    assert!(fake.get(STS_PATH).is_none());
    let md = fake.get(MD_PATH).unwrap();
    assert_eq!(condition(&md, "Degraded")["reason"], "InvalidSpec");
    assert!(condition(&md, "Degraded")["message"]
        .as_str()
        .unwrap()
        .contains("resources.memory is required"));
}

#[tokio::test]
async fn keda_provider_without_keda_installed_says_so() {
    let mut spec = qwen_spec();
    spec["autoscaling"] = json!({"provider": "keda", "minReplicas": 1, "maxReplicas": 2,
                                 "prometheus": {"serverAddress": "http://prom:9090"}});
    let (fake, ctx) = setup(spec, &[("gpu-1", true)]);
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    fake.fail(Method::PATCH, "/scaledobjects/qwen", 404, 1);
    assert!(reconcile(current(&fake), ctx.clone()).await.is_err());
    let md = fake.get(MD_PATH).unwrap();
    let degraded = condition(&md, "Degraded");
    assert_eq!(degraded["reason"], "ApplyFailed");
    assert!(
        degraded["message"]
            .as_str()
            .unwrap()
            .contains("KEDA is not installed"),
        "{degraded}"
    );
    // Once the API exists the ScaledObject is applied.
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    let so = fake
        .get("/apis/keda.sh/v1alpha1/namespaces/ai/scaledobjects/qwen")
        .expect("scaled object");
    assert_eq!(so["spec"]["triggers"][0]["type"], "prometheus");
}

#[tokio::test]
async fn switching_provider_removes_the_hpa() {
    let mut spec = qwen_spec();
    spec["autoscaling"] = json!({"provider": "hpa", "minReplicas": 1, "maxReplicas": 3});
    let (fake, ctx) = setup(spec, &[("gpu-1", true)]);
    reconcile_twice(&fake, &ctx).await.unwrap();
    assert_eq!(
        fake.get(HPA_PATH).expect("hpa applied")["spec"]["metrics"][0]["pods"]["metric"]["name"],
        "moe:num_requests_waiting"
    );
    fake.update(MD_PATH, |md| {
        md["spec"]["autoscaling"]["provider"] = "builtin".into()
    });
    reconcile(current(&fake), ctx.clone()).await.unwrap();
    assert!(
        fake.get(HPA_PATH).is_none(),
        "hpa deleted after switching to builtin"
    );
}

#[tokio::test]
async fn builtin_autoscaler_scales_on_scraped_queue_depth() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // One replica's /metrics: 7 waiting requests.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 1024];
        let _ = sock.read(&mut buf).await;
        let body = "moe:num_requests_waiting{model_name=\"qwen3\"} 7\nmoe:num_requests_running 4\n";
        sock.write_all(format!("HTTP/1.0 200 OK\r\n\r\n{body}").as_bytes())
            .await
            .unwrap();
    });
    let mut spec = qwen_spec();
    spec["replicas"] = 1.into();
    spec["autoscaling"] = json!({"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2});
    let (fake, ctx) = setup(spec, &[("gpu-1", true)]);
    fake.insert(
        "/api/v1/namespaces/ai/pods/qwen-0",
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "qwen-0", "namespace": "ai"},
               "status": {"podIP": "127.0.0.1"}}),
    );
    let clock = std::time::Instant::now();
    moe_operator::controller::builtin_scaler::scale_one(&ctx, &current(&fake), clock, port).await;
    // ⌈7 / 2⌉ = 4 replicas, written through the scale subresource.
    assert_eq!(fake.get(MD_PATH).unwrap()["spec"]["replicas"], 4);
    assert_eq!(fake.count(Method::PATCH, "/moedeployments/qwen/scale"), 1);
    let events = fake.requests();
    assert!(events.iter().any(|r| r.path.ends_with("/events")
        && r.body.as_ref().is_some_and(|b| b["reason"] == "ScaledUp")));
}
