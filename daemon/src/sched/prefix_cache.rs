//! Prefix cache: a small LRU of sequence caches keyed by block-aligned token prefixes. A new sequence
//! starts from a clone of the longest cached prefix it shares (a clone shares the KV blocks, it copies
//! nothing), so shared prompt prefixes (system prompts, few-shot examples, the n choices of one request)
//! are computed once. Entries hold only full blocks, which are never written again. The scheduler evicts
//! entries when it needs their blocks. Models with linear-attention layers do not use it: their
//! per-sequence recurrent state summarises the whole sequence and cannot be cut back to a prefix
//! (snapshots at block boundaries would cost the state's size per block; not done).
use crate::engine::kv::BLOCK;

pub struct PrefixCache<C> {
    /// Most recently used last.
    entries: Vec<(Vec<u32>, C)>,
    max_entries: usize,
    /// Positions held by all entries together (they occupy KV memory like running sequences).
    max_tokens: usize,
}

impl<C: Clone> PrefixCache<C> {
    pub fn new(max_entries: usize, max_tokens: usize) -> Self {
        Self {
            entries: Vec::new(),
            max_entries,
            max_tokens,
        }
    }

    fn tokens(&self) -> usize {
        self.entries.iter().map(|(k, _)| k.len()).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Longest block-aligned prefix of `prompt` that is cached, leaving at least one prompt token to
    /// compute (the step that yields the first logits). Returns (cache truncated by the caller, length).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(C, usize)> {
        let limit = prompt.len().saturating_sub(1) / BLOCK * BLOCK;
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, (key, _))| {
                let common = key.iter().zip(prompt).take_while(|(a, b)| a == b).count();
                (i, (common / BLOCK * BLOCK).min(limit))
            })
            .max_by_key(|&(_, len)| len)?;
        if len == 0 {
            return None;
        }
        let entry = self.entries.remove(best);
        let cache = entry.1.clone();
        self.entries.push(entry);
        Some((cache, len))
    }

    /// Drops the least recently used entry (its blocks are freed unless a sequence shares them).
    pub fn evict_lru(&mut self) -> Option<C> {
        (!self.entries.is_empty()).then(|| self.entries.remove(0).1)
    }

    /// Whether inserting `prompt`'s aligned prefix would add anything.
    pub fn would_store(&self, prompt: &[u32]) -> bool {
        let aligned = prompt.len() / BLOCK * BLOCK;
        self.max_entries > 0
            && aligned > 0
            && aligned <= self.max_tokens
            && !self
                .entries
                .iter()
                .any(|(k, _)| k.len() >= aligned && k[..aligned] == prompt[..aligned])
    }

    /// Stores `cache` (already truncated to `key.len()` positions) under `key`, evicting least
    /// recently used entries to stay within both limits; entries that are prefixes of `key` go too.
    pub fn insert(&mut self, key: Vec<u32>, cache: C) {
        if self.max_entries == 0 || key.len() > self.max_tokens {
            return;
        }
        self.entries
            .retain(|(k, _)| !(k.len() <= key.len() && key[..k.len()] == k[..]));
        while !self.entries.is_empty()
            && (self.entries.len() >= self.max_entries
                || self.tokens() + key.len() > self.max_tokens)
        {
            self.entries.remove(0);
        }
        self.entries.push((key, cache));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_longest_aligned_prefix_and_keeps_one_token_to_compute() {
        let mut pc = PrefixCache::new(4, 1000);
        let a: Vec<u32> = (0..40).collect();
        assert!(pc.would_store(&a));
        pc.insert(a[..32].to_vec(), "a32");
        assert!(!pc.would_store(&a[..35]));
        let mut b = a.clone();
        b[20] = 999;
        assert_eq!(pc.lookup(&b), Some(("a32", 16)));
        assert_eq!(pc.lookup(&a), Some(("a32", 32)));
        // A prompt that equals the key exactly must still compute its last token.
        assert_eq!(pc.lookup(&a[..32]), Some(("a32", 16)));
        assert_eq!(pc.lookup(&[7, 7, 7]), None);
    }

    #[test]
    fn evicts_least_recently_used_and_redundant_prefixes() {
        let mut pc = PrefixCache::new(2, 1000);
        let k = |s: u32| (s..s + 16).collect::<Vec<u32>>();
        pc.insert(k(0), 0);
        pc.insert(k(100), 1);
        let _ = pc.lookup(&[k(0), vec![5]].concat()); // touch 0
        pc.insert(k(200), 2); // evicts 1
        assert!(pc.lookup(&[k(100), vec![5]].concat()).is_none());
        let longer: Vec<u32> = (0..32).collect();
        pc.insert(longer.clone(), 3); // replaces k(0), its prefix
        assert_eq!(pc.len(), 2);
        assert_eq!(pc.lookup(&[longer, vec![1]].concat()), Some((3, 32)));
    }

    #[test]
    fn token_budget_evicts_and_refuses_oversized_prefixes() {
        let mut pc = PrefixCache::new(8, 48);
        let k = |s: u32, n: u32| (s..s + n).collect::<Vec<u32>>();
        pc.insert(k(0, 32), 0);
        pc.insert(k(100, 16), 1);
        pc.insert(k(200, 32), 2); // 32 + 16 + 32 > 48: the oldest goes
        assert_eq!(pc.len(), 2);
        assert!(pc.lookup(&[k(0, 32), vec![1]].concat()).is_none());
        assert!(!pc.would_store(&k(300, 64)));
        pc.insert(k(300, 64), 3);
        assert_eq!(pc.len(), 2);
    }
}
