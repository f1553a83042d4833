//! CPU already requested on each node, so that `auto` CPU sizing takes what is free there rather
//! than allocatable minus a guess. Read from the pods bound to nodes (`spec.nodeName` set) that have
//! not terminated, through one cluster-wide Pod watch feeding a reflector store (as the Node watch
//! does), with each pod trimmed to what the sum needs before it is stored.
//!
//! A pod's request is the scheduler's rule (`k8s.io/component-helpers/resource.PodRequests`): the
//! containers' sum plus sidecar (restartable) init containers, or the largest regular init container
//! with the sidecars started before it, whichever is larger, plus the pod overhead; a container
//! without a CPU request counts its limit (the API server defaults one to the other).
//!
//! Pod churn does not trigger reconciles (the periodic re-check picks it up): a busy cluster would
//! otherwise re-plan every MoEDeployment on every pod event.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;

use crate::node_cache::READY_WAIT;
use crate::quantity::parse_millicores;
use crate::server::Health;

/// Field selector of the pods that hold node resources: bound, not terminated.
pub const BOUND_ACTIVE_PODS: &str = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed";

/// Millicores requested on each node by the pods counted (nodes without any are absent: 0).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuRequests {
    by_node: BTreeMap<String, u64>,
}

impl CpuRequests {
    /// Sums the requests of `pods` per node, leaving out terminated or unbound pods and those
    /// `skip` names (the deployment's own replicas, whose CPUs are what is being sized).
    pub fn from_pods<'a>(
        pods: impl IntoIterator<Item = &'a Pod>,
        skip: impl Fn(&Pod) -> bool,
    ) -> Self {
        let mut by_node = BTreeMap::new();
        for pod in pods {
            let Some(node) = bound_node(pod) else {
                continue;
            };
            if terminated(pod) || skip(pod) {
                continue;
            }
            *by_node.entry(node.to_string()).or_insert(0) += pod_cpu_millis(pod);
        }
        Self { by_node }
    }

    /// Millicores requested on `node`.
    pub fn on(&self, node: &str) -> u64 {
        self.by_node.get(node).copied().unwrap_or(0)
    }
}

fn bound_node(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()?
        .node_name
        .as_deref()
        .filter(|n| !n.is_empty())
}

fn terminated(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// The `cpu` entry of a resource list, in millicores.
fn cpu_of(list: Option<&BTreeMap<String, Quantity>>) -> Option<u64> {
    parse_millicores(&list?.get("cpu")?.0).ok()
}

/// A container's CPU request (its limit when it sets none), in millicores.
fn container_cpu_millis(c: &Container) -> u64 {
    let Some(res) = &c.resources else { return 0 };
    cpu_of(res.requests.as_ref())
        .or_else(|| cpu_of(res.limits.as_ref()))
        .unwrap_or(0)
}

/// The pod's effective CPU request, as the scheduler counts it (see the module comment).
pub fn pod_cpu_millis(pod: &Pod) -> u64 {
    let Some(spec) = &pod.spec else { return 0 };
    let containers: u64 = spec.containers.iter().map(container_cpu_millis).sum();
    let (sidecars, init_peak) = init_containers_cpu(spec);
    let overhead = cpu_of(spec.overhead.as_ref()).unwrap_or(0);
    (containers + sidecars).max(init_peak) + overhead
}

/// (CPU of the sidecar init containers, which run beside the containers; the peak while the
/// regular init containers run one by one, each beside the sidecars started before it).
fn init_containers_cpu(spec: &PodSpec) -> (u64, u64) {
    let (mut sidecars, mut peak) = (0u64, 0u64);
    for c in spec.init_containers.iter().flatten() {
        let cpu = container_cpu_millis(c);
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars += cpu;
            peak = peak.max(sidecars);
        } else {
            peak = peak.max(sidecars + cpu);
        }
    }
    (sidecars, peak)
}

/// Only what [`pod_cpu_millis`] and the filters read; the rest of a pod is dropped before storing.
fn trimmed(pod: &Pod) -> Pod {
    let keep = |c: &Container| Container {
        name: c.name.clone(),
        resources: c.resources.clone(),
        restart_policy: c.restart_policy.clone(),
        ..Default::default()
    };
    let spec = pod.spec.as_ref().map(|s| PodSpec {
        node_name: s.node_name.clone(),
        containers: s.containers.iter().map(keep).collect(),
        init_containers: s
            .init_containers
            .as_ref()
            .map(|cs| cs.iter().map(keep).collect()),
        overhead: s.overhead.clone(),
        ..Default::default()
    });
    let mut meta = pod.metadata.clone();
    meta.managed_fields = None;
    meta.annotations = None;
    meta.owner_references = None;
    Pod {
        metadata: meta,
        spec,
        status: pod.status.as_ref().map(|s| PodStatus {
            phase: s.phase.clone(),
            ..Default::default()
        }),
    }
}

