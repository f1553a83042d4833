//! What the scheduler needs from a model: per-sequence caches and one batched step. The real
//! [`Engine`] implements it; tests use the scripted model in `scripted.rs`.
use crate::engine::{Engine, SeqCache, SeqInput};

/// Engine-side figures of the last step, for `/metrics` (CPU expert time, GPU share of expert hits).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Time spent on DRAM-resident (CPU) experts during the step.
    pub cpu_expert_seconds: f64,
    /// Routed-expert activations served by GPU-resident experts, and in all.
    pub expert_hits_gpu: u64,
    pub expert_hits_total: u64,
}

pub trait StepModel: Send + 'static {
    /// An empty cache drawing on the model's KV blocks.
    fn new_cache(&self) -> SeqCache;
    fn vocab_size(&self) -> usize;
    /// Longest sequence (prompt + output) a step may reach: the model's context, at most the KV cache.
    fn max_positions(&self) -> usize;
    /// [`Self::max_positions`] when steps write up to `step_tokens` positions of one sequence (models
    /// whose sliding-window layers hold a step's new KV blocks before giving back old ones need room
    /// for them).
    fn max_positions_with_steps(&self, step_tokens: usize) -> usize {
        let _ = step_tokens;
        self.max_positions()
    }
    /// Share of the KV blocks in use (running sequences and cached prefixes), 0 to 1.
    fn kv_usage(&self) -> f64;
    /// One step: each entry's cache is extended by its tokens (its blocks already reserved); returns
    /// each entry's last-position logits.
    fn forward(&self, batch: Vec<(&mut SeqCache, &[u32])>) -> Result<Vec<Vec<f32>>, String>;
    /// Figures of the step just run, where the backend measures them (the hook `/metrics` reads).
    fn last_step_stats(&self) -> Option<StepStats> {
        None
    }
    /// Live re-placement figures (per-layer GPU hit ratio, moves), where it runs.
    fn live_placement_stats(&self) -> Option<crate::engine::live::LiveStats> {
        None
    }
}

impl StepModel for Engine {
    fn new_cache(&self) -> SeqCache {
        Engine::new_cache(self)
    }

    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn max_positions(&self) -> usize {
        self.config()
            .max_position_embeddings
            .min(self.kv_capacity())
    }

    fn max_positions_with_steps(&self, step_tokens: usize) -> usize {
        self.config()
            .max_position_embeddings
            .min(self.kv_capacity_with_steps(step_tokens))
    }

    fn kv_usage(&self) -> f64 {
        Engine::kv_usage(self)
    }

    fn forward(&self, batch: Vec<(&mut SeqCache, &[u32])>) -> Result<Vec<Vec<f32>>, String> {
        let mut inputs: Vec<SeqInput<'_>> = batch
            .into_iter()
            .map(|(cache, tokens)| SeqInput { cache, tokens })
            .collect();
        Engine::forward(self, &mut inputs).map_err(|e| e.to_string())
    }

    fn last_step_stats(&self) -> Option<StepStats> {
        let t = self.last_step_times();
        Some(StepStats {
            cpu_expert_seconds: t.cpu_experts_s,
            expert_hits_gpu: t.gpu_expert_hits,
            expert_hits_total: t.expert_hits,
        })
    }

    fn live_placement_stats(&self) -> Option<crate::engine::live::LiveStats> {
        self.live_stats()
    }
}
