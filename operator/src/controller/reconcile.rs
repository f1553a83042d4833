//! One reconcile of a MoEDeployment: validate → read nodes (from the Node cache) → desired objects (pure) → server-side
//! apply → status. Only objects whose controller owner reference is this MoEDeployment are changed
//! or deleted; a same-named object someone else made is reported, never adopted. There is no
//! finalizer (nothing outside the cluster needs cleaning up): owned objects are garbage-collected
//! through owner references, and a finalizer left by older versions is removed.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions,
    PropagationPolicy,
};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;

use super::conditions::{self, Outcome};
use super::ownership::{controlled_by, immutable_change};
use super::{Context, Error};
use crate::builders::{
    autoscaling::keda_api_resource, owner_reference, DesiredObjects, DAEMON_APP_NAME,
    FIELD_MANAGER, LABEL_DEPLOYMENT, LABEL_INSTANCE, LABEL_NAME,
};
use crate::crd::{MoEDeployment, MoEDeploymentStatus};
use crate::desired::{compute_desired, DesiredError};
use crate::pod_cache::{bound_pods, CpuRequests};

/// Finalizer that older versions added; removed on sight so deletion never waits on the operator.
pub const LEGACY_FINALIZER: &str = "moe.inference.dev/cleanup";
/// Re-check placement this often even without events (nodes come and go).
pub const RESYNC: Duration = Duration::from_secs(300);
/// Retry sooner while nothing qualifies or pods are still loading.
pub const SHORT_RESYNC: Duration = Duration::from_secs(60);
const CONFLICT_RETRIES: usize = 3;

pub async fn reconcile(md: Arc<MoEDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = md.namespace().ok_or(Error::MissingNamespace)?;
    let api: Api<MoEDeployment> = Api::namespaced(ctx.client.clone(), &namespace);
    remove_legacy_finalizer(&api, &md).await?;
    if md.metadata.deletion_timestamp.is_some() {
        ctx.forget(&format!("{namespace}/{}", md.name_any()));
        return Ok(Action::await_change());
    }
    apply(&md, &ctx, &namespace).await
}

/// JSON patch removing [`LEGACY_FINALIZER`], guarded by a `test` so a concurrent change of the
/// list makes it fail (and retry) instead of removing someone else's finalizer.
async fn remove_legacy_finalizer(
    api: &Api<MoEDeployment>,
    md: &MoEDeployment,
) -> Result<(), Error> {
    let Some(index) = md.finalizers().iter().position(|f| f == LEGACY_FINALIZER) else {
        return Ok(());
    };
    let path = format!("/metadata/finalizers/{index}");
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": path, "value": LEGACY_FINALIZER},
        {"op": "remove", "path": path},
    ]))
    .map_err(|e| Error::Kube(kube::Error::SerdeError(e)))?;
    match api
        .patch(
            &md.name_any(),
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(Error::Kube(e)),
    }
}

fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 409)
}

fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 404)
}

/// Server-side apply, retried a few times on 409 Conflict (e.g. an object being replaced).
async fn apply_object<K>(api: &Api<K>, name: &str, obj: &K) -> Result<K, kube::Error>
where
    K: Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut attempt = 0;
    loop {
        match api.patch(name, &params, &Patch::Apply(obj)).await {
            Err(e) if is_conflict(&e) && attempt < CONFLICT_RETRIES => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(50 * attempt as u64)).await;
            }
            other => return other,
        }
    }
}

/// Which object failed to apply, and why.
#[derive(Debug, thiserror::Error)]
#[error("applying {object}: {message}")]
pub struct ApplyError {
    pub object: String,
    pub message: String,
    #[source]
    pub source: Option<kube::Error>,
}

fn apply_error(object: &str, source: kube::Error) -> ApplyError {
    let message = if object.starts_with("ScaledObject") && is_not_found(&source) {
        "KEDA is not installed (no keda.sh/v1alpha1 ScaledObject API); install KEDA or pick provider builtin|hpa".to_string()
    } else {
        source.to_string()
    };
    ApplyError {
        object: object.to_string(),
        message,
        source: Some(source),
    }
}

/// The stored object of this name when `md` controls it; `None` when there is none. An object
/// someone else made is an error: force-applying would take it over, and garbage collection would
/// then delete it together with the MoEDeployment.
async fn existing_owned<K>(
    api: &Api<K>,
    name: &str,
    md: &MoEDeployment,
    what: &str,
) -> Result<Option<K>, ApplyError>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    match api.get_opt(name).await {
        Err(e) => Err(apply_error(what, e)),
        Ok(None) => Ok(None),
        Ok(Some(obj)) if controlled_by(obj.meta(), md) => Ok(Some(obj)),
        Ok(Some(_)) => Err(ApplyError {
            object: what.to_string(),
            message: format!(
                "{what} already exists and is not controlled by this MoEDeployment; it is left alone: rename or delete it"
            ),
            source: None,
        }),
    }
}

