//! Prometheus metrics (`/metrics`), named in vLLM's `prefix:name` style with the `moe:` prefix.
//! The engine thread and the HTTP handlers update them; `render` writes the text exposition format.
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntGauge, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub num_waiting: IntGauge,
    pub num_running: IntGauge,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub prefix_cache_hit_tokens: IntCounter,
    pub requests_finished: IntCounter,
    pub requests_aborted: IntCounter,
    pub requests_rejected: IntCounter,
    pub preemptions: IntCounter,
    pub ttft_seconds: Histogram,
    pub inter_token_seconds: Histogram,
    pub e2e_seconds: Histogram,
    pub queue_seconds: Histogram,
    pub step_seconds: Histogram,
    pub kv_cache_usage: Gauge,
    /// Time the CPU spends on DRAM-resident experts per step (fed by the engine's stats hook).
    pub cpu_expert_seconds: Histogram,
    /// Share of expert activations served by GPU-resident experts (fed by the engine's stats hook).
    pub gpu_expert_hit_ratio: Gauge,
    /// Per MoE layer, the same share over the recent (decayed) traffic (live re-placement).
    pub gpu_expert_hit_ratio_layer: GaugeVec,
    /// Experts swapped between DRAM and the GPU by live re-placement, in all and over the last minute.
    pub expert_moves: IntCounter,
    pub expert_moves_per_minute: Gauge,
    /// Time to compute one constrained sequence's token mask (grammar step), per sampled token.
    pub structured_mask_seconds: Histogram,
    /// Time the sampler waited for a mask: zero when the mask, computed on a worker during the
    /// forward pass, was ready in time; the remainder of its computation when it was late.
    pub structured_mask_wait_seconds: Histogram,
    /// Masks computed during the forward pass (on a mask worker) and on the engine thread after it.
    pub structured_masks_overlapped: IntCounter,
    pub structured_masks_inline: IntCounter,
    /// Time to compile a request's grammar (JSON schema, tool-call grammar), off the engine thread.
    pub structured_compile_seconds: Histogram,
}

/// Mask steps are normally tens of microseconds; llguidance's fuel limits cap one at ~10 ms.
const MASK_BUCKETS: &[f64] = &[
    0.000_001, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
    0.01, 0.025, 0.05, 0.1,
];

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m;
                registry.register(Box::new(m.clone()))?;
                m
            }};
        }
        let hist = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
        };
        Ok(Self {
            num_waiting: reg!(IntGauge::with_opts(Opts::new(
                "moe:num_requests_waiting",
                "Requests waiting to be scheduled"
            ))?),
            num_running: reg!(IntGauge::new(
                "moe:num_requests_running",
                "Requests running on the engine"
            )?),
            prompt_tokens: reg!(IntCounter::new(
                "moe:prompt_tokens_total",
                "Prompt tokens processed"
            )?),
            generation_tokens: reg!(IntCounter::new(
                "moe:generation_tokens_total",
                "Tokens generated"
            )?),
            prefix_cache_hit_tokens: reg!(IntCounter::new(
                "moe:prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache instead of computed"
            )?),
            requests_finished: reg!(IntCounter::new(
                "moe:request_success_total",
                "Requests that finished"
            )?),
            requests_aborted: reg!(IntCounter::new(
                "moe:request_aborted_total",
                "Requests dropped by a disconnect, stop string or timeout before finishing"
            )?),
            requests_rejected: reg!(IntCounter::new(
                "moe:request_rejected_total",
                "Requests refused because the queue was full"
            )?),
            preemptions: reg!(IntCounter::new(
                "moe:num_preemptions_total",
                "Running sequences preempted because the KV cache was full (recomputed later)"
            )?),
            ttft_seconds: reg!(hist(
                "moe:time_to_first_token_seconds",
                "Time to first token"
            )?),
            inter_token_seconds: reg!(hist(
                "moe:inter_token_latency_seconds",
                "Time between output tokens"
            )?),
            e2e_seconds: reg!(hist(
                "moe:e2e_request_latency_seconds",
                "Request latency, arrival to finish"
            )?),
            queue_seconds: reg!(hist(
                "moe:request_queue_time_seconds",
                "Time spent waiting for admission"
            )?),
            step_seconds: reg!(hist(
                "moe:engine_step_seconds",
                "Duration of one engine step"
            )?),
            kv_cache_usage: reg!(Gauge::new(
                "moe:kv_cache_usage_perc",
                "Fraction of the KV blocks in use by sequences and cached prefixes (1 = full)"
            )?),
            cpu_expert_seconds: reg!(hist(
                "moe:cpu_expert_seconds_per_step",
                "CPU time on DRAM-resident experts per engine step"
            )?),
            gpu_expert_hit_ratio: reg!(Gauge::new(
                "moe:gpu_expert_hit_ratio",
                "Share of routed-expert activations served by GPU-resident experts"
            )?),
            gpu_expert_hit_ratio_layer: reg!(GaugeVec::new(
                Opts::new(
                    "moe:gpu_expert_hit_ratio_layer",
                    "Per MoE layer: share of recent routed-expert activations served by GPU experts (live re-placement)"
                ),
                &["layer"]
            )?),
            expert_moves: reg!(IntCounter::new(
                "moe:expert_moves_total",
                "Experts moved between DRAM and the GPU while serving (live re-placement)"
            )?),
            expert_moves_per_minute: reg!(Gauge::new(
                "moe:expert_moves_per_minute",
                "Experts moved between DRAM and the GPU in the last minute (live re-placement)"
            )?),
            structured_mask_seconds: reg!(Histogram::with_opts(
                HistogramOpts::new(
                    "moe:structured_output_mask_seconds",
                    "Time to compute one constrained token mask (JSON schema / tool-call grammar)"
                )
                .buckets(MASK_BUCKETS.to_vec())
            )?),
            structured_mask_wait_seconds: reg!(Histogram::with_opts(
                HistogramOpts::new(
                    "moe:structured_output_mask_wait_seconds",
                    "Time sampling waited for a token mask computed during the forward pass"
                )
                .buckets(MASK_BUCKETS.to_vec())
            )?),
            structured_masks_overlapped: reg!(IntCounter::new(
                "moe:structured_output_masks_overlapped_total",
                "Token masks computed on a mask worker while the forward pass ran"
            )?),
            structured_masks_inline: reg!(IntCounter::new(
                "moe:structured_output_masks_inline_total",
                "Token masks computed on the engine thread after the forward pass"
            )?),
            structured_compile_seconds: reg!(hist(
                "moe:structured_output_compile_seconds",
                "Time to compile a request's output grammar"
            )?),
            registry,
        })
    }

    /// Text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            return format!("# encoding failed: {e}\n");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn exposes_the_names_dashboards_use() {
        let m = super::Metrics::new().unwrap();
        m.num_waiting.set(3);
        m.ttft_seconds.observe(0.05);
        let text = m.render();
        for name in [
            "moe:num_requests_waiting 3",
            "moe:num_requests_running",
            "moe:prompt_tokens_total",
            "moe:generation_tokens_total",
            "moe:time_to_first_token_seconds_bucket",
            "moe:inter_token_latency_seconds",
            "moe:e2e_request_latency_seconds",
            "moe:kv_cache_usage_perc",
            "moe:num_preemptions_total",
            "moe:cpu_expert_seconds_per_step",
            "moe:gpu_expert_hit_ratio",
            "moe:structured_output_mask_seconds",
            "moe:structured_output_compile_seconds",
        ] {
            assert!(text.contains(name), "missing {name}");
        }
    }
}
