//! Status conditions (Scheduled, ModelReady, Ready, Degraded) from one reconcile's outcome. Pure;
//! `lastTransitionTime` only moves when a condition's status flips.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

pub const SCHEDULED: &str = "Scheduled";
pub const MODEL_READY: &str = "ModelReady";
pub const READY: &str = "Ready";
pub const DEGRADED: &str = "Degraded";

/// What a reconcile found.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    InvalidSpec(String),
    NoQualifyingNodes(String),
    ApplyFailed(String),
    Applied {
        placement_summary: String,
        desired: i32,
        ready: i32,
        /// Replicas the scheduler cannot place (PodScheduled=False), with its message.
        pending: Option<String>,
    },
}

struct Cond {
    type_: &'static str,
    ok: bool,
    reason: &'static str,
    message: String,
}

fn evaluate(outcome: &Outcome) -> [Cond; 4] {
    let c = |type_, ok, reason, message: String| Cond {
        type_,
        ok,
        reason,
        message,
    };
    match outcome {
        Outcome::InvalidSpec(msg) => [
            c(SCHEDULED, false, "InvalidSpec", msg.clone()),
            c(MODEL_READY, false, "InvalidSpec", "spec is invalid".into()),
            c(READY, false, "InvalidSpec", "spec is invalid".into()),
            c(DEGRADED, true, "InvalidSpec", msg.clone()),
        ],
        Outcome::NoQualifyingNodes(summary) => [
            c(SCHEDULED, false, "NoQualifyingNodes", summary.clone()),
            c(
                MODEL_READY,
                false,
                "NotScheduled",
                "no node can run the model".into(),
            ),
            c(
                READY,
                false,
                "NotScheduled",
                "no node can run the model".into(),
            ),
            c(DEGRADED, true, "NoQualifyingNodes", summary.clone()),
        ],
        Outcome::ApplyFailed(msg) => [
            c(
                SCHEDULED,
                true,
                "NodesQualified",
                "placement decided".into(),
            ),
            c(MODEL_READY, false, "ApplyFailed", msg.clone()),
            c(READY, false, "ApplyFailed", msg.clone()),
            c(DEGRADED, true, "ApplyFailed", msg.clone()),
        ],
        Outcome::Applied {
            placement_summary,
            desired,
            ready,
            pending,
        } => {
            let (desired, ready) = (*desired, *ready);
            let replicas = format!("{ready}/{desired} replicas ready");
            let model = if desired == 0 {
                c(
                    MODEL_READY,
                    false,
                    "ScaledToZero",
                    "no replicas requested".into(),
                )
            } else if ready > 0 {
                c(
                    MODEL_READY,
                    true,
                    "ModelLoaded",
                    format!("model served by {ready} replica(s)"),
                )
            } else {
                c(
                    MODEL_READY,
                    false,
                    "Loading",
                    "waiting for the first replica to load the model".into(),
                )
            };
            let ready_cond = if desired == 0 {
                c(READY, false, "ScaledToZero", "no replicas requested".into())
            } else if ready >= desired {
                c(READY, true, "AllReplicasReady", replicas.clone())
            } else {
                c(READY, false, "ReplicasNotReady", replicas.clone())
            };
            let degraded = if let Some(msg) = pending {
                c(DEGRADED, true, "FailedScheduling", msg.clone())
            } else if ready > 0 && ready < desired {
                c(DEGRADED, true, "ReplicasUnavailable", replicas)
            } else {
                c(DEGRADED, false, "AsExpected", "".into())
            };
            let scheduled = match pending {
                // Placement found hardware, but the scheduler cannot place a replica (e.g. its
                // CPUs or memory are taken by other pods): say so with the scheduler's words.
                Some(msg) => c(SCHEDULED, false, "FailedScheduling", msg.clone()),
                None => c(SCHEDULED, true, "NodesQualified", placement_summary.clone()),
            };
            [scheduled, model, ready_cond, degraded]
        }
    }
}

/// New condition list; keeps `lastTransitionTime` of conditions whose status did not change.
pub fn conditions(
    previous: &[Condition],
    generation: Option<i64>,
    outcome: &Outcome,
    now: Time,
) -> Vec<Condition> {
    evaluate(outcome)
        .into_iter()
        .map(|cond| {
            let status = if cond.ok { "True" } else { "False" };
            let last_transition_time = previous
                .iter()
                .find(|p| p.type_ == cond.type_ && p.status == status)
                .map(|p| p.last_transition_time.clone())
                .unwrap_or_else(|| now.clone());
            Condition {
                type_: cond.type_.into(),
                status: status.into(),
                reason: cond.reason.into(),
                message: cond.message,
                observed_generation: generation,
                last_transition_time,
            }
        })
        .collect()
}

pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn t(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn ready_when_all_replicas_ready() {
        let out = Outcome::Applied {
            placement_summary: "2/2 nodes are available.".into(),
            desired: 2,
            ready: 2,
            pending: None,
        };
        let c = conditions(&[], Some(3), &out, t(10));
        assert_eq!(find(&c, READY).unwrap().status, "True");
        assert_eq!(find(&c, MODEL_READY).unwrap().reason, "ModelLoaded");
        assert_eq!(find(&c, DEGRADED).unwrap().status, "False");
        assert!(c.iter().all(|x| x.observed_generation == Some(3)));
    }

    #[test]
    fn partial_readiness_is_degraded_and_loading_is_not() {
        let partial = Outcome::Applied {
            placement_summary: String::new(),
            desired: 3,
            ready: 1,
            pending: None,
        };
        let c = conditions(&[], None, &partial, t(0));
        assert_eq!(find(&c, DEGRADED).unwrap().reason, "ReplicasUnavailable");
        assert_eq!(find(&c, READY).unwrap().message, "1/3 replicas ready");
        let loading = Outcome::Applied {
            placement_summary: String::new(),
            desired: 3,
            ready: 0,
            pending: None,
        };
        let c = conditions(&[], None, &loading, t(0));
        assert_eq!(find(&c, MODEL_READY).unwrap().reason, "Loading");
        assert_eq!(find(&c, DEGRADED).unwrap().status, "False");
    }

    #[test]
    fn unschedulable_carries_the_summary() {
        let out = Outcome::NoQualifyingNodes("0/5 nodes are available: 5 without AVX-512.".into());
        let c = conditions(&[], None, &out, t(0));
        let s = find(&c, SCHEDULED).unwrap();
        assert_eq!(
            (s.status.as_str(), s.reason.as_str()),
            ("False", "NoQualifyingNodes")
        );
        assert!(s.message.contains("5 without AVX-512"));
    }

    #[test]
    fn transition_time_only_moves_on_status_change() {
        let loading = Outcome::Applied {
            placement_summary: String::new(),
            desired: 1,
            ready: 0,
            pending: None,
        };
        let first = conditions(&[], None, &loading, t(100));
        let again = conditions(&first, None, &loading, t(200));
        assert_eq!(find(&again, READY).unwrap().last_transition_time, t(100));
        let ready = Outcome::Applied {
            placement_summary: String::new(),
            desired: 1,
            ready: 1,
            pending: None,
        };
        let after = conditions(&again, None, &ready, t(300));
        assert_eq!(find(&after, READY).unwrap().last_transition_time, t(300));
        assert_eq!(
            find(&after, SCHEDULED).unwrap().last_transition_time,
            t(100)
        );
    }
}
