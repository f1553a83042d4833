//! A small in-memory Kubernetes API server behind a `tower::Service`, enough for reconcile tests:
//! GET (object / list), POST, PUT (resourceVersion checked), DELETE (finalizers honoured), PATCH
//! (server-side apply, merge, JSON patch; `/status` and `/scale` subresources). Failures can be
//! injected per method and path, and every request is recorded.

#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::Client;
use serde_json::{json, Value};

#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: Method,
    pub path: String,
    pub query: String,
    pub content_type: String,
    pub body: Option<Value>,
}

struct Injected {
    method: Method,
    path_contains: String,
    code: u16,
    remaining: usize,
}

#[derive(Default)]
struct State {
    objects: BTreeMap<String, Value>,
    requests: Vec<Recorded>,
    injected: VecDeque<Injected>,
    resource_version: u64,
    uid: u64,
}

#[derive(Clone, Default)]
pub struct FakeApi {
    state: Arc<Mutex<State>>,
}

fn status(code: u16, reason: &str, message: &str) -> (u16, Value) {
    (
        code,
        json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason, "message": message}),
    )
}

/// RFC 7386 merge; also what the fake uses for server-side apply.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

impl FakeApi {
    pub fn client(&self) -> Client {
        let api = self.clone();
        let service = tower::service_fn(move |req: Request<Body>| {
            let api = api.clone();
            async move { Ok::<_, Infallible>(api.handle(req).await) }
        });
        Client::new(service, "default")
    }

    /// Stores an object at its canonical path (`/api/v1/nodes/n1`, …).
    pub fn insert(&self, path: &str, mut obj: Value) {
        let mut st = self.state.lock().unwrap();
        st.resource_version += 1;
        st.uid += 1;
        let (rv, uid) = (st.resource_version, st.uid);
        let meta = obj["metadata"]
            .as_object_mut()
            .expect("object has metadata");
        meta.insert("resourceVersion".into(), rv.to_string().into());
        meta.entry("uid").or_insert(format!("uid-{uid}").into());
        meta.entry("generation").or_insert(1.into());
        st.objects.insert(path.to_string(), obj);
    }

    pub fn get(&self, path: &str) -> Option<Value> {
        self.state.lock().unwrap().objects.get(path).cloned()
    }

    /// Changes a stored object in place (e.g. a StatefulSet's status), bumping resourceVersion.
    pub fn update(&self, path: &str, change: impl FnOnce(&mut Value)) {
        let mut st = self.state.lock().unwrap();
        st.resource_version += 1;
        let rv = st.resource_version;
        let obj = st.objects.get_mut(path).expect("object exists");
        change(obj);
        obj["metadata"]["resourceVersion"] = rv.to_string().into();
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.state.lock().unwrap().requests.clone()
    }

