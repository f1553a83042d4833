//! Warm-up at load: one long prompt, one decode step and (when steps split their DRAM experts between
//! the GPU and the CPU, `split`) one 512-token prompt through the CUDA backend before the first request,
//! so that request does not pay the one-time costs: cuBLAS's heuristics for each new GEMM
//! shape, the stream-ordered pool growing to a long step's scratch (which `keep_pool_memory` then
//! keeps), the large step buffers, the expert stream's first chunks, lazily loaded kernels and the
//! decode step's CUDA graphs.
//!
//! The steps go through the engine's step dispatch, as a request's do: a tensor-parallel group warms
//! every rank together, meeting in its all-reduces. Nothing is left behind: the prompt's KV blocks
//! come from the engine's block pool and go back to it when its cache drops, nothing it routes is
//! recorded (placement statistics and live re-placement see real requests only), and the last
//! step's timings stay those of the last request.
use crate::engine::{gpu_seq_inputs, reserve_batch, Engine, SeqInput, StepTimes};
use std::time::Instant;

impl Engine {
    /// Runs the warm-up (see [`Engine::warm_up`]) and logs what it did. A failure is only logged: the
    /// first request then pays the costs instead.
    pub fn warm_up_gpu(&self, tokens: usize) {
        let t = Instant::now();
        match self.warm_up(tokens) {
            Ok(0) => {}
            Ok(tokens) => {
                let msg = format!(
                    "GPU warm-up: a {tokens}-token prompt and a decode step in {:.2} s",
                    t.elapsed().as_secs_f64()
                );
                tracing::info!("{msg}");
                eprintln!("{msg}");
                // the warm-up's host buffers were freed on this thread's malloc arena
                crate::engine::heap::release_freed_heap("GPU warm-up");
            }
            Err(e) => tracing::warn!("GPU warm-up skipped: {e:#}"),
        }
    }

    /// A `tokens`-position prompt (capped by what the KV cache holds, leaving room for the decode
    /// step) and one decode step on the GPU. Returns the prompt's length; 0 when skipped (CPU
    /// engines, models with recurrent state, no room).
    pub fn warm_up(&self, tokens: usize) -> anyhow::Result<usize> {
        let Some(g) = &self.gpu else { return Ok(0) };
        if g.hybrid.is_some() || tokens == 0 {
            return Ok(0);
        }
        let tokens = tokens.min(
            g.kv_positions()
                .saturating_sub(2 * crate::engine::kv::BLOCK),
        );
        if tokens == 0 {
            return Ok(0);
        }
        let ran = self.pool.install(|| self.warm_up_steps(g, tokens));
        let timed_out = self.forget_hand_off_timeouts()?;
        ran?;
        anyhow::ensure!(
            !timed_out,
            "a GPU wait for the CPU experts timed out in the warm-up (its results are discarded)"
        );
        Ok(tokens)
    }

    /// Once every GPU is idle, clears the hand-offs' flags and reports whether a GPU wait for the CPU
    /// experts timed out. A step reports such a timeout of the step before it; a warm-up's results
    /// are discarded, so the first request must not fail for one.
    fn forget_hand_off_timeouts(&self) -> anyhow::Result<bool> {
        let mut timed_out = false;
        for g in self.gpus() {
            g.dev.ctx.bind_to_thread()?;
            g.dev.stream.synchronize()?;
            let sets = g.buffers.lock().unwrap_or_else(|e| e.into_inner());
            for b in [&sets.decode, &sets.large].into_iter().flatten() {
                timed_out |= b.hand.port.reset();
            }
        }
        if let Some(g) = &self.gpu {
            g.dev.ctx.bind_to_thread()?;
        }
        Ok(timed_out)
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
            self.warm_up_step(g, &mut cache, chunk)?;
        }
        drop(cache);
        // A prompt that splits its DRAM experts between the GPU and the CPU (`split`): its shapes'
        // heuristics, and the split's first measured rates.
        let split = split_warm_up_len(g.split_min_rows, g.prefill_threshold, tokens);
        if let Some(len) = split {
            self.warm_up_step(g, &mut self.new_cache(), &prompt[..len])?;
        }
        Ok(())
    }

    fn warm_up_step(
        &self,
        g: &super::GpuModel,
        cache: &mut crate::engine::SeqCache,
        tokens: &[u32],
    ) -> anyhow::Result<()> {
        let mut batch = [SeqInput { cache, tokens }];
        reserve_batch(&mut batch)?;
        let mut inputs = gpu_seq_inputs(&mut batch);
        let mut times = StepTimes::default();
        self.dispatch_gpu_step(g, &mut inputs, &mut times, |_, _| {})?;
        drop(inputs);
        for s in batch.iter_mut() {
            s.cache.advance(s.tokens.len());
        }
        Ok(())
    }
}

/// Tokens of the warm-up's split prompt: 512 (a typical short prompt), within the split's range and the
/// warm-up's room; `None` when steps never split.
fn split_warm_up_len(min_rows: usize, threshold: usize, room: usize) -> Option<usize> {
    let len = 512.min(threshold.saturating_sub(1)).min(room);
    (min_rows > 0 && len >= min_rows).then_some(len)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_split_warm_up_prompt_lies_in_the_split_range() {
        use super::split_warm_up_len as len;
        assert_eq!(len(128, 1024, 8192), Some(512));
        assert_eq!(len(128, 300, 8192), Some(299));
        assert_eq!(len(128, 1024, 200), Some(200), "the warm-up's room");
        assert_eq!(len(0, 1024, 8192), None, "split off");
        assert_eq!(
            len(128, 100, 8192),
            None,
            "threshold below the split's start"
        );
    }
}
