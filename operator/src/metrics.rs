//! The operator's own Prometheus metrics, served on `/metrics`.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    pub reconciliations: IntCounterVec,
    pub reconcile_duration: HistogramVec,
    pub is_leader: IntGauge,
    pub scale_events: IntCounterVec,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let reconciliations = IntCounterVec::new(
            Opts::new(
                "moe_operator_reconciliations_total",
                "Reconciliations by result",
            ),
            &["result"],
        )?;
        let reconcile_duration = HistogramVec::new(
            HistogramOpts::new(
                "moe_operator_reconcile_duration_seconds",
                "Reconcile latency",
            )
            .buckets(vec![0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            &["result"],
        )?;
        let is_leader = IntGauge::new(
            "moe_operator_is_leader",
            "1 while this replica holds the leader lease",
        )?;
        let scale_events = IntCounterVec::new(
            Opts::new(
                "moe_operator_autoscaler_scale_events_total",
                "Builtin autoscaler replica changes",
            ),
            &["direction"],
        )?;
        registry.register(Box::new(reconciliations.clone()))?;
        registry.register(Box::new(reconcile_duration.clone()))?;
        registry.register(Box::new(is_leader.clone()))?;
        registry.register(Box::new(scale_events.clone()))?;
        Ok(Self {
            registry,
            reconciliations,
            reconcile_duration,
            is_leader,
            scale_events,
        })
    }

    pub fn render(&self) -> Result<String, prometheus::Error> {
        TextEncoder::new().encode_to_string(&self.registry.gather())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_registered_metrics() {
        let m = Metrics::new().unwrap();
        m.reconciliations.with_label_values(&["ok"]).inc();
        m.is_leader.set(1);
        let text = m.render().unwrap();
        assert!(
            text.contains("moe_operator_reconciliations_total{result=\"ok\"} 1"),
            "{text}"
        );
        assert!(text.contains("moe_operator_is_leader 1"));
    }
}
