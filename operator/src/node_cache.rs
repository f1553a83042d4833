//! One cluster-wide Node watch feeding a reflector store, so reconciles read nodes from memory
//! instead of listing every Node from the API server each time. The watch also says when placement
//! may have changed: only changes to what placement reads (labels, taints, `unschedulable`,
//! allocatable) count, not the kubelet's periodic status heartbeats, and each such change asks the
//! controllers to reconcile every MoEDeployment.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use tokio::sync::watch;

use crate::server::Health;

/// How long a reconcile waits for the first full Node list before listing nodes itself.
pub const READY_WAIT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct NodeCache {
    pub store: Store<Node>,
    changes: watch::Receiver<u64>,
}

/// Hash of the fields placement reads from a Node; equal hashes mean the same placement inputs.
pub fn placement_fingerprint(node: &Node) -> u64 {
    let mut h = DefaultHasher::new();
    node.labels().hash(&mut h);
    if let Some(spec) = &node.spec {
        spec.unschedulable.hash(&mut h);
        for t in spec.taints.iter().flatten() {
            (&t.key, &t.value, &t.effect).hash(&mut h);
        }
    }
    if let Some(alloc) = node.status.as_ref().and_then(|s| s.allocatable.as_ref()) {
        for (k, v) in alloc {
            (k, &v.0).hash(&mut h);
        }
    }
    h.finish()
}

/// Remembers each node's fingerprint; says whether an event changed placement inputs.
#[derive(Default)]
pub struct ChangeFilter {
    seen: HashMap<String, u64>,
}

impl ChangeFilter {
    pub fn applied(&mut self, node: &Node) -> bool {
        let fp = placement_fingerprint(node);
        self.seen.insert(node.name_any(), fp) != Some(fp)
    }

    pub fn deleted(&mut self, node: &Node) -> bool {
        self.seen.remove(&node.name_any()).is_some()
    }
}

impl NodeCache {
    /// Starts the watch on the current runtime; it runs until the process ends (with backoff on
    /// errors). Every event it receives counts as watch activity for `/healthz`.
    pub fn spawn(client: Client, health: Arc<Health>) -> Self {
        let (writer_store, writer) = reflector::store();
        let (tx, rx) = watch::channel(0u64);
        let api: Api<Node> = Api::all(client);
        let events = watcher(api, watcher::Config::default())
            .default_backoff()
            .reflect(writer);
        tokio::spawn(async move {
            let mut filter = ChangeFilter::default();
            futures::pin_mut!(events);
            while let Some(event) = events.next().await {
                let changed = match event {
                    Ok(watcher::Event::Apply(n)) | Ok(watcher::Event::InitApply(n)) => {
                        health.touch();
                        filter.applied(&n)
                    }
                    Ok(watcher::Event::Delete(n)) => {
                        health.touch();
                        filter.deleted(&n)
                    }
                    Ok(watcher::Event::InitDone) => {
                        health.touch();
                        true
                    }
                    Ok(watcher::Event::Init) => false,
                    Err(e) => {
                        tracing::warn!(error = %e, "node watch");
                        false
                    }
                };
                if changed {
                    tx.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
        });
        Self {
            store: writer_store,
            changes: rx,
        }
    }

    /// The cached nodes once the first full list has arrived; `None` if it has not within
    /// [`READY_WAIT`] (the caller then lists nodes itself).
    pub async fn nodes(&self) -> Option<Vec<Node>> {
        tokio::time::timeout(READY_WAIT, self.store.wait_until_ready())
            .await
            .ok()?
            .ok()?;
        Some(self.store.state().iter().map(|n| (**n).clone()).collect())
    }

    /// A stream that yields once per batch of placement-relevant node changes.
    pub fn triggers(&self) -> impl Stream<Item = ()> + Send + 'static {
        let mut rx = self.changes.clone();
        rx.mark_unchanged();
        futures::stream::unfold(rx, |mut rx| async move {
            rx.changed().await.ok()?;
            Some(((), rx))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(cpu: &str, heartbeat: &str) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "n1", "labels": {"nvidia.com/gpu.memory": "24564"}},
            "status": {"allocatable": {"cpu": cpu},
                       "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}]}
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn reconciles_read_the_store_once_the_first_list_is_complete() {
        let (store, mut writer) = reflector::store::<Node>();
        let (tx, rx) = watch::channel(0u64);
        let cache = NodeCache { store, changes: rx };
        let mut triggers = Box::pin(cache.triggers());
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(node(
            "32",
            "2026-01-01T00:00:00Z",
        )));
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let nodes = cache.nodes().await.expect("store ready");
        assert_eq!(nodes.len(), 1);
        assert_eq!(nodes[0].name_any(), "n1");
        tx.send_modify(|n| *n += 1);
        assert_eq!(triggers.next().await, Some(()));
    }

    #[test]
    fn heartbeats_do_not_count_as_changes_but_placement_inputs_do() {
        let mut f = ChangeFilter::default();
        assert!(f.applied(&node("32", "2026-01-01T00:00:00Z")));
        assert!(!f.applied(&node("32", "2026-01-01T00:01:00Z")));
        assert!(f.applied(&node("30", "2026-01-01T00:02:00Z")));
        let mut cordoned = node("30", "2026-01-01T00:03:00Z");
        cordoned.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
            unschedulable: Some(true),
            ..Default::default()
        });
        assert!(f.applied(&cordoned));
        assert!(f.deleted(&cordoned));
        assert!(!f.deleted(&cordoned));
    }
}
