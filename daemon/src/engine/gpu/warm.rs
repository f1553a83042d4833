//! Warm-up at load: one long prompt and one decode step through the CUDA backend before the first
//! request, so that request does not pay the one-time costs: cuBLAS's heuristics for each new GEMM
//! shape, the stream-ordered pool growing to a long step's scratch (which `keep_pool_memory` then
//! keeps), the large step buffers, the expert stream's first chunks, lazily loaded kernels and the
//! decode step's CUDA graphs. The prompt's KV blocks come from the engine's block pool and go back
//! to it; nothing it routes is recorded (placement statistics stay those of real requests).
use crate::engine::{gpu_seq_inputs, reserve_batch, Engine, SeqInput, StepTimes};
use std::time::Instant;

impl Engine {
    /// Runs a `tokens`-position prompt (capped by what the KV cache holds) and one decode step on the
    /// GPU. Models with recurrent state (linear attention) and CPU engines skip it. A failure is only
    /// logged: the first request then pays the costs instead.
    pub fn warm_up_gpu(&self, tokens: usize) {
        let Some(g) = &self.gpu else { return };
        // A tensor-parallel step must run on every rank (the group's forward); the warm-up below drives
        // rank 0's model alone, whose all-reduces would wait for ranks that never run.
        if g.hybrid.is_some() || tokens == 0 || self.tp.is_some() {
            return;
        }
        // leave a block's worth for the decode step
        let tokens = tokens.min(
            g.kv_positions()
                .saturating_sub(2 * crate::engine::kv::BLOCK),
        );
        if tokens == 0 {
            return;
        }
        let t = Instant::now();
        match self.warm_up_steps(g, tokens) {
            Ok(()) => {
                let msg = format!(
                    "GPU warm-up: a {tokens}-token prompt and a decode step in {:.2} s",
                    t.elapsed().as_secs_f64()
                );
                tracing::info!("{msg}");
                eprintln!("{msg}");
            }
            Err(e) => tracing::warn!("GPU warm-up skipped: {e:#}"),
        }
    }

    fn warm_up_steps(&self, g: &super::GpuModel, tokens: usize) -> anyhow::Result<()> {
        let vocab = self.model.config.vocab_size.max(1) as u64;
        // spread ids (so routing reaches many experts, as a real prompt's does)
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let prompt: Vec<u32> = (0..tokens)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % vocab) as u32
            })
            .collect();
        let mut cache = self.new_cache();
        for chunk in [&prompt[..], &prompt[..1]] {
            let mut batch = [SeqInput {
                cache: &mut cache,
                tokens: chunk,
            }];
            reserve_batch(&mut batch)?;
            let mut inputs = gpu_seq_inputs(&mut batch);
            let mut times = StepTimes::default();
            g.forward(
                &self.model,
                self.cpu_pool.as_deref(),
                &mut inputs,
                &mut times,
                |_, _| {},
            )?;
            drop(inputs);
            for s in batch.iter_mut() {
                s.cache.advance(s.tokens.len());
            }
        }
        Ok(())
    }
}