    pub fn count(&self, method: Method, path_contains: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.method == method && r.path.contains(path_contains))
            .count()
    }

    /// The next `times` requests with this method and path fragment answer `code`.
    pub fn fail(&self, method: Method, path_contains: &str, code: u16, times: usize) {
        self.state.lock().unwrap().injected.push_back(Injected {
            method,
            path_contains: path_contains.into(),
            code,
            remaining: times,
        });
    }

    async fn handle(&self, req: Request<Body>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let bytes = body.collect_bytes().await.unwrap_or_default();
        let body: Option<Value> = if bytes.is_empty() {
            None
        } else {
            serde_json::from_slice(&bytes)
                .ok()
                .or_else(|| serde_yaml::from_slice(&bytes).ok())
        };
        let recorded = Recorded {
            method: parts.method.clone(),
            path: parts.uri.path().to_string(),
            query: parts.uri.query().unwrap_or("").to_string(),
            content_type: parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string(),
            body: body.clone(),
        };
        let (code, value) = self.respond(&recorded);
        self.state.lock().unwrap().requests.push(recorded);
        Response::builder()
            .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&value).unwrap_or_default()))
            .expect("response builds")
    }

    fn respond(&self, req: &Recorded) -> (u16, Value) {
        let mut st = self.state.lock().unwrap();
        if let Some(pos) = st.injected.iter().position(|f| {
            f.method == req.method && req.path.contains(&f.path_contains) && f.remaining > 0
        }) {
            let f = &mut st.injected[pos];
            f.remaining -= 1;
            let code = f.code;
            let reason = match code {
                409 => "Conflict",
                404 => "NotFound",
                _ => "InternalError",
            };
            return status(code, reason, "injected failure");
        }
        let path = req.path.trim_end_matches('/').to_string();
        let (object_path, sub) = match path.rsplit_once('/') {
            Some((p, s)) if s == "status" || s == "scale" => (p.to_string(), Some(s)),
            _ => (path.clone(), None),
        };
        match req.method {
            Method::GET => {
                if let Some(obj) = st.objects.get(&object_path) {
                    return (200, obj.clone());
                }
                let prefix = format!("{path}/");
                let items: Vec<Value> = st
                    .objects
                    .iter()
                    .filter(|(k, _)| k.starts_with(&prefix) && !k[prefix.len()..].contains('/'))
                    .map(|(_, v)| v.clone())
                    .collect();
                if looks_like_collection(&path) {
                    let list = json!({
                        "apiVersion": "v1",
                        "kind": "List",
                        "metadata": {"resourceVersion": st.resource_version.to_string()},
                        "items": items,
                    });
                    (200, list)
                } else {
                    status(404, "NotFound", &format!("{path} not found"))
                }
            }
            Method::POST => {
                let mut obj = req.body.clone().unwrap_or(Value::Null);
                let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
                let name = if name.is_empty() {
                    format!("generated-{}", st.uid + 1)
                } else {
                    name
                };
                obj["metadata"]["name"] = name.clone().into();
                let full = format!("{path}/{name}");
                if st.objects.contains_key(&full) {
                    return status(409, "AlreadyExists", "already exists");
                }
                drop(st);
                self.insert(&full, obj);
                (201, self.get(&full).unwrap_or(Value::Null))
            }
            Method::PUT => {
                let obj = req.body.clone().unwrap_or(Value::Null);
                let Some(existing) = st.objects.get(&object_path) else {
                    return status(404, "NotFound", "not found");
                };
                let sent_rv = obj["metadata"]["resourceVersion"].as_str();
                if sent_rv.is_some() && sent_rv != existing["metadata"]["resourceVersion"].as_str()
                {
                    return status(409, "Conflict", "the object has been modified");
                }
                st.resource_version += 1;
                let rv = st.resource_version;
                let mut obj = obj;
                obj["metadata"]["resourceVersion"] = rv.to_string().into();
                st.objects.insert(object_path.clone(), obj.clone());
                (200, obj)
            }
            Method::DELETE => {
                let Some(obj) = st.objects.get_mut(&object_path) else {
                    return status(404, "NotFound", "not found");
                };
                let has_finalizers = obj["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty());
                if has_finalizers {
                    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
                    (200, obj.clone())
                } else {
                    st.objects.remove(&object_path);
                    (
                        200,
                        json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}),
                    )
                }
            }
            Method::PATCH => self.patch(&mut st, req, &object_path, sub),
            _ => status(405, "MethodNotAllowed", "unsupported"),
        }
    }

    fn patch(
        &self,
        st: &mut State,
        req: &Recorded,
        object_path: &str,
        sub: Option<&str>,
    ) -> (u16, Value) {
        let patch = req.body.clone().unwrap_or(Value::Null);
        let apply = req.content_type.contains("apply-patch");
        let existing = st.objects.get(object_path).cloned();
        let mut obj = match (existing, apply, sub) {
            (Some(o), _, _) => o,
            (None, true, None) => {
                st.uid += 1;
                json!({"metadata": {"uid": format!("uid-{}", st.uid), "generation": 1}})
            }
            _ => return status(404, "NotFound", "not found"),
        };
        match (sub, req.content_type.as_str()) {
            (Some("status"), _) => merge(&mut obj["status"], &patch["status"]),
            (Some("scale"), _) => {
                if let Some(r) = patch["spec"]["replicas"].as_i64() {
                    obj["spec"]["replicas"] = r.into();
                }
            }
            (_, ct) if ct.contains("json-patch") => {
                // Like the apiserver, a `test` for null passes on a missing path.
                let ops: Vec<Value> = patch
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|op| {
                        let absent = op["path"]
                            .as_str()
                            .is_some_and(|p| obj.pointer(p).is_none());
                        !(op["op"] == "test" && op["value"].is_null() && absent)
                    })
                    .collect();
                let Ok(ops) = serde_json::from_value::<json_patch::Patch>(Value::Array(ops)) else {
                    return status(400, "BadRequest", "bad json patch");
                };
                if json_patch::patch(&mut obj, &ops).is_err() {
                    return status(422, "Invalid", "json patch test failed");
                }
            }
            _ => {
                let spec_before = obj.get("spec").cloned();
                merge(&mut obj, &patch);
                if obj.get("spec").cloned() != spec_before && !apply {
                    let g = obj["metadata"]["generation"].as_i64().unwrap_or(1);
                    obj["metadata"]["generation"] = (g + 1).into();
                }
            }
        }
        // The last finalizer gone from a deleting object: the apiserver removes it.
        let deleting = obj["metadata"].get("deletionTimestamp").is_some();
        let finalizers_left = obj["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        st.resource_version += 1;
        obj["metadata"]["resourceVersion"] = st.resource_version.to_string().into();
        if deleting && !finalizers_left {
            st.objects.remove(object_path);
        } else {
            st.objects.insert(object_path.to_string(), obj.clone());
        }
        if sub == Some("scale") {
            // The scale subresource answers with an autoscaling/v1 Scale, not the object.
            let scale = json!({
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]},
                "spec": {"replicas": obj["spec"]["replicas"]},
                "status": {"replicas": obj["status"]["replicas"].as_i64().unwrap_or(0)},
            });
            return (200, scale);
        }
        (200, obj)
    }
}

/// `/api/v1/nodes`, `/api/v1/namespaces/ns/pods`, `/apis/g/v/namespaces/ns/things`, `/apis/g/v/things`.
fn looks_like_collection(path: &str) -> bool {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let rest: &[&str] = match segs.first() {
        Some(&"api") => segs.get(2..).unwrap_or(&[]),
        Some(&"apis") => segs.get(3..).unwrap_or(&[]),
        _ => &[],
    };
    matches!(rest, [_] | ["namespaces", _, _])
}
