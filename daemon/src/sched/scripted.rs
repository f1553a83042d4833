//! A scripted stand-in model for testing the serving stack without weights: given (trigger, reply)
//! token sequences, a sequence whose tokens contain a trigger is answered with that reply, token by token,
//! then `end_token`; anything else is answered with `end_token` at once. Its "cache" is the token list, so
//! batching, chunked prefill, prefix reuse and cancellation run through the real scheduler. Used by the
//! scheduler tests and by `moe-daemon serve --scripted-replies` in the HTTP tests of the tool-call and
//! reasoning parsers, which need a model that emits those formats (SmolLM2-135M does not).
use super::StepModel;

pub struct ScriptedModel {
    pub replies: Vec<(Vec<u32>, Vec<u32>)>,
    pub end_token: u32,
    pub vocab: usize,
    pub max_positions: usize,
    /// Sleep per step, to stand in for compute time in tests of timing behaviour.
    pub step_delay: std::time::Duration,
    /// Reported as every step's engine figures (tests of the `/metrics` hook).
    pub step_stats: Option<super::StepStats>,
}

fn contains(hay: &[u32], needle: &[u32]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

impl ScriptedModel {
    /// Next token: the reply of the first trigger seen, continued after the longest reply prefix that
    /// the sequence already ends with.
    fn next_token(&self, seq: &[u32]) -> u32 {
        let Some((_, reply)) = self.replies.iter().find(|(t, _)| contains(seq, t)) else {
            return self.end_token;
        };
        let done = (1..=reply.len())
            .rev()
            .find(|&k| seq.ends_with(&reply[..k]))
            .unwrap_or(0);
        reply.get(done).copied().unwrap_or(self.end_token)
    }
}

impl StepModel for ScriptedModel {
    type Cache = Vec<u32>;

    fn new_cache(&self) -> Vec<u32> {
        Vec::new()
    }
    fn cache_len(cache: &Vec<u32>) -> usize {
        cache.len()
    }
    fn truncate(cache: &mut Vec<u32>, len: usize) {
        cache.truncate(len)
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn max_positions(&self) -> usize {
        self.max_positions
    }
    fn last_step_stats(&self) -> Option<super::StepStats> {
        self.step_stats
    }
    fn forward(&self, batch: Vec<(&mut Vec<u32>, &[u32])>) -> Result<Vec<Vec<f32>>, String> {
        std::thread::sleep(self.step_delay);
        Ok(batch
            .into_iter()
            .map(|(cache, tokens)| {
                cache.extend_from_slice(tokens);
                let mut logits = vec![0f32; self.vocab];
                let next = self.next_token(cache) as usize;
                if let Some(l) = logits.get_mut(next) {
                    *l = 10.0;
                }
                logits
            })
            .collect())
    }
}