/// Applies `obj` unless a same-named object that `md` does not control is in the way.
async fn apply_owned<K>(
    api: &Api<K>,
    name: &str,
    obj: &K,
    md: &MoEDeployment,
    what: &str,
) -> Result<K, ApplyError>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    existing_owned(api, name, md, what).await?;
    apply_object(api, name, obj)
        .await
        .map_err(|e| apply_error(what, e))
}

/// Deletes the object only when `md` controls it (uid precondition against a replaced object).
async fn delete_if_owned<K>(
    api: &Api<K>,
    name: &str,
    md: &MoEDeployment,
    what: &str,
) -> Result<(), ApplyError>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let Some(obj) = api.get_opt(name).await.map_err(|e| apply_error(what, e))? else {
        return Ok(());
    };
    if !controlled_by(obj.meta(), md) {
        return Ok(());
    }
    let params = DeleteParams {
        preconditions: obj.meta().uid.clone().map(|uid| Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(apply_error(what, e)),
    }
}

/// Applies the StatefulSet; when an immutable field changed (e.g. model.cache added), first deletes
/// the stored one with orphan propagation so its pods and claims stay and the new one adopts them.
async fn apply_statefulset(
    ctx: &Context,
    api: &Api<StatefulSet>,
    md: &MoEDeployment,
    desired: &StatefulSet,
) -> Result<StatefulSet, ApplyError> {
    let name = desired.name_any();
    let what = format!("StatefulSet/{name}");
    if let Some(existing) = existing_owned(api, &name, md, &what).await? {
        if let Some(field) = immutable_change(&existing, desired) {
            let params = DeleteParams {
                propagation_policy: Some(PropagationPolicy::Orphan),
                preconditions: existing.metadata.uid.clone().map(|uid| Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&name, &params).await {
                Ok(_) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(apply_error(&what, e)),
            }
            publish(
                ctx,
                md,
                EventType::Normal,
                "RecreatingStatefulSet",
                format!("StatefulSet field {field} cannot be updated in place; recreated it, keeping its pods"),
            )
            .await;
        }
    }
    apply_object(api, &name, desired)
        .await
        .map_err(|e| apply_error(&what, e))
}

/// Deletes the objects of one kind this MoEDeployment controls that are no longer desired: e.g. the
/// StatefulSet and placement-rule ConfigMap of a hardware class that left the cluster, or the single
/// `<name>` StatefulSet of older versions.
async fn delete_stale<K>(api: &Api<K>, md: &MoEDeployment, desired: &[K]) -> Result<(), ApplyError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let kind = K::kind(&());
    let selector = format!("{LABEL_DEPLOYMENT}={}", md.name_any());
    let listed = api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|e| apply_error(&format!("{kind} list"), e))?;
    let keep: Vec<String> = desired.iter().map(|s| s.name_any()).collect();
    for obj in listed.items {
        let name = obj.name_any();
        if !keep.contains(&name) && controlled_by(obj.meta(), md) {
            delete_if_owned(api, &name, md, &format!("{kind}/{name}")).await?;
        }
    }
    Ok(())
}

/// Applies every desired object; returns the applied StatefulSets (with their status).
async fn apply_objects(
    ctx: &Context,
    namespace: &str,
    md: &MoEDeployment,
    objects: &DesiredObjects,
) -> Result<Vec<StatefulSet>, ApplyError> {
    let client = ctx.client.clone();
    let name = md.name_any();
    let headless = objects.headless_service.name_any();
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    apply_owned(
        &services,
        &headless,
        &objects.headless_service,
        md,
        &format!("Service/{headless}"),
    )
    .await?;
    // Scale from zero: backend Service and activator first, then the Service that points at them;
    // when it is turned off, the Service points back at the pods before the activator goes.
    let backend = format!("{name}-backend");
    let activator = format!("{name}-activator");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    if let Some(svc) = &objects.backend_service {
        apply_owned(&services, &backend, svc, md, &format!("Service/{backend}")).await?;
    }
    if let Some(deployment) = &objects.activator {
        apply_owned(
            &deployments,
            &activator,
            deployment,
            md,
            &format!("Deployment/{activator}"),
        )
        .await?;
    }
    apply_owned(
        &services,
        &name,
        &objects.service,
        md,
        &format!("Service/{name}"),
    )
    .await?;
    if objects.activator.is_none() {
        delete_if_owned(
            &deployments,
            &activator,
            md,
            &format!("Deployment/{activator}"),
        )
        .await?;
    }
    if objects.backend_service.is_none() {
        delete_if_owned(&services, &backend, md, &format!("Service/{backend}")).await?;
    }
    // Each class's placement rules before the StatefulSet whose pods mount them.
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    for cm in &objects.class_rules {
        let cm_name = cm.name_any();
        apply_owned(
            &config_maps,
            &cm_name,
            cm,
            md,
            &format!("ConfigMap/{cm_name}"),
        )
        .await?;
    }
    let sts_api: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
    let mut applied = Vec::with_capacity(objects.statefulsets.len());
    for desired in &objects.statefulsets {
        applied.push(apply_statefulset(ctx, &sts_api, md, desired).await?);
    }
    delete_stale(&sts_api, md, &objects.statefulsets).await?;
    delete_stale(&config_maps, md, &objects.class_rules).await?;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), namespace);
    apply_owned(
        &pdbs,
        &name,
        &objects.pdb,
        md,
        &format!("PodDisruptionBudget/{name}"),
    )
    .await?;

    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), namespace);
    let what = format!("HorizontalPodAutoscaler/{name}");
    match &objects.hpa {
        Some(hpa) => drop(apply_owned(&hpas, &name, hpa, md, &what).await?),
        None => delete_if_owned(&hpas, &name, md, &what).await?,
    }
    let keda: Api<DynamicObject> = Api::namespaced_with(client, namespace, &keda_api_resource());
    let what = format!("ScaledObject/{name}");
    match &objects.keda_scaled_object {
        Some(so) => drop(apply_owned(&keda, &name, so, md, &what).await?),
        // Without KEDA installed the lookup answers 404, which is fine.
        None => delete_if_owned(&keda, &name, md, &what).await?,
    }
    Ok(applied)
}

