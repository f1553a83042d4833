//! A small in-memory Kubernetes API server behind a `tower::Service`, enough for reconcile tests:
//! GET (object / list, `/scale`), POST, PUT (resourceVersion checked), DELETE (finalizers and uid
//! preconditions honoured), PATCH (merge, JSON patch, `/status` and `/scale` subresources) and
//! server-side apply with field ownership as the API server does it (fields a manager stops
//! applying are removed unless another manager owns them; a field owned by another manager with a
//! different value is a 409 conflict unless `force=true`). `metadata.generation` is bumped when the
//! spec changes, and StatefulSet updates outside the mutable fields are rejected with 422 as apps
//! `ValidateStatefulSetUpdate` does. Failures can be injected per method and path, and every
//! request is recorded.
//!
//! Simplification: lists are atomic for field ownership (the API server merges some by key).

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
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
    /// object path → field manager → owned leaf paths (JSON pointers).
    owners: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
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
                    if sub == Some("scale") {
                        return (200, scale_of(obj));
                    }
                    return (200, obj.clone());
                }
                let prefix = format!("{path}/");
                let across_namespaces = cluster_wide_pattern(&path);
                let fields = query_param(&req.query, "fieldSelector")
                    .map(|f| percent_decode(&f))
                    .unwrap_or_default();
                let items: Vec<Value> = st
                    .objects
                    .iter()
                    .filter(|(k, _)| {
                        (k.starts_with(&prefix) && !k[prefix.len()..].contains('/'))
                            || across_namespaces
                                .as_ref()
                                .is_some_and(|(head, kind)| in_namespaced_list(k, head, kind))
                    })
                    .filter(|(_, v)| field_selector_matches(&fields, v))
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
                if let Some(uid) = req
                    .body
                    .as_ref()
                    .and_then(|b| b["preconditions"]["uid"].as_str())
                {
                    if obj["metadata"]["uid"].as_str() != Some(uid) {
                        return status(
                            409,
                            "Conflict",
                            "Precondition failed: UID in precondition does not match",
                        );
                    }
                }
                let has_finalizers = obj["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty());
                if has_finalizers {
                    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
                    (200, obj.clone())
                } else {
                    st.objects.remove(&object_path);
                    st.owners.remove(&object_path);
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
        let before = existing.clone();
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
            _ if apply => {
                let manager = query_param(&req.query, "fieldManager").unwrap_or_default();
                let force = query_param(&req.query, "force").as_deref() == Some("true");
                let owners = st.owners.entry(object_path.to_string()).or_default();
                if let Err(conflicts) = server_side_apply(&mut obj, &patch, owners, &manager, force)
                {
                    return status(
                        409,
                        "Conflict",
                        &format!("Apply failed with conflicts: {}", conflicts.join(", ")),
                    );
                }
            }
            _ => merge(&mut obj, &patch),
        }
        if sub != Some("status") {
            if let Some(before) = &before {
                if object_path.contains("/statefulsets/") {
                    if let Some(field) = forbidden_statefulset_update(before, &obj) {
                        return status(
                            422,
                            "Invalid",
                            &format!("StatefulSet.apps is invalid: spec: Forbidden: updates to statefulset spec for fields other than 'replicas', 'ordinals', 'template', 'updateStrategy', 'persistentVolumeClaimRetentionPolicy' and 'minReadySeconds' are forbidden ({field})"),
                        );
                    }
                }
                if before.get("spec") != obj.get("spec") {
                    let g = obj["metadata"]["generation"].as_i64().unwrap_or(1);
                    obj["metadata"]["generation"] = (g + 1).into();
                }
            }
        }
        let managers: Vec<Value> = st
            .owners
            .get(object_path)
            .map(|m| {
                m.iter()
                    .filter(|(_, f)| !f.is_empty())
                    .map(|(name, _)| json!({"manager": name, "operation": "Apply"}))
                    .collect()
            })
            .unwrap_or_default();
        if !managers.is_empty() {
            obj["metadata"]["managedFields"] = Value::Array(managers);
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
            return (200, scale_of(&obj));
        }
        (200, obj)
    }

    /// Server-side apply of `config` by `manager` outside the operator (a user's `kubectl apply`).
    pub fn apply_as(&self, manager: &str, path: &str, config: Value) {
        let mut st = self.state.lock().unwrap();
        let mut obj = st.objects.get(path).cloned().unwrap_or_else(
            || json!({"metadata": {"uid": format!("uid-user-{manager}"), "generation": 1}}),
        );
        let owners = st.owners.entry(path.to_string()).or_default();
        server_side_apply(&mut obj, &config, owners, manager, true).expect("forced apply");
        st.resource_version += 1;
        obj["metadata"]["resourceVersion"] = st.resource_version.to_string().into();
        st.objects.insert(path.to_string(), obj);
    }

    /// Leaf fields (JSON pointers) that `manager` owns on the object at `path`.
    pub fn owned_fields(&self, path: &str, manager: &str) -> BTreeSet<String> {
        self.state
            .lock()
            .unwrap()
            .owners
            .get(path)
            .and_then(|m| m.get(manager))
            .cloned()
            .unwrap_or_default()
    }
}

