//! What the operator may touch: only objects whose controller owner reference is this
//! MoEDeployment. And what it must not change in place: the StatefulSet fields the API server
//! refuses to update (apps `ValidateStatefulSetUpdate`: only replicas, template, updateStrategy,
//! minReadySeconds, ordinals and persistentVolumeClaimRetentionPolicy may change).

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::crd::MoEDeployment;

/// True when `meta` carries a controller owner reference to this MoEDeployment (matched by uid).
pub fn controlled_by(meta: &ObjectMeta, md: &MoEDeployment) -> bool {
    let Some(uid) = md.metadata.uid.as_deref() else {
        return false;
    };
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// The parts of a volume claim template we set; the API server fills in defaults (volumeMode,
/// status, apiVersion) that must not count as a change.
fn claim_key(c: &PersistentVolumeClaim) -> (Option<String>, String) {
    let spec = c.spec.clone().unwrap_or_default();
    let storage = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .map(|q| q.0.clone());
    (
        c.metadata.name.clone(),
        format!(
            "{:?} {:?} {:?}",
            spec.access_modes, spec.storage_class_name, storage
        ),
    )
}

/// Names the immutable StatefulSet field that differs between the stored and the desired object,
/// or `None` when an in-place update is allowed.
pub fn immutable_change(existing: &StatefulSet, desired: &StatefulSet) -> Option<&'static str> {
    let (old, new) = (&existing.spec, &desired.spec);
    if old.selector != new.selector {
        return Some("selector");
    }
    if old.service_name != new.service_name {
        return Some("serviceName");
    }
    let policy = |p: &Option<String>| p.clone().unwrap_or_else(|| "OrderedReady".into());
    if policy(&old.pod_management_policy) != policy(&new.pod_management_policy) {
        return Some("podManagementPolicy");
    }
    let claims = |c: &Option<Vec<PersistentVolumeClaim>>| -> Vec<_> {
        c.iter().flatten().map(claim_key).collect()
    };
    if claims(&old.volume_claim_templates) != claims(&new.volume_claim_templates) {
        return Some("volumeClaimTemplates");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sts(extra: serde_json::Value) -> StatefulSet {
        let mut v = json!({
            "metadata": {"name": "m"},
            "spec": {
                "selector": {"matchLabels": {"a": "b"}},
                "serviceName": "m-pods",
                "podManagementPolicy": "Parallel",
                "template": {},
            }
        });
        if let Some(o) = extra.as_object() {
            for (k, val) in o {
                v["spec"][k] = val.clone();
            }
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn claim_templates_added_or_resized_are_immutable_changes() {
        let claim = |size: &str| {
            json!([{"metadata": {"name": "model-cache"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}}])
        };
        let none = sts(json!({}));
        let small = sts(json!({"volumeClaimTemplates": claim("10Gi")}));
        let big = sts(json!({"volumeClaimTemplates": claim("20Gi")}));
        assert_eq!(
            immutable_change(&none, &small),
            Some("volumeClaimTemplates")
        );
        assert_eq!(immutable_change(&small, &big), Some("volumeClaimTemplates"));
        assert_eq!(immutable_change(&small, &small), None);
        // Server-filled defaults do not count.
        let mut stored = small.clone();
        let c = &mut stored.spec.volume_claim_templates.as_mut().unwrap()[0];
        c.spec.as_mut().unwrap().volume_mode = Some("Filesystem".into());
        assert_eq!(immutable_change(&stored, &small), None);
        let replicas = sts(json!({"replicas": 5}));
        assert_eq!(immutable_change(&none, &replicas), None);
        let policy = sts(json!({"podManagementPolicy": "OrderedReady"}));
        assert_eq!(
            immutable_change(&none, &policy),
            Some("podManagementPolicy")
        );
    }
}