/// The scheduler's verdict on replicas it cannot place: pods whose `PodScheduled` condition is
/// False (the same message as their `FailedScheduling` event), e.g. "qwen-sm89-24g-0: 0/3 nodes
/// are available: 1 Insufficient cpu, 2 node(s) didn't match Pod's node affinity/selector."
pub fn pending_message(pods: &[Pod]) -> Option<String> {
    let mut lines: Vec<String> = pods
        .iter()
        .filter_map(|pod| {
            let cond = pod
                .status
                .as_ref()?
                .conditions
                .as_ref()?
                .iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
            let why = cond
                .message
                .clone()
                .or_else(|| cond.reason.clone())
                .unwrap_or_else(|| "not scheduled".into());
            Some(format!("{}: {why}", pod.name_any()))
        })
        .collect();
    lines.sort();
    (!lines.is_empty()).then(|| lines.join("; "))
}

/// Unschedulable replicas of this deployment, read from its pods (one label-selected list).
async fn pending_replicas(ctx: &Context, namespace: &str, selector: &str) -> Option<String> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    match pods.list(&ListParams::default().labels(selector)).await {
        Ok(list) => pending_message(&list.items),
        Err(e) => {
            tracing::warn!(error = %e, "listing pods for scheduling status");
            None
        }
    }
}

/// CPU requested on each node by pods other than this deployment's own replicas (whose CPUs are
/// what is being sized). `None` when the pods cannot be read: sizing then falls back to a reserve.
async fn cpu_requested_by_others(
    ctx: &Context,
    md: &MoEDeployment,
    namespace: &str,
) -> Option<CpuRequests> {
    let pods = match bound_pods(&ctx.client, ctx.pods.as_ref()).await {
        Ok(pods) => pods,
        Err(e) => {
            tracing::warn!(error = %e, "listing pods for free CPUs; sizing with a fixed reserve");
            return None;
        }
    };
    let name = md.name_any();
    let own = |p: &Pod| {
        let labels = p.labels();
        p.namespace().as_deref() == Some(namespace)
            && labels.get(LABEL_INSTANCE) == Some(&name)
            && labels.get(LABEL_NAME).map(String::as_str) == Some(DAEMON_APP_NAME)
    };
    Some(CpuRequests::from_pods(&pods, own))
}

async fn publish(ctx: &Context, md: &MoEDeployment, type_: EventType, reason: &str, note: String) {
    let event = KubeEvent {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &md.object_ref(&())).await {
        tracing::warn!(error = %e, "failed to publish event");
    }
}

