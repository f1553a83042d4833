//! The scale-from-zero activator (`moe-operator activator`): a small always-on HTTP proxy that sits
//! behind a MoEDeployment's Service when `autoscaling.scaleToZero` is set, as KubeAI's proxy does.
//!
//! A request that arrives while no replica is ready is held (its body buffered, up to a limit) and
//! counted in `moe:num_requests_waiting` on the activator's own `/metrics`, the series the builtin
//! autoscaler and the KEDA trigger read; that count is what wakes the deployment from zero. Once
//! the upstream answers `GET /ready` with 200 the request is forwarded and the response streamed
//! back unchanged (SSE included). With replicas running, requests pass straight through.
//!
//! Cost: one buffered copy of each request body; responses are not buffered.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;

/// Path of the activator's own liveness/readiness probe (the daemon's `/health` and `/ready` are
/// proxied, so they keep meaning "a replica is up").
pub const HEALTH_PATH: &str = "/activator/healthz";

#[derive(Clone, Debug)]
pub struct ActivatorConfig {
    /// Base URL of the replicas' Service, e.g. `http://qwen-backend.ai.svc:8000`.
    pub upstream: Uri,
    /// How long a request may wait for a ready replica before it gets 503.
    pub wait_timeout: Duration,
    /// Requests held at once; more get 503 at once instead of piling up memory.
    pub max_waiting: usize,
    /// Largest request body buffered (chat requests are JSON; images may make them large).
    pub max_body_bytes: usize,
    /// Period of the upstream `GET /ready` probe.
    pub probe_period: Duration,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

#[derive(Clone)]
struct Shared {
    cfg: Arc<ActivatorConfig>,
    client: HttpClient,
    ready: watch::Receiver<bool>,
    waiting: Arc<AtomicUsize>,
}

/// Counts one held request for as long as it lives (a client that disconnects drops it too).
struct Held(Arc<AtomicUsize>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn openai_error(status: StatusCode, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": "service_unavailable", "code": status.as_u16()}});
    let mut resp = (status, body.to_string()).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn upstream_uri(base: &Uri, path_and_query: &str) -> Result<Uri, axum::http::Error> {
    let scheme = base.scheme_str().unwrap_or("http");
    let authority = base.authority().map(|a| a.as_str()).unwrap_or("");
    let prefix = base.path().trim_end_matches('/');
    Uri::builder()
        .scheme(scheme)
        .authority(authority)
        .path_and_query(format!("{prefix}{path_and_query}"))
        .build()
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) are not forwarded.
fn forwardable(headers: &HeaderMap) -> HeaderMap {
    const HOP: [&str; 8] = [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    let mut out = HeaderMap::new();
    for (k, v) in headers {
        if k != header::HOST && !HOP.contains(&k.as_str()) {
            out.append(k.clone(), v.clone());
        }
    }
    out
}

/// Waits until the upstream is ready or `deadline` passes; false on timeout.
async fn wait_ready(ready: &watch::Receiver<bool>, deadline: Instant) -> bool {
    let mut rx = ready.clone();
    let ready_in_time = matches!(
        tokio::time::timeout_at(deadline, rx.wait_for(|r| *r)).await,
        Ok(Ok(_))
    );
    ready_in_time
}

async fn proxy(State(s): State<Shared>, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, s.cfg.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return openai_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "request body larger than {} bytes or unreadable",
                    s.cfg.max_body_bytes
                ),
            )
        }
    };
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let Ok(uri) = upstream_uri(&s.cfg.upstream, &path) else {
        return openai_error(StatusCode::BAD_REQUEST, format!("bad path {path:?}"));
    };
    let headers = forwardable(&parts.headers);
    let deadline = Instant::now() + s.cfg.wait_timeout;
    loop {
        if !*s.ready.borrow() {
            if s.waiting.fetch_add(1, Ordering::Relaxed) >= s.cfg.max_waiting {
                s.waiting.fetch_sub(1, Ordering::Relaxed);
                return openai_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "{} requests already wait for a replica to start",
                        s.cfg.max_waiting
                    ),
                );
            }
            let _held = Held(s.waiting.clone());
            if !wait_ready(&s.ready, deadline).await {
                return openai_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "no replica became ready within {} s",
                        s.cfg.wait_timeout.as_secs()
                    ),
                );
            }
        }
        let mut upstream_req = axum::http::Request::new(Full::new(bytes.clone()));
        *upstream_req.method_mut() = parts.method.clone();
        *upstream_req.uri_mut() = uri.clone();
        *upstream_req.headers_mut() = headers.clone();
        match s.client.request(upstream_req).await {
            Ok(resp) => {
                let (mut head, incoming) = resp.into_parts();
                head.headers = forwardable(&head.headers);
                return Response::from_parts(head, Body::new(incoming));
            }
            // The replica went away between the probe and the request: wait for the next one.
            Err(e) if e.is_connect() && Instant::now() < deadline => {
                tokio::time::sleep(s.cfg.probe_period).await;
            }
            Err(e) => {
                return openai_error(StatusCode::BAD_GATEWAY, format!("upstream: {e}"));
            }
        }
    }
}

