//! Builtin queue-depth autoscaler, decision part (pure). The controller scrapes every replica's
//! `/metrics`, feeds [`QueueSample`]s in, and writes the recommendation to `spec.replicas`
//! through the scale subresource.
//!
//! ```text
//! average_waiting = mean over the window of Σ_pods moe:num_requests_waiting
//! raw             = ⌈average_waiting / targetQueueDepth⌉, at least 1 while requests are running
//! recommendation  = clamp(raw, floor, maxReplicas)   floor = 0 with scaleToZero, else max(minReplicas, 1)
//! scale up        : at once, to the recommendation
//! scale down      : to the highest recommendation of the last scaleDownDelaySeconds (stabilisation)
//! ```

use std::collections::VecDeque;

use crate::crd::AutoscalingSpec;

/// Queue metrics summed over the replicas at one instant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QueueSample {
    pub at_secs: f64,
    pub waiting: f64,
    pub running: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AutoscalerPolicy {
    pub floor: i32,
    pub max: i32,
    pub target_queue_depth: f64,
    pub window_secs: f64,
    pub scale_down_delay_secs: f64,
}

impl AutoscalerPolicy {
    pub fn from_spec(a: &AutoscalingSpec) -> Self {
        let floor = if a.scale_to_zero {
            0
        } else {
            a.min_replicas.max(1)
        };
        Self {
            floor,
            max: a.max_replicas.max(floor),
            target_queue_depth: a.target_queue_depth.max(1) as f64,
            window_secs: a.window_seconds as f64,
            scale_down_delay_secs: a.scale_down_delay_seconds as f64,
        }
    }
}

/// Samples and past recommendations of one MoEDeployment.
#[derive(Clone, Debug, Default)]
pub struct AutoscalerState {
    samples: VecDeque<QueueSample>,
    recommendations: VecDeque<(f64, i32)>,
}

impl AutoscalerState {
    pub fn observe(&mut self, sample: QueueSample) {
        self.samples.push_back(sample);
    }

    /// Mean of the samples inside the window ending at `now`; `None` without data.
    fn windowed(&mut self, now: f64, window: f64) -> Option<(f64, f64)> {
        while self
            .samples
            .front()
            .is_some_and(|s| s.at_secs < now - window)
        {
            self.samples.pop_front();
        }
        if self.samples.is_empty() {
            return None;
        }
        let n = self.samples.len() as f64;
        let waiting = self.samples.iter().map(|s| s.waiting).sum::<f64>() / n;
        let running = self.samples.iter().map(|s| s.running).sum::<f64>() / n;
        Some((waiting, running))
    }

    /// The replica count to set at `now`, or `None` to leave `current` alone (no data, or no change).
    pub fn decide(&mut self, now: f64, current: i32, policy: &AutoscalerPolicy) -> Option<i32> {
        let (waiting, running) = self.windowed(now, policy.window_secs)?;
        let mut raw = (waiting / policy.target_queue_depth).ceil() as i32;
        if running > 0.0 || waiting > 0.0 {
            raw = raw.max(1);
        }
        let recommendation = raw.clamp(policy.floor, policy.max);
        self.recommendations.push_back((now, recommendation));
        while self
            .recommendations
            .front()
            .is_some_and(|(t, _)| *t < now - policy.scale_down_delay_secs)
        {
            self.recommendations.pop_front();
        }
        let stabilised = if recommendation >= current {
            recommendation
        } else {
            // Highest recommendation within the delay: scale down only after sustained low demand.
            self.recommendations
                .iter()
                .map(|(_, r)| *r)
                .max()
                .unwrap_or(recommendation)
                .min(current)
        };
        let target = stabilised.clamp(policy.floor, policy.max);
        (target != current).then_some(target)
    }
}