async fn patch_status(
    ctx: &Context,
    namespace: &str,
    md: &MoEDeployment,
    status: MoEDeploymentStatus,
) -> Result<(), Error> {
    let api: Api<MoEDeployment> = Api::namespaced(ctx.client.clone(), namespace);
    let patch = json!({
        "apiVersion": MoEDeployment::api_version(&()),
        "kind": MoEDeployment::kind(&()),
        "status": status,
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut attempt = 0;
    loop {
        match api
            .patch_status(&md.name_any(), &params, &Patch::Apply(&patch))
            .await
        {
            Err(e) if is_conflict(&e) && attempt < CONFLICT_RETRIES => attempt += 1,
            Err(e) => return Err(Error::Kube(e)),
            Ok(_) => return Ok(()),
        }
    }
}

async fn apply(md: &MoEDeployment, ctx: &Context, namespace: &str) -> Result<Action, Error> {
    let cached = match &ctx.nodes {
        Some(cache) => cache.nodes().await,
        None => None,
    };
    let node_list = match cached {
        Some(nodes) => nodes,
        None => {
            let nodes: Api<Node> = Api::all(ctx.client.clone());
            nodes.list(&ListParams::default()).await?.items
        }
    };
    let cpu_in_use = cpu_requested_by_others(ctx, md, namespace).await;
    let previous = md.status.clone().unwrap_or_default();
    let generation = md.metadata.generation;
    let now = Time(Timestamp::now());
    let mut status = MoEDeploymentStatus {
        observed_generation: generation,
        replicas: previous.replicas,
        ready_replicas: previous.ready_replicas,
        ..Default::default()
    };

    let (outcome, action) = match compute_desired(
        md,
        namespace,
        &node_list,
        cpu_in_use.as_ref(),
        owner_reference(md),
    ) {
        Err(DesiredError::InvalidSpec(errors)) => {
            let msg = errors.join("; ");
            publish(ctx, md, EventType::Warning, "InvalidSpec", msg.clone()).await;
            (Outcome::InvalidSpec(msg), Action::await_change())
        }
        Err(DesiredError::Build(e)) => {
            let msg = e.to_string();
            publish(ctx, md, EventType::Warning, "InvalidSpec", msg.clone()).await;
            (Outcome::InvalidSpec(msg), Action::await_change())
        }
        Ok(desired) => {
            status.placement = desired.resolved_placement();
            status.classes = desired.class_statuses();
            status.rejected_classes = desired.rejected_classes();
            let summary = desired.decision.summary();
            match (&desired.objects, &desired.build_input) {
                (Some(objects), Some(input)) => {
                    status.nodes = desired.decision.qualified_names();
                    status.endpoint = Some(input.endpoint());
                    status.selector = Some(
                        input
                            .selector_labels()
                            .iter()
                            .map(|(k, v)| format!("{k}={v}"))
                            .collect::<Vec<_>>()
                            .join(","),
                    );
                    match apply_objects(ctx, namespace, md, objects).await {
                        Ok(statefulsets) => {
                            let sts_status: Vec<_> = statefulsets
                                .into_iter()
                                .map(|s| s.status.unwrap_or_default())
                                .collect();
                            status.replicas = sts_status.iter().map(|s| s.replicas).sum();
                            status.ready_replicas = sts_status
                                .iter()
                                .map(|s| s.ready_replicas.unwrap_or(0))
                                .sum();
                            let desired_replicas = input.replicas();
                            let settled = status.ready_replicas >= desired_replicas;
                            let pending = if settled {
                                None
                            } else {
                                let selector = status.selector.clone().unwrap_or_default();
                                pending_replicas(ctx, namespace, &selector).await
                            };
                            if let Some(msg) = &pending {
                                if conditions::find(&previous.conditions, conditions::SCHEDULED)
                                    .is_none_or(|c| c.reason != "FailedScheduling")
                                {
                                    publish(
                                        ctx,
                                        md,
                                        EventType::Warning,
                                        "FailedScheduling",
                                        msg.clone(),
                                    )
                                    .await;
                                }
                            }
                            if conditions::find(&previous.conditions, conditions::SCHEDULED)
                                .is_none_or(|c| c.status != "True")
                            {
                                publish(ctx, md, EventType::Normal, "Scheduled", summary.clone())
                                    .await;
                            }
                            (
                                Outcome::Applied {
                                    placement_summary: summary,
                                    desired: desired_replicas,
                                    ready: status.ready_replicas,
                                    pending,
                                },
                                Action::requeue(if settled { RESYNC } else { SHORT_RESYNC }),
                            )
                        }
                        Err(e) => {
                            // Record the failure in status, then let the error policy back off.
                            let outcome = Outcome::ApplyFailed(e.to_string());
                            status.conditions = conditions::conditions(
                                &previous.conditions,
                                generation,
                                &outcome,
                                now,
                            );
                            patch_status(ctx, namespace, md, status).await?;
                            publish(ctx, md, EventType::Warning, "ApplyFailed", e.to_string())
                                .await;
                            return Err(Error::Apply(e));
                        }
                    }
                }
                _ => {
                    publish(
                        ctx,
                        md,
                        EventType::Warning,
                        "NoQualifyingNodes",
                        summary.clone(),
                    )
                    .await;
                    (
                        Outcome::NoQualifyingNodes(summary),
                        Action::requeue(SHORT_RESYNC),
                    )
                }
            }
        }
    };
    status.conditions = conditions::conditions(&previous.conditions, generation, &outcome, now);
    patch_status(ctx, namespace, md, status).await?;
    Ok(action)
}
