//! One reconcile of a MoEDeployment: validate → read nodes → desired objects (pure) → server-side
//! apply → status. Deletion goes through a finalizer so the builtin autoscaler forgets the object
//! and an event records the teardown; owned objects are garbage-collected through owner references.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::finalizer::{finalizer, Event as FinalizerEvent};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;

use super::conditions::{self, Outcome};
use super::{Context, Error};
use crate::builders::{
    autoscaling::keda_api_resource, owner_reference, DesiredObjects, FIELD_MANAGER,
};
use crate::crd::{AutoscalingProvider, MoEDeployment, MoEDeploymentStatus};
use crate::desired::{compute_desired, DesiredError};

pub const FINALIZER: &str = "moe.inference.dev/cleanup";
/// Re-check placement this often even without events (nodes come and go).
pub const RESYNC: Duration = Duration::from_secs(300);
/// Retry sooner while nothing qualifies or pods are still loading.
pub const SHORT_RESYNC: Duration = Duration::from_secs(60);
const CONFLICT_RETRIES: usize = 3;

pub async fn reconcile(md: Arc<MoEDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = md.namespace().ok_or(Error::MissingNamespace)?;
    let api: Api<MoEDeployment> = Api::namespaced(ctx.client.clone(), &namespace);
    finalizer(&api, FINALIZER, md, |event| async {
        match event {
            FinalizerEvent::Apply(md) => apply(&md, &ctx, &namespace).await,
            FinalizerEvent::Cleanup(md) => cleanup(&md, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
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

async fn delete_if_present<K>(api: &Api<K>, name: &str) -> Result<(), kube::Error>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Which object failed to apply, and why.
#[derive(Debug, thiserror::Error)]
#[error("applying {object}: {message}")]
pub struct ApplyError {
    pub object: String,
    pub message: String,
    #[source]
    pub source: kube::Error,
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
        source,
    }
}

/// Applies every desired object; returns the applied StatefulSet (with its status).
async fn apply_objects(
    ctx: &Context,
    namespace: &str,
    md: &MoEDeployment,
    objects: &DesiredObjects,
) -> Result<StatefulSet, ApplyError> {
    let client = ctx.client.clone();
    let name = md.name_any();
    let headless = objects.headless_service.name_any();
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    apply_object(&services, &headless, &objects.headless_service)
        .await
        .map_err(|e| apply_error(&format!("Service/{headless}"), e))?;
    apply_object(&services, &name, &objects.service)
        .await
        .map_err(|e| apply_error(&format!("Service/{name}"), e))?;
    let sts_api: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
    let sts = apply_object(&sts_api, &name, &objects.statefulset)
        .await
        .map_err(|e| apply_error(&format!("StatefulSet/{name}"), e))?;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), namespace);
    apply_object(&pdbs, &name, &objects.pdb)
        .await
        .map_err(|e| apply_error(&format!("PodDisruptionBudget/{name}"), e))?;

    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), namespace);
    let hpa_result = match &objects.hpa {
        Some(hpa) => apply_object(&hpas, &name, hpa).await.map(drop),
        None => delete_if_present(&hpas, &name).await,
    };
    hpa_result.map_err(|e| apply_error(&format!("HorizontalPodAutoscaler/{name}"), e))?;
    let provider = md.spec.autoscaling.as_ref().map(|a| a.provider);
    let keda: Api<DynamicObject> = Api::namespaced_with(client, namespace, &keda_api_resource());
    let keda_result = match &objects.keda_scaled_object {
        Some(so) => apply_object(&keda, &name, so).await.map(drop),
        // Without KEDA installed the delete answers 404 too, which is fine.
        None if provider != Some(AutoscalingProvider::Keda) => {
            delete_if_present(&keda, &name).await
        }
        None => Ok(()),
    };
    keda_result.map_err(|e| apply_error(&format!("ScaledObject/{name}"), e))?;
    Ok(sts)
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
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let node_list = nodes.list(&ListParams::default()).await?.items;
    let previous = md.status.clone().unwrap_or_default();
    let generation = md.metadata.generation;
    let now = Time(Timestamp::now());
    let mut status = MoEDeploymentStatus {
        observed_generation: generation,
        replicas: previous.replicas,
        ready_replicas: previous.ready_replicas,
        ..Default::default()
    };

    let (outcome, action) = match compute_desired(md, namespace, &node_list, owner_reference(md)) {
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
                        Ok(sts) => {
                            let sts_status = sts.status.unwrap_or_default();
                            status.replicas = sts_status.replicas;
                            status.ready_replicas = sts_status.ready_replicas.unwrap_or(0);
                            let desired_replicas = input.replicas();
                            let settled = status.ready_replicas >= desired_replicas;
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

async fn cleanup(md: &MoEDeployment, ctx: &Context) -> Result<Action, Error> {
    let key = format!("{}/{}", md.namespace().unwrap_or_default(), md.name_any());
    ctx.forget(&key);
    publish(
        ctx,
        md,
        EventType::Normal,
        "Deleting",
        "owned objects are removed by garbage collection".into(),
    )
    .await;
    Ok(Action::await_change())
}
