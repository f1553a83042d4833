//! The kube-rs controller: watches MoEDeployments and the StatefulSets they own, re-reconciles all
//! of them when the Node cache reports a placement-relevant change, reconciles with per-object
//! exponential backoff, and records metrics and liveness.

pub mod builtin_scaler;
pub mod conditions;
pub mod ownership;
pub mod reconcile;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

use crate::autoscaler::AutoscalerState;
use crate::builders::{FIELD_MANAGER, LABEL_MANAGED_BY};
use crate::crd::MoEDeployment;
use crate::metrics::Metrics;
use crate::node_cache::NodeCache;
use crate::pod_cache::PodCache;
use crate::server::Health;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Apply(#[from] reconcile::ApplyError),
    #[error("MoEDeployment has no namespace")]
    MissingNamespace,
}

/// Shared state of all reconciles.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub metrics: Metrics,
    failures: Mutex<HashMap<String, u32>>,
    pub autoscaler_states: Mutex<HashMap<String, AutoscalerState>>,
    /// Cached nodes from the cluster-wide Node watch; `None` (tests) lists nodes per reconcile.
    pub nodes: Option<NodeCache>,
    /// Cached bound pods (for the CPU free on each node); `None` (tests) lists them per reconcile.
    pub pods: Option<PodCache>,
    pub health: Arc<Health>,
}

impl Context {
    pub fn new(client: Client, reporter: Reporter, metrics: Metrics) -> Self {
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            failures: Mutex::default(),
            autoscaler_states: Mutex::default(),
            nodes: None,
            pods: None,
            health: Arc::new(Health::default()),
        }
    }

    /// Reads nodes from `cache` and re-reconciles everything when their placement inputs change.
    pub fn with_node_cache(mut self, cache: NodeCache) -> Self {
        self.nodes = Some(cache);
        self
    }

    /// Reads the pods bound to nodes from `cache`.
    pub fn with_pod_cache(mut self, cache: PodCache) -> Self {
        self.pods = Some(cache);
        self
    }

    pub fn with_health(mut self, health: Arc<Health>) -> Self {
        self.health = health;
        self
    }

    /// Drops everything kept in memory for a deleted object.
    pub fn forget(&self, key: &str) {
        lock(&self.failures).remove(key);
        lock(&self.autoscaler_states).remove(key);
    }

    fn record_failure(&self, key: &str) -> u32 {
        let mut failures = lock(&self.failures);
        let n = failures.entry(key.to_string()).or_default();
        *n = n.saturating_add(1);
        *n
    }

    fn record_success(&self, key: &str) {
        lock(&self.failures).remove(key);
    }
}

/// Locks a mutex, recovering the data if a panicking holder poisoned it.
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn object_key(md: &MoEDeployment) -> String {
    format!("{}/{}", md.namespace().unwrap_or_default(), md.name_any())
}

/// 5 s, 10 s, 20 s, … capped at 5 minutes.
pub fn backoff_delay(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(6);
    Duration::from_secs((5u64 << exp).min(300))
}

async fn reconcile_with_metrics(
    md: Arc<MoEDeployment>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let start = Instant::now();
    let key = object_key(&md);
    let result = reconcile::reconcile(md, ctx.clone()).await;
    ctx.health.touch();
    let label = if result.is_ok() { "ok" } else { "error" };
    ctx.metrics
        .reconciliations
        .with_label_values(&[label])
        .inc();
    ctx.metrics
        .reconcile_duration
        .with_label_values(&[label])
        .observe(start.elapsed().as_secs_f64());
    if result.is_ok() {
        ctx.record_success(&key);
    }
    result
}

fn error_policy(md: Arc<MoEDeployment>, error: &Error, ctx: Arc<Context>) -> Action {
    let failures = ctx.record_failure(&object_key(&md));
    let delay = backoff_delay(failures);
    tracing::warn!(object = %object_key(&md), %error, failures, ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// Runs the controller for one namespace (or all, with `None`) until `shutdown` resolves.
pub async fn run_controller(
    ctx: Arc<Context>,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let (mds, sets, config_maps): (Api<MoEDeployment>, Api<StatefulSet>, Api<ConfigMap>) =
        match &namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client, ns),
            ),
            None => (
                Api::all(client.clone()),
                Api::all(client.clone()),
                Api::all(client),
            ),
        };
    let owned = watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}"));
    // A class's placement-rule ConfigMap deleted or edited by hand is rewritten at once: its pods
    // cannot start without it.
    let mut controller = Controller::new(mds, watcher::Config::default().any_semantic())
        .owns(sets, owned.clone())
        .owns(config_maps, owned);
    if let Some(cache) = &ctx.nodes {
        // A node joining, leaving or changing labels/taints/allocatable can change every placement.
        controller = controller.reconcile_all_on(cache.triggers());
    }
    let health = ctx.health.clone();
    health.controller_running();
    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile_with_metrics, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((obj, _)) => tracing::debug!(object = %obj, "reconciled"),
                Err(e) => tracing::warn!(error = %e, "controller event"),
            }
        })
        .await;
    health.controller_stopped();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff_delay(1), Duration::from_secs(5));
        assert_eq!(backoff_delay(2), Duration::from_secs(10));
        assert_eq!(backoff_delay(4), Duration::from_secs(40));
        assert_eq!(backoff_delay(50), Duration::from_secs(300));
    }
}
