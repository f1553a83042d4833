//! The builtin autoscaler loop: every period, scrape each replica's `/metrics` for queue depth,
//! feed the pure decision in `crate::autoscaler`, and write the result to the MoEDeployment's
//! scale subresource (the controller then resizes the StatefulSet).

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{lock, Context};
use crate::autoscaler::{sum_metric, AutoscalerPolicy, QueueSample};
use crate::builders::activation::ACTIVATOR_APP;
use crate::builders::{HTTP_PORT, LABEL_INSTANCE, LABEL_NAME};
use crate::crd::{AutoscalingProvider, MoEDeployment};

pub const SCRAPE_PERIOD: Duration = Duration::from_secs(15);
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(3);
const MAX_METRICS_BYTES: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("connect/read: {0}")]
    Io(#[from] std::io::Error),
    #[error("timed out")]
    Timeout,
    #[error("unexpected HTTP status line {0:?}")]
    Status(String),
}

/// Plain HTTP/1.0 GET of `http://{ip}:{port}/metrics`; the daemon closes the connection after.
pub async fn fetch_metrics(ip: &str, port: u16) -> Result<String, ScrapeError> {
    let work = async {
        let mut stream = TcpStream::connect((ip, port)).await?;
        let request = format!("GET /metrics HTTP/1.0\r\nHost: {ip}\r\nAccept: text/plain\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut body = Vec::new();
        stream
            .take(MAX_METRICS_BYTES)
            .read_to_end(&mut body)
            .await?;
        Ok::<_, ScrapeError>(String::from_utf8_lossy(&body).into_owned())
    };
    let response = tokio::time::timeout(SCRAPE_TIMEOUT, work)
        .await
        .map_err(|_| ScrapeError::Timeout)??;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.lines().next().unwrap_or("");
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(ScrapeError::Status(status.to_string()));
    }
    Ok(body.to_string())
}

async fn scrape_queue(
    ctx: &Context,
    md: &MoEDeployment,
    namespace: &str,
    port: u16,
) -> Option<(f64, f64)> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    // The replicas and, with scale to zero, the activator that holds requests while there are none.
    let selector = format!(
        "{LABEL_NAME} in (moe-daemon,{ACTIVATOR_APP}),{LABEL_INSTANCE}={}",
        md.name_any()
    );
    let list = match pods.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => list,
        Err(e) => {
            tracing::warn!(error = %e, "autoscaler: listing pods failed");
            return None;
        }
    };
    let (mut waiting, mut running, mut scraped) = (0.0, 0.0, 0);
    for pod in list.items {
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
            continue;
        };
        match fetch_metrics(&ip, port).await {
            Ok(text) => {
                waiting += sum_metric(&text, "moe:num_requests_waiting").unwrap_or(0.0);
                running += sum_metric(&text, "moe:num_requests_running").unwrap_or(0.0);
                scraped += 1;
            }
            Err(e) => {
                tracing::debug!(pod = %pod.name_any(), error = %e, "autoscaler: scrape failed")
            }
        }
    }
    // No replica answered: no evidence either way, so no sample.
    (scraped > 0).then_some((waiting, running))
}

/// One autoscaling round for one MoEDeployment: scrape its pods on `port`, decide, write the
/// scale subresource when the replica count changes.
pub async fn scale_one(ctx: &Context, md: &MoEDeployment, clock: Instant, port: u16) {
    let Some(autoscaling) = md.spec.autoscaling.as_ref() else {
        return;
    };
    let Some(namespace) = md.namespace() else {
        return;
    };
    let key = format!("{namespace}/{}", md.name_any());
    let policy = AutoscalerPolicy::from_spec(autoscaling);
    let current = md.spec.replicas.unwrap_or(autoscaling.min_replicas);
    let now = clock.elapsed().as_secs_f64();
    if let Some((waiting, running)) = scrape_queue(ctx, md, &namespace, port).await {
        let mut states = lock(&ctx.autoscaler_states);
        states.entry(key.clone()).or_default().observe(QueueSample {
            at_secs: now,
            waiting,
            running,
        });
    }
    let decision = lock(&ctx.autoscaler_states)
        .entry(key)
        .or_default()
        .decide(now, current, &policy);
    let Some(replicas) = decision else {
        return;
    };
    let api: Api<MoEDeployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let patch = Patch::Merge(json!({"spec": {"replicas": replicas}}));
    match api
        .patch_scale(&md.name_any(), &PatchParams::default(), &patch)
        .await
    {
        Ok(_) => {
            let direction = if replicas > current { "up" } else { "down" };
            ctx.metrics
                .scale_events
                .with_label_values(&[direction])
                .inc();
            let event = KubeEvent {
                type_: EventType::Normal,
                reason: if replicas > current {
                    "ScaledUp".into()
                } else {
                    "ScaledDown".into()
                },
                note: Some(format!(
                    "queue depth autoscaler: {current} -> {replicas} replicas"
                )),
                action: "Autoscale".into(),
                secondary: None,
            };
            if let Err(e) = ctx.recorder.publish(&event, &md.object_ref(&())).await {
                tracing::warn!(error = %e, "failed to publish event");
            }
        }
        Err(e) => tracing::warn!(error = %e, "autoscaler: scale patch failed"),
    }
}

/// Runs until `shutdown` resolves; `namespaces` empty means all namespaces.
pub async fn run(
    ctx: Arc<Context>,
    namespaces: Vec<String>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let clock = Instant::now();
    let mut ticker = tokio::time::interval(SCRAPE_PERIOD);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        let apis: Vec<Api<MoEDeployment>> = if namespaces.is_empty() {
            vec![Api::all(ctx.client.clone())]
        } else {
            namespaces
                .iter()
                .map(|ns| Api::namespaced(ctx.client.clone(), ns))
                .collect()
        };
        let mut seen = std::collections::HashSet::new();
        let mut complete = true;
        for api in apis {
            let list = match api.list(&ListParams::default()).await {
                Ok(list) => list,
                Err(e) => {
                    tracing::warn!(error = %e, "autoscaler: listing MoEDeployments failed");
                    complete = false;
                    continue;
                }
            };
            for md in list.items.iter().filter(|md| {
                md.meta().deletion_timestamp.is_none()
                    && md
                        .spec
                        .autoscaling
                        .as_ref()
                        .is_some_and(|a| a.provider == AutoscalingProvider::Builtin)
            }) {
                seen.insert(format!(
                    "{}/{}",
                    md.namespace().unwrap_or_default(),
                    md.name_any()
                ));
                scale_one(&ctx, md, clock, HTTP_PORT as u16).await;
            }
        }
        // Forget deleted (or no longer builtin-scaled) deployments; the controller has no
        // finalizer that would tell it.
        if complete {
            lock(&ctx.autoscaler_states).retain(|key, _| seen.contains(key));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    async fn serve_once(response: &'static str) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = sock.read(&mut buf).await;
            sock.write_all(response.as_bytes()).await.unwrap();
        });
        port
    }

    #[tokio::test]
    async fn scrapes_metrics_over_http() {
        let port = serve_once(
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nmoe:num_requests_waiting 7\n",
        )
        .await;
        let body = fetch_metrics("127.0.0.1", port).await.unwrap();
        assert_eq!(sum_metric(&body, "moe:num_requests_waiting"), Some(7.0));
    }

    #[tokio::test]
    async fn non_200_is_an_error() {
        let port = serve_once("HTTP/1.0 503 Service Unavailable\r\n\r\nloading").await;
        assert!(matches!(
            fetch_metrics("127.0.0.1", port).await,
            Err(ScrapeError::Status(_))
        ));
    }
}