/// Sum of every sample of `metric` in a Prometheus text exposition (any labels).
pub fn sum_metric(exposition: &str, metric: &str) -> Option<f64> {
    let mut found = false;
    let mut total = 0.0;
    for line in exposition.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(metric) else {
            continue;
        };
        let value_part = if let Some(labels_and_value) = rest.strip_prefix('{') {
            match labels_and_value.rsplit_once('}') {
                Some((_, v)) => v,
                None => continue,
            }
        } else if rest.starts_with(' ') || rest.starts_with('\t') {
            rest
        } else {
            // A longer metric name sharing the prefix.
            continue;
        };
        if let Some(v) = value_part
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            if v.is_finite() {
                total += v;
                found = true;
            }
        }
    }
    found.then_some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> AutoscalerPolicy {
        AutoscalerPolicy {
            floor: 1,
            max: 8,
            target_queue_depth: 4.0,
            window_secs: 60.0,
            scale_down_delay_secs: 300.0,
        }
    }

    fn sample(at: f64, waiting: f64) -> QueueSample {
        QueueSample {
            at_secs: at,
            waiting,
            running: 1.0,
        }
    }

    #[test]
    fn scales_up_immediately_to_ceil_of_queue_over_target() {
        let mut s = AutoscalerState::default();
        s.observe(sample(0.0, 10.0));
        s.observe(sample(15.0, 14.0));
        // mean 12 waiting / 4 per replica = 3
        assert_eq!(s.decide(15.0, 1, &policy()), Some(3));
    }

    #[test]
    fn clamps_to_max_and_floor() {
        let mut s = AutoscalerState::default();
        s.observe(sample(0.0, 1000.0));
        assert_eq!(s.decide(0.0, 2, &policy()), Some(8));
        let mut idle = AutoscalerState::default();
        idle.observe(QueueSample {
            at_secs: 0.0,
            waiting: 0.0,
            running: 0.0,
        });
        assert_eq!(
            idle.decide(0.0, 1, &policy()),
            None,
            "stays at the floor of 1"
        );
    }

    #[test]
    fn no_samples_means_no_decision() {
        let mut s = AutoscalerState::default();
        assert_eq!(s.decide(100.0, 3, &policy()), None);
        s.observe(sample(0.0, 40.0));
        assert_eq!(
            s.decide(500.0, 3, &policy()),
            None,
            "samples older than the window are dropped"
        );
    }

    #[test]
    fn scale_down_waits_for_the_delay() {
        let p = policy();
        let mut s = AutoscalerState::default();
        s.observe(sample(0.0, 32.0));
        assert_eq!(s.decide(0.0, 1, &p), Some(8));
        // Load drops; within 300 s the earlier recommendation of 8 holds the replicas.
        let mut t = 0.0;
        while t < 290.0 {
            t += 15.0;
            s.observe(sample(t, 0.0));
            assert_eq!(s.decide(t, 8, &p), None, "at {t}s");
        }
        // After the delay the low recommendation wins.
        for _ in 0..6 {
            t += 15.0;
            s.observe(sample(t, 0.0));
        }
        assert_eq!(s.decide(t, 8, &p), Some(1));
    }

    #[test]
    fn scale_to_zero_only_when_idle() {
        let p = AutoscalerPolicy {
            floor: 0,
            scale_down_delay_secs: 0.0,
            ..policy()
        };
        let mut busy = AutoscalerState::default();
        busy.observe(QueueSample {
            at_secs: 0.0,
            waiting: 0.0,
            running: 2.0,
        });
        assert_eq!(
            busy.decide(0.0, 1, &p),
            None,
            "running requests keep one replica"
        );
        let mut idle = AutoscalerState::default();
        idle.observe(QueueSample {
            at_secs: 0.0,
            waiting: 0.0,
            running: 0.0,
        });
        assert_eq!(idle.decide(0.0, 1, &p), Some(0));
    }

    #[test]
    fn policy_from_spec() {
        let a: AutoscalingSpec = serde_yaml::from_str(
            "{minReplicas: 2, maxReplicas: 5, targetQueueDepth: 3, scaleToZero: false}",
        )
        .unwrap();
        let p = AutoscalerPolicy::from_spec(&a);
        assert_eq!(
            (p.floor, p.max, p.target_queue_depth, p.window_secs),
            (2, 5, 3.0, 60.0)
        );
    }

    #[test]
    fn parses_prometheus_text() {
        let text = "# HELP moe:num_requests_waiting Requests waiting\n\
                    # TYPE moe:num_requests_waiting gauge\n\
                    moe:num_requests_waiting{model_name=\"qwen\"} 3\n\
                    moe:num_requests_waiting{model_name=\"other\",x=\"}\"} 2.5\n\
                    moe:num_requests_waiting_total 99\n\
                    moe:num_requests_running 4 1700000000\n";
        assert_eq!(sum_metric(text, "moe:num_requests_waiting"), Some(5.5));
        assert_eq!(sum_metric(text, "moe:num_requests_running"), Some(4.0));
        assert_eq!(sum_metric(text, "moe:missing"), None);
        assert_eq!(
            sum_metric("moe:num_requests_waiting NaN", "moe:num_requests_waiting"),
            None
        );
    }
}
