//! A scripted stand-in model for testing the serving stack without weights: given (trigger, reply)
//! token sequences, a sequence whose tokens contain a trigger is answered with that reply, token by token,
//! then `end_token`; anything else is answered with `end_token` at once. Its "KV cache" stores each
//! position's token id in real KV blocks, and every step reads the whole sequence back through the block
//! table, so batching, chunked prefill, prefix sharing, preemption and cancellation run through the real
//! scheduler and block manager, and a position read from the wrong block changes the answer. Used by the
//! scheduler tests and by `moe-daemon serve --scripted-replies` in the HTTP tests of the tool-call and
//! reasoning parsers, which need a model that emits those formats (SmolLM2-135M does not).
//!
//! With a sliding window ([`ScriptedModel::with_sliding_window`]) it has a second, windowed "layer" with
//! its own block table, as sliding-window models do (`engine::kv::layout`): each step also writes there
//! and checks that every query's window reads back the tokens the full table holds, so a block given
//! back too early, or reused while still in a window, fails the request.
use super::StepModel;
use crate::engine::kv::{
    blocks, slot, BlockCopy, BlockId, KvLayout, RowWidths, SeqCache, SharedBlockPool, BLOCK,
};
use std::sync::{Arc, Mutex};

/// What the scripted model answers, and its limits.
pub struct ScriptedReplies {
    pub replies: Vec<(Vec<u32>, Vec<u32>)>,
    pub end_token: u32,
    pub vocab: usize,
    pub max_positions: usize,
    /// KV capacity in positions (whole blocks).
    pub kv_cache_tokens: usize,
    /// Sleep per step, to stand in for compute time in tests of timing behaviour.
    pub step_delay: std::time::Duration,
    /// Reported as every step's engine figures (tests of the `/metrics` hook).
    pub step_stats: Option<super::StepStats>,
}

/// The "KV rows": one token id per slot, grown on demand.
#[derive(Default)]
struct TokenRows(Mutex<Vec<u32>>);

impl TokenRows {
    fn rows(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Marks slots never written, so reading one is visible.
const UNWRITTEN: u32 = u32::MAX;

impl BlockCopy for TokenRows {
    fn copy_block(&self, from: BlockId, to: BlockId) -> Result<(), String> {
        let mut rows = self.rows();
        let end = (from.max(to) as usize + 1) * BLOCK;
        if rows.len() < end {
            rows.resize(end, UNWRITTEN);
        }
        let (f, t) = (from as usize * BLOCK, to as usize * BLOCK);
        rows.copy_within(f..f + BLOCK, t);
        Ok(())
    }
}

pub struct ScriptedModel {
    spec: ScriptedReplies,
    pool: SharedBlockPool,
    rows: Arc<TokenRows>,
    /// The windowed second table's window, and the layout of the two tables.
    window: Option<(usize, KvLayout)>,
}

fn contains(hay: &[u32], needle: &[u32]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

impl ScriptedModel {
    pub fn new(spec: ScriptedReplies) -> Self {
        let rows = Arc::new(TokenRows::default());
        let pool = blocks::shared_pool(
            blocks::blocks_for(spec.kv_cache_tokens).max(1),
            rows.clone(),
        );
        Self {
            spec,
            pool,
            rows,
            window: None,
        }
    }

    /// A full "layer" and one that attends over the last `window` positions, each with its own block
    /// table in one pool of `kv_cache_tokens / BLOCK` blocks (the windowed table gives blocks back).
    pub fn with_sliding_window(spec: ScriptedReplies, window: usize) -> Self {
        let rows = Arc::new(TokenRows::default());
        let layout = KvLayout::grouped(&[None, Some(window)], &[RowWidths::default(); 2]);
        let pool = blocks::shared_grouped_pool(
            blocks::blocks_for(spec.kv_cache_tokens).max(1),
            rows.clone(),
            layout.group_windows(),
        );
        Self {
            spec,
            pool,
            rows,
            window: Some((window, layout)),
        }
    }

    /// Next token: the reply of the first trigger seen, continued after the longest reply prefix that
    /// the sequence already ends with.
    fn next_token(&self, seq: &[u32]) -> u32 {
        let end = self.spec.end_token;
        let Some((_, reply)) = self.spec.replies.iter().find(|(t, _)| contains(seq, t)) else {
            return end;
        };
        let done = (1..=reply.len())
            .rev()
            .find(|&k| seq.ends_with(&reply[..k]))
            .unwrap_or(0);
        reply.get(done).copied().unwrap_or(end)
    }

    /// Writes the chunk into its slots, then reads the whole sequence back through the block table.
    fn step_one(&self, cache: &mut SeqCache, tokens: &[u32]) -> Result<Vec<u32>, String> {
        let (pos0, end) = (cache.len(), cache.len() + tokens.len());
        if cache.capacity() < end {
            return Err(format!(
                "blocks cover {} positions, the step writes up to {end}",
                cache.capacity()
            ));
        }
        let mut rows = self.rows.rows();
        for table in cache.tables() {
            for (i, &t) in tokens.iter().enumerate() {
                let s = slot(table, pos0 + i);
                if rows.len() <= s {
                    rows.resize((s / BLOCK + 1) * BLOCK, UNWRITTEN);
                }
                rows[s] = t;
            }
        }
        let seq: Vec<u32> = (0..end).map(|p| rows[slot(cache.blocks(), p)]).collect();
        if let Some((w, _)) = &self.window {
            let windowed = cache.table(1);
            for q in pos0..end {
                for p in (q + 1).saturating_sub(*w)..=q {
                    let got = rows[slot(windowed, p)];
                    if got != seq[p] {
                        return Err(format!(
                            "windowed table: the query at {q} reads {got} at position {p}, not {}",
                            seq[p]
                        ));
                    }
                }
            }
        }
        drop(rows);
        cache.advance(tokens.len());
        Ok(seq)
    }
}

impl StepModel for ScriptedModel {
    fn new_cache(&self) -> SeqCache {
        SeqCache::new(self.pool.clone())
    }
    fn vocab_size(&self) -> usize {
        self.spec.vocab
    }
    fn max_positions(&self) -> usize {
        let pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        let held = match &self.window {
            Some((_, layout)) => layout.max_positions(pool.total()),
            None => pool.total() * BLOCK,
        };
        self.spec.max_positions.min(held)
    }
    fn kv_usage(&self) -> f64 {
        let pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.used() as f64 / pool.total().max(1) as f64
    }
    fn last_step_stats(&self) -> Option<super::StepStats> {
        self.spec.step_stats
    }
    fn forward(&self, batch: Vec<(&mut SeqCache, &[u32])>) -> Result<Vec<Vec<f32>>, String> {
        std::thread::sleep(self.spec.step_delay);
        let mut out = Vec::with_capacity(batch.len());
        for (cache, tokens) in batch {
            let seq = self.step_one(cache, tokens)?;
            let mut logits = vec![0f32; self.spec.vocab];
            if let Some(l) = logits.get_mut(self.next_token(&seq) as usize) {
                *l = 10.0;
            }
            out.push(logits);
        }
        Ok(out)
    }
}