async fn metrics(State(s): State<Shared>) -> Response {
    let waiting = s.waiting.load(Ordering::Relaxed);
    let ready = u8::from(*s.ready.borrow());
    let text = format!(
        "# HELP moe:num_requests_waiting Requests held by the activator until a replica is ready.\n\
         # TYPE moe:num_requests_waiting gauge\n\
         moe:num_requests_waiting{{component=\"activator\"}} {waiting}\n\
         # HELP moe:activator_upstream_ready 1 when a replica answered GET /ready at the last probe.\n\
         # TYPE moe:activator_upstream_ready gauge\n\
         moe:activator_upstream_ready {ready}\n"
    );
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

/// Probes `GET {upstream}/ready` every period and publishes the answer.
async fn probe_loop(cfg: Arc<ActivatorConfig>, client: HttpClient, ready: watch::Sender<bool>) {
    let Ok(uri) = upstream_uri(&cfg.upstream, "/ready") else {
        return;
    };
    loop {
        let mut req = axum::http::Request::new(Full::new(Bytes::new()));
        *req.uri_mut() = uri.clone();
        let ok = matches!(
            tokio::time::timeout(Duration::from_secs(2), client.request(req)).await,
            Ok(Ok(resp)) if resp.status() == StatusCode::OK
        );
        ready.send_if_modified(|r| std::mem::replace(r, ok) != ok);
        if ready.is_closed() {
            return;
        }
        tokio::time::sleep(cfg.probe_period).await;
    }
}

/// The activator's router plus its background probe (stops when the router is dropped).
pub fn activator(cfg: ActivatorConfig) -> Router {
    let cfg = Arc::new(cfg);
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let (tx, rx) = watch::channel(false);
    tokio::spawn(probe_loop(cfg.clone(), client.clone(), tx));
    let shared = Shared {
        cfg,
        client,
        ready: rx,
        waiting: Arc::new(AtomicUsize::new(0)),
    };
    Router::new()
        .route("/metrics", get(metrics))
        .route(HEALTH_PATH, get(|| async { "ok" }))
        .fallback(proxy)
        .with_state(shared)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_paths_keep_query_and_prefix() {
        let base: Uri = "http://svc.ns.svc:8000".parse().unwrap();
        assert_eq!(
            upstream_uri(&base, "/v1/models?x=1").unwrap().to_string(),
            "http://svc.ns.svc:8000/v1/models?x=1"
        );
        let prefixed: Uri = "http://svc:8000/api/".parse().unwrap();
        assert_eq!(
            upstream_uri(&prefixed, "/v1/chat/completions")
                .unwrap()
                .to_string(),
            "http://svc:8000/api/v1/chat/completions"
        );
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive"));
        h.insert("host", HeaderValue::from_static("x"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        let out = forwardable(&h);
        assert_eq!(out.len(), 1);
        assert_eq!(out["authorization"], "Bearer k");
    }

    /// A request sent while no upstream exists is held, counted, and answered once one starts.
    #[tokio::test]
    async fn holds_requests_until_the_upstream_is_ready() {
        let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream_addr = upstream.local_addr().unwrap();
        drop(upstream); // nothing listens yet: "zero replicas"
        let app = activator(ActivatorConfig {
            upstream: format!("http://{upstream_addr}").parse().unwrap(),
            wait_timeout: Duration::from_secs(20),
            max_waiting: 4,
            max_body_bytes: 1 << 20,
            probe_period: Duration::from_millis(50),
        });
        let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front_addr = front.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(front, app).await });

        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let send = |path: &str, body: &'static str| {
            let mut req = axum::http::Request::new(Full::new(Bytes::from_static(body.as_bytes())));
            *req.method_mut() = axum::http::Method::POST;
            *req.uri_mut() = format!("http://{front_addr}{path}").parse().unwrap();
            client.request(req)
        };
        let held = tokio::spawn(send("/v1/echo?q=1", "hello"));
        // The held request shows in the activator's queue depth.
        let mut seen = false;
        for _ in 0..100 {
            let mut req = axum::http::Request::new(Full::new(Bytes::new()));
            *req.uri_mut() = format!("http://{front_addr}/metrics").parse().unwrap();
            let resp = client.request(req).await.unwrap();
            let text = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap()
                .to_bytes();
            let text = String::from_utf8_lossy(&text).to_string();
            if crate::autoscaler::sum_metric(&text, "moe:num_requests_waiting") == Some(1.0) {
                seen = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(seen, "queue depth 1 never reported");

        // A replica starts: /ready answers 200 and requests echo their path and body.
        let listener = tokio::net::TcpListener::bind(upstream_addr).await.unwrap();
        let replica = Router::new()
            .route("/ready", get(|| async { "ready" }))
            .fallback(|req: Request<Body>| async move {
                let path = req.uri().to_string();
                let body = axum::body::to_bytes(req.into_body(), 1024).await.unwrap();
                format!("{path} {}", String::from_utf8_lossy(&body))
            });
        tokio::spawn(async move { axum::serve(listener, replica).await });
        let resp = tokio::time::timeout(Duration::from_secs(15), held)
            .await
            .expect("answered in time")
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(&body[..], b"/v1/echo?q=1 hello");
    }
}
