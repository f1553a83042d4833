//! Leader election on a coordination.k8s.io/v1 Lease, so only one operator replica reconciles and
//! autoscales. The acquire/renew/take-over decision is pure ([`lease_step`]); writes carry the
//! Lease's resourceVersion, so two candidates racing get one 409 and one win.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub name: String,
    pub namespace: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_period: Duration,
    /// The leader stops acting when it has not renewed for this long (local monotonic clock).
    /// Shorter than `lease_duration`, so it stops before a standby may take over.
    pub renew_deadline: Duration,
}

/// Someone else's lease record as this candidate last saw it, timed on the local monotonic clock
/// (client-go's `observedTime`). A standby takes over only after the record stayed unchanged for a
/// whole lease duration by its own clock, so a skewed clock on either host cannot shorten the wait.
#[derive(Debug, Default)]
pub struct LeaseObservation {
    record: Option<(Option<String>, Option<MicroTime>)>,
    since: Option<std::time::Instant>,
}

impl LeaseObservation {
    /// True when `spec` has not changed for `lease_duration` of local time.
    fn expired(&mut self, spec: &LeaseSpec, lease_duration: Duration) -> bool {
        let record = (spec.holder_identity.clone(), spec.renew_time.clone());
        if self.record.as_ref() != Some(&record) {
            self.record = Some(record);
            self.since = Some(std::time::Instant::now());
            return false;
        }
        self.since.is_some_and(|t| t.elapsed() >= lease_duration)
    }
}

/// What to do with the Lease as observed now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseStep {
    Create,
    Renew,
    TakeOver,
    /// Someone else holds a live lease.
    Wait,
}

pub fn lease_step(spec: Option<&LeaseSpec>, identity: &str, now: Timestamp) -> LeaseStep {
    let Some(spec) = spec else {
        return LeaseStep::Create;
    };
    match spec.holder_identity.as_deref() {
        Some(holder) if holder == identity => LeaseStep::Renew,
        None | Some("") => LeaseStep::TakeOver,
        Some(_) => {
            let duration =
                SignedDuration::from_secs(spec.lease_duration_seconds.unwrap_or(15) as i64);
            let last = spec
                .renew_time
                .as_ref()
                .or(spec.acquire_time.as_ref())
                .map(|t| t.0);
            match last {
                Some(last) if last + duration > now => LeaseStep::Wait,
                _ => LeaseStep::TakeOver,
            }
        }
    }
}

fn held_spec(
    cfg: &LeaseConfig,
    now: Timestamp,
    previous: Option<&LeaseSpec>,
    transition: bool,
) -> LeaseSpec {
    let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
    LeaseSpec {
        holder_identity: Some(cfg.identity.clone()),
        lease_duration_seconds: Some(cfg.lease_duration.as_secs() as i32),
        acquire_time: if transition {
            Some(MicroTime(now))
        } else {
            previous
                .and_then(|p| p.acquire_time.clone())
                .or(Some(MicroTime(now)))
        },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(if transition {
            transitions + 1
        } else {
            transitions
        }),
        ..Default::default()
    }
}

/// One round: returns whether this replica holds the lease afterwards. A 409 means another
/// candidate wrote first and reads as "not leader".
pub async fn try_acquire_or_renew(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    observed: &mut LeaseObservation,
) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let current = api.get_opt(&cfg.name).await?;
    let spec = current.as_ref().and_then(|l| l.spec.as_ref());
    let mut step = lease_step(spec, &cfg.identity, now);
    // Another holder's lease: whatever its timestamps say, wait until it has stood still for a
    // lease duration on this host's clock.
    if let Some(spec) = spec.filter(|s| {
        s.holder_identity
            .as_deref()
            .is_some_and(|h| !h.is_empty() && h != cfg.identity)
    }) {
        let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64);
        step = if observed.expired(spec, duration) {
            LeaseStep::TakeOver
        } else {
            LeaseStep::Wait
        };
    }
    let result = match (step, current) {
        (LeaseStep::Wait, _) => return Ok(false),
        (LeaseStep::Create, _) | (_, None) => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(held_spec(cfg, now, None, false)),
            };
            api.create(&PostParams::default(), &lease).await
        }
        (step, Some(mut lease)) => {
            let spec = held_spec(cfg, now, lease.spec.as_ref(), step == LeaseStep::TakeOver);
            lease.spec = Some(spec);
            api.replace(&cfg.name, &PostParams::default(), &lease).await
        }
    };
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Gives the lease up on shutdown so a standby takes over at once instead of after expiry.
pub async fn release(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<(), kube::Error> {
    if let Some(mut lease) = api.get_opt(&cfg.name).await? {
        let ours = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
            == Some(cfg.identity.as_str());
        if ours {
            if let Some(spec) = lease.spec.as_mut() {
                spec.holder_identity = None;
                spec.renew_time = None;
            }
            api.replace(&cfg.name, &PostParams::default(), &lease)
                .await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(Into::into),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
            ..Default::default()
        }
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    #[test]
    fn lease_steps() {
        assert_eq!(lease_step(None, "me", at(100)), LeaseStep::Create);
        assert_eq!(
            lease_step(Some(&spec(Some("me"), 90)), "me", at(100)),
            LeaseStep::Renew
        );
        assert_eq!(
            lease_step(Some(&spec(Some("other"), 90)), "me", at(100)),
            LeaseStep::Wait
        );
        assert_eq!(
            lease_step(Some(&spec(Some("other"), 80)), "me", at(100)),
            LeaseStep::TakeOver
        );
        assert_eq!(
            lease_step(Some(&spec(None, 99)), "me", at(100)),
            LeaseStep::TakeOver
        );
    }

    #[test]
    fn take_over_counts_a_transition() {
        let cfg = LeaseConfig {
            name: "moe-operator".into(),
            namespace: "ops".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(15),
            renew_period: Duration::from_secs(5),
            renew_deadline: Duration::from_secs(10),
        };
        let mut prev = spec(Some("other"), 0);
        prev.lease_transitions = Some(2);
        let taken = held_spec(&cfg, at(50), Some(&prev), true);
        assert_eq!(taken.lease_transitions, Some(3));
        assert_eq!(taken.holder_identity.as_deref(), Some("me"));
        let renewed = held_spec(&cfg, at(55), Some(&taken), false);
        assert_eq!(renewed.lease_transitions, Some(3));
        assert_eq!(renewed.acquire_time, taken.acquire_time);
    }

    #[test]
    fn another_holder_expires_only_on_the_local_clock() {
        // A renewTime far in the past (skewed leader clock) does not make the lease look expired:
        // the standby first watches the record stand still for a lease duration of its own time.
        let mut observed = LeaseObservation::default();
        let stale = spec(Some("other"), -3600);
        assert!(!observed.expired(&stale, Duration::from_millis(30)));
        assert!(!observed.expired(&stale, Duration::from_millis(30)));
        std::thread::sleep(Duration::from_millis(40));
        assert!(observed.expired(&stale, Duration::from_millis(30)));
        // A renewal resets the wait.
        let renewed = spec(Some("other"), -3599);
        assert!(!observed.expired(&renewed, Duration::from_millis(30)));
    }
}