/// The cluster's bound, running pods, kept current by a watch.
#[derive(Clone)]
pub struct PodCache {
    store: Store<Pod>,
}

impl PodCache {
    /// Starts the watch on the current runtime; it runs until the process ends (with backoff on
    /// errors). Its events count as watch activity for `/healthz`.
    pub fn spawn(client: Client, health: Arc<Health>) -> Self {
        let (store, writer) = reflector::store();
        let api: Api<Pod> = Api::all(client);
        let config = watcher::Config::default().fields(BOUND_ACTIVE_PODS);
        let events = watcher(api, config)
            .default_backoff()
            .modify(|pod| *pod = trimmed(pod))
            .reflect(writer);
        tokio::spawn(async move {
            futures::pin_mut!(events);
            while let Some(event) = events.next().await {
                match event {
                    Ok(_) => health.touch(),
                    Err(e) => tracing::warn!(error = %e, "pod watch"),
                }
            }
        });
        Self { store }
    }

    /// The cached pods once the first full list has arrived; `None` if it has not within
    /// [`READY_WAIT`] (the caller then lists pods itself).
    pub async fn pods(&self) -> Option<Vec<Arc<Pod>>> {
        tokio::time::timeout(READY_WAIT, self.store.wait_until_ready())
            .await
            .ok()?
            .ok()?;
        Some(self.store.state())
    }
}

/// The bound, running pods: from `cache` when it is ready, else one cluster-wide list.
pub async fn bound_pods(client: &Client, cache: Option<&PodCache>) -> kube::Result<Vec<Pod>> {
    if let Some(pods) = match cache {
        Some(c) => c.pods().await,
        None => None,
    } {
        return Ok(pods.iter().map(|p| (**p).clone()).collect());
    }
    let api: Api<Pod> = Api::all(client.clone());
    let list = api
        .list(&ListParams::default().fields(BOUND_ACTIVE_PODS))
        .await?;
    Ok(list.items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(node: &str, phase: &str, spec: serde_json::Value) -> Pod {
        let mut spec = spec;
        spec["nodeName"] = json!(node);
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "ns"},
                                      "spec": spec, "status": {"phase": phase}}))
        .unwrap()
    }

    fn c(cpu_request: Option<&str>, cpu_limit: Option<&str>) -> serde_json::Value {
        let mut res = json!({});
        if let Some(r) = cpu_request {
            res["requests"] = json!({"cpu": r});
        }
        if let Some(l) = cpu_limit {
            res["limits"] = json!({"cpu": l});
        }
        json!({"name": "c", "resources": res})
    }

    #[test]
    fn pod_requests_follow_the_schedulers_rule() {
        let plain = pod(
            "n1",
            "Running",
            json!({"containers": [c(Some("500m"), None), c(None, Some("2"))]}),
        );
        assert_eq!(
            pod_cpu_millis(&plain),
            2500,
            "a limit stands in for a request"
        );
        // A regular init container larger than the containers sets the request.
        let init = pod(
            "n1",
            "Running",
            json!({"containers": [c(Some("1"), None)], "initContainers": [c(Some("3"), None)],
                   "overhead": {"cpu": "250m"}}),
        );
        assert_eq!(pod_cpu_millis(&init), 3250);
        // A sidecar runs beside the containers and beside later init containers.
        let mut sidecar = c(Some("1"), None);
        sidecar["restartPolicy"] = json!("Always");
        let with_sidecar = pod(
            "n1",
            "Pending",
            json!({"containers": [c(Some("2"), None)],
                   "initContainers": [sidecar, c(Some("2500m"), None)]}),
        );
        assert_eq!(pod_cpu_millis(&with_sidecar), 3500);
        assert_eq!(pod_cpu_millis(&trimmed(&with_sidecar)), 3500);
    }

    #[test]
    fn sums_per_node_skip_terminated_unbound_and_named_pods() {
        let containers = json!({"containers": [c(Some("1500m"), None)]});
        let mut unbound = pod("n1", "Pending", containers.clone());
        unbound.spec.as_mut().unwrap().node_name = None;
        let mut own = pod("n2", "Running", containers.clone());
        own.metadata.name = Some("mine".into());
        let pods = [
            pod("n1", "Running", containers.clone()),
            pod("n1", "Pending", containers.clone()),
            pod("n1", "Succeeded", containers.clone()),
            pod("n2", "Failed", containers.clone()),
            unbound,
            own,
        ];
        let used = CpuRequests::from_pods(&pods, |p| p.metadata.name.as_deref() == Some("mine"));
        assert_eq!((used.on("n1"), used.on("n2"), used.on("n3")), (3000, 0, 0));
    }
}
