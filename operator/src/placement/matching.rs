//! The scheduler's label and taint rules, evaluated offline: node selectors, required node affinity
//! terms (OR of terms, AND of expressions) and taints against tolerations.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, NodeSelectorRequirement, NodeSelectorTerm, Taint, Toleration,
};

use super::node_facts::NodeFacts;

/// True when a toleration in `tolerations` tolerates `taint` (same rules as the scheduler).
pub fn tolerates(tolerations: &[Toleration], taint: &Taint) -> bool {
    tolerations.iter().any(|t| {
        let effect_ok = t
            .effect
            .as_deref()
            .is_none_or(|e| e.is_empty() || e == taint.effect);
        let key = t.key.as_deref().unwrap_or("");
        let operator = t.operator.as_deref().unwrap_or("Equal");
        let key_ok = match operator {
            "Exists" => key.is_empty() || key == taint.key,
            _ => {
                key == taint.key
                    && t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
            }
        };
        effect_ok && key_ok
    })
}

/// Keys of taints that keep the pod off the node (NoSchedule / NoExecute and not tolerated).
pub fn untolerated_taints(node: &NodeFacts, tolerations: &[Toleration]) -> Vec<String> {
    node.taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .filter(|t| !tolerates(tolerations, t))
        .map(|t| t.key.clone())
        .collect()
}

fn requirement_matches(req: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = req.values.as_deref().unwrap_or(&[]);
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(|v| v.parse::<i64>().ok()),
                values.first().and_then(|b| b.parse::<i64>().ok()),
            ) else {
                return false;
            };
            if req.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

fn term_matches(term: &NodeSelectorTerm, node: &NodeFacts) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or(&[]);
    let fields = term.match_fields.as_deref().unwrap_or(&[]);
    if exprs.is_empty() && fields.is_empty() {
        // An empty term matches nothing, as in the scheduler.
        return false;
    }
    exprs
        .iter()
        .all(|r| requirement_matches(r, node.labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            let value = (r.key == "metadata.name").then_some(node.name.as_str());
            requirement_matches(r, value)
        })
}

/// Does the node satisfy the pod's nodeSelector and required node affinity?
pub fn matches_pod_selectors(
    node: &NodeFacts,
    node_selector: &BTreeMap<String, String>,
    affinity: Option<&Affinity>,
) -> bool {
    let selector_ok = node_selector
        .iter()
        .all(|(k, v)| node.labels.get(k) == Some(v));
    let required = affinity
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    let affinity_ok = required.is_none_or(|sel| {
        sel.node_selector_terms
            .iter()
            .any(|term| term_matches(term, node))
    });
    selector_ok && affinity_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn toleration(
        key: Option<&str>,
        operator: &str,
        value: Option<&str>,
        effect: Option<&str>,
    ) -> Toleration {
        Toleration {
            key: key.map(Into::into),
            operator: Some(operator.into()),
            value: value.map(Into::into),
            effect: effect.map(Into::into),
            toleration_seconds: None,
        }
    }

    #[test]
    fn toleration_rules() {
        let gpu = taint("nvidia.com/gpu", Some("present"), "NoSchedule");
        assert!(tolerates(
            &[toleration(Some("nvidia.com/gpu"), "Exists", None, None)],
            &gpu
        ));
        assert!(tolerates(&[toleration(None, "Exists", None, None)], &gpu));
        assert!(tolerates(
            &[toleration(
                Some("nvidia.com/gpu"),
                "Equal",
                Some("present"),
                Some("NoSchedule")
            )],
            &gpu
        ));
        assert!(!tolerates(
            &[toleration(
                Some("nvidia.com/gpu"),
                "Equal",
                Some("absent"),
                None
            )],
            &gpu
        ));
        assert!(!tolerates(
            &[toleration(
                Some("nvidia.com/gpu"),
                "Exists",
                None,
                Some("NoExecute")
            )],
            &gpu
        ));
        assert!(!tolerates(&[], &gpu));
    }

    #[test]
    fn prefer_no_schedule_does_not_block() {
        let node = NodeFacts {
            taints: vec![
                taint("soft", None, "PreferNoSchedule"),
                taint("hard", None, "NoExecute"),
            ],
            ..Default::default()
        };
        assert_eq!(untolerated_taints(&node, &[]), vec!["hard".to_string()]);
    }

    fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        }
    }

    #[test]
    fn affinity_terms_are_ored_and_expressions_anded() {
        let node = NodeFacts {
            name: "n1".into(),
            labels: [
                ("zone".to_string(), "a".to_string()),
                ("gen".to_string(), "4".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        let affinity = |terms: Vec<NodeSelectorTerm>| Affinity {
            node_affinity: Some(k8s_openapi::api::core::v1::NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(
                    k8s_openapi::api::core::v1::NodeSelector {
                        node_selector_terms: terms,
                    },
                ),
                preferred_during_scheduling_ignored_during_execution: None,
            }),
            ..Default::default()
        };
        let term = |reqs: Vec<NodeSelectorRequirement>| NodeSelectorTerm {
            match_expressions: Some(reqs),
            match_fields: None,
        };
        let none = BTreeMap::new();
        let yes = affinity(vec![
            term(vec![req("zone", "In", &["b"])]),
            term(vec![req("gen", "Gt", &["3"])]),
        ]);
        assert!(matches_pod_selectors(&node, &none, Some(&yes)));
        let no = affinity(vec![term(vec![
            req("zone", "In", &["a"]),
            req("gen", "Lt", &["3"]),
        ])]);
        assert!(!matches_pod_selectors(&node, &none, Some(&no)));
        let absent = affinity(vec![term(vec![
            req("gpu", "DoesNotExist", &[]),
            req("zone", "NotIn", &["c"]),
        ])]);
        assert!(matches_pod_selectors(&node, &none, Some(&absent)));
        let by_name = affinity(vec![NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(vec![req("metadata.name", "In", &["n2"])]),
        }]);
        assert!(!matches_pod_selectors(&node, &none, Some(&by_name)));
        let selector: BTreeMap<String, String> = [("zone".to_string(), "a".to_string())].into();
        assert!(matches_pod_selectors(&node, &selector, None));
        let selector: BTreeMap<String, String> = [("zone".to_string(), "z".to_string())].into();
        assert!(!matches_pod_selectors(&node, &selector, None));
    }
}
