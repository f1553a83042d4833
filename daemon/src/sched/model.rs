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
    type Cache: Clone + Send;
    fn new_cache(&self) -> Self::Cache;
    fn cache_len(cache: &Self::Cache) -> usize;
    fn truncate(cache: &mut Self::Cache, len: usize);
    fn vocab_size(&self) -> usize;
    fn max_positions(&self) -> usize;
    /// One step: each entry's cache is extended by its tokens; returns each entry's last-position logits.
    fn forward(&self, batch: Vec<(&mut Self::Cache, &[u32])>) -> Result<Vec<Vec<f32>>, String>;
    /// Figures of the step just run, where the backend measures them (the hook `/metrics` reads).
    fn last_step_stats(&self) -> Option<StepStats> {
        None
    }
}

impl StepModel for Engine {
    type Cache = SeqCache;

    fn new_cache(&self) -> SeqCache {
        Engine::new_cache(self)
    }

    fn cache_len(cache: &SeqCache) -> usize {
        cache.len()
    }

    fn truncate(cache: &mut SeqCache, len: usize) {
        cache.truncate(len)
    }

    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn max_positions(&self) -> usize {
        self.config().max_position_embeddings
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
}