/// The autoscaling/v1 Scale the API server answers on `/scale`: `spec.replicas` read through the
/// CRD's specReplicasPath (0 when unset, which is why a missing default disables an HPA),
/// `status.replicas` and the selector through statusReplicasPath / labelSelectorPath.
fn scale_of(obj: &Value) -> Value {
    let mut scale = json!({
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]},
        "spec": {"replicas": obj["spec"]["replicas"].as_i64().unwrap_or(0)},
        "status": {"replicas": obj["status"]["replicas"].as_i64().unwrap_or(0)},
    });
    if let Some(sel) = obj["status"]["selector"].as_str() {
        scale["status"]["selector"] = sel.into();
    }
    scale
}

fn query_param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| v.to_string())
    })
}

/// Leaf paths of an applied configuration; objects recurse, everything else (lists included) is a
/// leaf. Identity fields are nobody's.
fn leaves(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, child) in m {
                let path = format!("{prefix}/{}", k.replace('~', "~0").replace('/', "~1"));
                if matches!(
                    path.as_str(),
                    "/apiVersion" | "/kind" | "/metadata/name" | "/metadata/namespace"
                ) {
                    continue;
                }
                leaves(child, &path, out);
            }
        }
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

/// Removes the value at a JSON pointer, then parents left empty by the removal.
fn remove_path(obj: &mut Value, pointer: &str) {
    let Some((parent, key)) = pointer.rsplit_once('/') else {
        return;
    };
    let key = key.replace("~1", "/").replace("~0", "~");
    if let Some(Value::Object(m)) = obj.pointer_mut(parent) {
        m.remove(&key);
        if m.is_empty() && !parent.is_empty() {
            remove_path(obj, parent);
        }
    }
}

/// Server-side apply: conflicts, ownership transfer on force, removal of fields the manager no
/// longer applies, then the merge. Returns the conflicting fields when not forced.
fn server_side_apply(
    obj: &mut Value,
    config: &Value,
    owners: &mut BTreeMap<String, BTreeSet<String>>,
    manager: &str,
    force: bool,
) -> Result<(), Vec<String>> {
    let mut applied = BTreeSet::new();
    leaves(config, "", &mut applied);
    let mut conflicts = Vec::new();
    for (other, fields) in owners.iter() {
        if other == manager {
            continue;
        }
        for f in fields.intersection(&applied) {
            if obj.pointer(f) != config.pointer(f) {
                conflicts.push(format!("{f} (owned by {other})"));
            }
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(conflicts);
    }
    for (other, fields) in owners.iter_mut() {
        if other != manager {
            fields.retain(|f| !applied.contains(f));
        }
    }
    let previous = owners.remove(manager).unwrap_or_default();
    for dropped in previous.difference(&applied) {
        let shared = owners.values().any(|f| f.contains(dropped));
        if !shared {
            remove_path(obj, dropped);
        }
    }
    merge_replacing_lists(obj, config);
    owners.insert(manager.to_string(), applied);
    Ok(())
}

/// Like [`merge`], but an applied list replaces the stored one and null is a value.
fn merge_replacing_lists(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                merge_replacing_lists(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// The first immutable StatefulSet spec field that differs (server-filled defaults aside).
fn forbidden_statefulset_update(before: &Value, after: &Value) -> Option<String> {
    const MUTABLE: [&str; 6] = [
        "replicas",
        "ordinals",
        "template",
        "updateStrategy",
        "persistentVolumeClaimRetentionPolicy",
        "minReadySeconds",
    ];
    let empty = serde_json::Map::new();
    let (b, a) = (
        before["spec"].as_object().unwrap_or(&empty),
        after["spec"].as_object().unwrap_or(&empty),
    );
    let keys: BTreeSet<&String> = b.keys().chain(a.keys()).collect();
    let changed = keys
        .into_iter()
        .filter(|k| !MUTABLE.contains(&k.as_str()))
        .find(|k| b.get(*k) != a.get(*k))
        .map(|k| k.to_string());
    changed
}

/// A cluster-wide list of a namespaced kind (`/api/v1/pods`): ("/api/v1", "pods"). Kinds stored
/// without namespaces (nodes) have no `namespaces/` keys, so the pattern finds nothing extra there.
fn cluster_wide_pattern(path: &str) -> Option<(String, String)> {
    let (head, kind) = path.rsplit_once('/')?;
    let depth = head.trim_start_matches('/').split('/').count();
    let api_root =
        (head.starts_with("/api/") && depth == 2) || (head.starts_with("/apis/") && depth == 3);
    api_root.then(|| (head.to_string(), kind.to_string()))
}

/// Whether `key` is `{head}/namespaces/{ns}/{kind}/{name}`.
fn in_namespaced_list(key: &str, head: &str, kind: &str) -> bool {
    let Some(rest) = key.strip_prefix(&format!("{head}/namespaces/")) else {
        return false;
    };
    matches!(rest.split('/').collect::<Vec<_>>()[..], [_, k, _] if k == kind)
}

/// `%XX` escapes of a query value decoded (what field selectors need).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A field selector (`a.b=v`, `a.b!=v`, comma-separated, all must hold) on `obj`; an absent field
/// reads as "" as the API server's pod field sets do (`spec.nodeName!=` selects bound pods).
fn field_selector_matches(selector: &str, obj: &Value) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (path, want, negated) = match term.split_once("!=") {
            Some((p, v)) => (p, v, true),
            None => match term.split_once('=') {
                Some((p, v)) => (p, v.trim_start_matches('='), false),
                None => return true,
            },
        };
        let pointer = format!("/{}", path.replace('.', "/"));
        let have = obj.pointer(&pointer).and_then(Value::as_str).unwrap_or("");
        (have == want) != negated
    })
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
