//! The operator's HTTP endpoints: `/metrics` (Prometheus), `/healthz` (the controllers are running
//! and their watches deliver events) and `/readyz` (ready once the API server has answered; standbys
//! are ready too, so rollouts do not stall).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;

/// Longest quiet spell `/healthz` accepts from the watches and reconciles once controllers run.
/// Every MoEDeployment resyncs at least every 5 minutes and the kubelet reports node status every
/// 5 minutes, so 15 minutes without any event means the watch or the controller is stuck.
pub const MAX_QUIET: Duration = Duration::from_secs(15 * 60);

/// Liveness of the controller side, shared by the Node watch, the controllers and `/healthz`.
#[derive(Debug, Default)]
pub struct Health {
    /// Unix milliseconds of the last watch event or finished reconcile (0: none yet).
    last_activity_ms: AtomicU64,
    /// Controllers started (0 while a standby waits for the lease: it is healthy).
    controllers_expected: AtomicUsize,
    controllers_running: AtomicUsize,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Health {
    pub fn touch(&self) {
        self.last_activity_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub fn controllers_starting(&self, n: usize) {
        self.controllers_expected.store(n, Ordering::Relaxed);
        self.touch();
    }

    pub fn controller_running(&self) {
        self.controllers_running.fetch_add(1, Ordering::Relaxed);
    }

    pub fn controller_stopped(&self) {
        self.controllers_running.fetch_sub(1, Ordering::Relaxed);
    }

    /// `Err(reason)` when a controller stream ended or nothing happened for [`MAX_QUIET`].
    pub fn check_at(&self, now_ms: u64) -> Result<(), String> {
        let expected = self.controllers_expected.load(Ordering::Relaxed);
        if expected == 0 {
            return Ok(());
        }
        let running = self.controllers_running.load(Ordering::Relaxed);
        if running < expected {
            return Err(format!("{running} of {expected} controllers running"));
        }
        let last = self.last_activity_ms.load(Ordering::Relaxed);
        let quiet = Duration::from_millis(now_ms.saturating_sub(last));
        if quiet > MAX_QUIET {
            return Err(format!(
                "no watch event or reconcile for {} s",
                quiet.as_secs()
            ));
        }
        Ok(())
    }
}

#[derive(Clone)]
pub struct ServerState {
    pub metrics: Metrics,
    pub ready: Arc<AtomicBool>,
    pub health: Arc<Health>,
}

async fn healthz(State(state): State<ServerState>) -> impl IntoResponse {
    match state.health.check_at(now_ms()) {
        Ok(()) => (StatusCode::OK, "ok".to_string()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
    }
}

async fn metrics(State(state): State<ServerState>) -> impl IntoResponse {
    match state.metrics.render() {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn readyz(State(state): State<ServerState>) -> impl IntoResponse {
    if state.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting")
    }
}

pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get_path(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_health_readiness_and_metrics() {
        let state = ServerState {
            metrics: Metrics::new().unwrap(),
            ready: Arc::new(AtomicBool::new(false)),
            health: Arc::new(Health::default()),
        };
        state.metrics.is_leader.set(1);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(state.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        assert!(get_path(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get_path(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        state.ready.store(true, Ordering::Relaxed);
        assert!(get_path(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        assert!(get_path(addr, "/metrics")
            .await
            .contains("moe_operator_is_leader 1"));
        // A controller that should run but does not makes /healthz fail.
        state.health.controllers_starting(1);
        assert!(get_path(addr, "/healthz").await.starts_with("HTTP/1.1 503"));
        state.health.controller_running();
        assert!(get_path(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
    }

    #[test]
    fn health_fails_when_a_controller_stops_or_everything_goes_quiet() {
        let h = Health::default();
        assert!(h.check_at(u64::MAX).is_ok(), "a standby is healthy");
        h.controllers_starting(2);
        h.controller_running();
        h.controller_running();
        let t = now_ms();
        assert!(h.check_at(t).is_ok());
        let late = t + MAX_QUIET.as_millis() as u64 + 1000;
        assert!(h.check_at(late).unwrap_err().contains("no watch event"));
        h.touch();
        assert!(h.check_at(now_ms()).is_ok());
        h.controller_stopped();
        assert_eq!(
            h.check_at(now_ms()).unwrap_err(),
            "1 of 2 controllers running"
        );
    }
}
