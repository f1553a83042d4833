//! KV block accounting, shared by both backends: a pool of fixed-size blocks of [`BLOCK`] positions with
//! reference counts, and per-sequence handles ([`SeqCache`]) holding a block table.
//!
//! Who decides what (vLLM's shape): the driver of the engine — the scheduler when serving, the caller in
//! `generate` / `bench` / tests — reserves every block a step will write *before* the step
//! ([`SeqCache::reserve`]), so the executor never discovers that memory ran out; when a reservation fails
//! the scheduler evicts cached prefixes or preempts a sequence. The executor only writes and reads rows
//! through the tables (and performs the copies that copy-on-write asked for).
//!
//! Sharing: cloning a [`SeqCache`] shares its blocks (reference counts), it never copies memory. Full
//! blocks are immutable once written, so shared full blocks are safe to read from any sequence. Only the
//! partial last block of a shared table can be written by two owners; the first reservation that will
//! append into such a block takes a fresh block and has the storage copy the old one into it
//! ([`BlockCopy`]) before anything is written.
//!
//! Sliding windows: a pool may serve several groups of layers ([`super::layout`]); a sequence then has
//! one block table per group. The tables of sliding-window groups give their blocks back as soon as no
//! later query can see them (before each reservation and after each step), so such a group holds about
//! one window per sequence however long the sequence grows. Given-back entries stay in the table (their
//! positions keep their index) but are never read: the attention of those layers starts inside the
//! window.
use super::layout::first_kept_position;
use super::recurrent::RecurrentState;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Positions per block. Also the granularity of prefix sharing.
pub const BLOCK: usize = 16;

/// Index of a block in the backend's KV storage.
pub type BlockId = u32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error(
        "KV cache is full: {needed} more blocks of {BLOCK} positions needed, {free} of {total} free"
    )]
    Full {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error("copying a shared KV block failed: {0}")]
    Copy(String),
}

/// The storage side of copy-on-write: copies every layer's rows of block `from` into block `to`.
pub trait BlockCopy: Send + Sync {
    fn copy_block(&self, from: BlockId, to: BlockId) -> Result<(), String>;
}

/// Reference-counted blocks. Free blocks are handed out lowest id first, so storage that grows on demand
/// (the CPU backend's) stays as compact as the peak number of blocks in use.
pub struct BlockPool {
    refs: Vec<u32>,
    free: BinaryHeap<Reverse<BlockId>>,
    storage: Arc<dyn BlockCopy>,
    /// Per group of layers: its sliding window (None: the group keeps every block).
    group_windows: Vec<Option<usize>>,
}

impl std::fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BlockPool({} of {} blocks used)",
            self.used(),
            self.total()
        )
    }
}

impl BlockPool {
    /// One group of layers that keeps every block.
    pub fn new(total_blocks: usize, storage: Arc<dyn BlockCopy>) -> Self {
        Self::grouped(total_blocks, storage, vec![None])
    }

    /// Groups of layers with their own block tables (`group_windows`: each group's sliding window).
    pub fn grouped(
        total_blocks: usize,
        storage: Arc<dyn BlockCopy>,
        group_windows: Vec<Option<usize>>,
    ) -> Self {
        let total = total_blocks.min(BlockId::MAX as usize);
        Self {
            refs: vec![0; total],
            free: (0..total as BlockId).map(Reverse).collect(),
            storage,
            group_windows,
        }
    }

    /// Block tables per sequence (groups of layers).
    pub fn groups(&self) -> usize {
        self.group_windows.len()
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total() - self.free()
    }

    /// Owners of block `id` (0: free).
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.refs[id as usize]
    }

    fn alloc(&mut self) -> Option<BlockId> {
        let Reverse(id) = self.free.pop()?;
        self.refs[id as usize] = 1;
        Some(id)
    }

    fn retain(&mut self, id: BlockId) {
        self.refs[id as usize] += 1;
    }

    fn release(&mut self, id: BlockId) {
        let r = &mut self.refs[id as usize];
        debug_assert!(*r > 0, "block {id} released more often than retained");
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push(Reverse(id));
        }
    }
}

/// The pool as sequences share it (one per engine).
pub type SharedBlockPool = Arc<Mutex<BlockPool>>;

pub fn shared_pool(total_blocks: usize, storage: Arc<dyn BlockCopy>) -> SharedBlockPool {
    Arc::new(Mutex::new(BlockPool::new(total_blocks, storage)))
}

/// A pool for groups of layers with their own tables (see [`BlockPool::grouped`]).
pub fn shared_grouped_pool(
    total_blocks: usize,
    storage: Arc<dyn BlockCopy>,
    group_windows: Vec<Option<usize>>,
) -> SharedBlockPool {
    Arc::new(Mutex::new(BlockPool::grouped(
        total_blocks,
        storage,
        group_windows,
    )))
}

fn lock(pool: &SharedBlockPool) -> MutexGuard<'_, BlockPool> {
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

/// Blocks needed to hold `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK)
}

/// One group's block table of one sequence.
#[derive(Debug, Clone, Default)]
struct Table {
    /// Position `p` lives in `blocks[p / BLOCK]`.
    blocks: Vec<BlockId>,
    /// Leading entries given back (sliding-window groups): they are no longer owned and never read.
    released: usize,
}

impl Table {
    fn held(&self) -> &[BlockId] {
        &self.blocks[self.released..]
    }
}

/// One sequence's KV: a block table per group of layers in the shared pool (one table for most
/// models) and the number of positions written, plus the recurrent state of linear-attention layers for
/// models that have them. Dropping it releases its blocks; cloning shares them (and copies the recurrent
/// state, which cannot be shared: it changes with every token).
#[derive(Debug)]
pub struct SeqCache {
    pool: SharedBlockPool,
    tables: Vec<Table>,
    /// Per table: its group's sliding window (None: keeps every block).
    windows: Vec<Option<usize>>,
    len: usize,
    recurrent: Option<Box<RecurrentState>>,
}

impl SeqCache {
    pub fn new(pool: SharedBlockPool) -> Self {
        let windows = lock(&pool).group_windows.clone();
        Self {
            pool,
            tables: vec![Table::default(); windows.len()],
            windows,
            len: 0,
            recurrent: None,
        }
    }

    /// A cache that also carries linear-attention state (starting at zero).
    pub fn with_recurrent(pool: SharedBlockPool, state: RecurrentState) -> Self {
        let mut cache = Self::new(pool);
        cache.recurrent = Some(Box::new(state));
        cache
    }

    /// The linear-attention state, for models with linear layers.
    pub fn recurrent(&self) -> Option<&RecurrentState> {
        self.recurrent.as_deref()
    }

    /// Every group's block table and the linear-attention state together (the executor reads one and
    /// writes the other in the same step).
    pub fn parts_mut(&mut self) -> (Vec<&[BlockId]>, Option<&mut RecurrentState>) {
        let tables = self.tables.iter().map(|t| t.blocks.as_slice()).collect();
        (tables, self.recurrent.as_deref_mut())
    }

    /// Whether a prefix of this cache can be kept and reused (false with a recurrent state, which
    /// summarises every position and cannot be cut back to a prefix).
    pub fn supports_prefix_reuse(&self) -> bool {
        self.recurrent.is_none()
    }

    /// Positions written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block table of the first group (the only one of models without sliding windows): position
    /// `p` lives in `blocks()[p / BLOCK]` at row `p % BLOCK`.
    pub fn blocks(&self) -> &[BlockId] {
        &self.tables[0].blocks
    }

    /// Group `g`'s block table. Entries of blocks that left a sliding window are stale (never read).
    pub fn table(&self, group: usize) -> &[BlockId] {
        &self.tables[group].blocks
    }

    /// Every group's block table, in group order.
    pub fn tables(&self) -> Vec<&[BlockId]> {
        self.tables.iter().map(|t| t.blocks.as_slice()).collect()
    }

    /// Blocks this sequence holds now, all groups together (shared ones included).
    pub fn held_blocks(&self) -> usize {
        self.tables.iter().map(|t| t.held().len()).sum()
    }

    /// Positions the reserved blocks can hold.
    pub fn capacity(&self) -> usize {
        self.tables[0].blocks.len() * BLOCK
    }

    /// Makes positions `0..positions` writable: gives back the blocks that left every sliding window,
    /// allocates missing blocks in every group and, where the partial last block is shared with another
    /// sequence, replaces it with a private copy. All or nothing: on failure no block was taken.
    pub fn reserve(&mut self, positions: usize) -> Result<(), KvError> {
        self.release_outside_windows();
        let mut pool = lock(&self.pool);
        let tail =
            (!self.len.is_multiple_of(BLOCK) && positions > self.len).then_some(self.len / BLOCK);
        let shared_tails: Vec<Option<usize>> = self
            .tables
            .iter()
            .map(|t| tail.filter(|&i| pool.ref_count(t.blocks[i]) > 1))
            .collect();
        let missing: Vec<usize> = self
            .tables
            .iter()
            .map(|t| blocks_for(positions).saturating_sub(t.blocks.len()))
            .collect();
        let needed = missing.iter().sum::<usize>() + shared_tails.iter().flatten().count();
        if needed > pool.free() {
            return Err(KvError::Full {
                needed,
                free: pool.free(),
                total: pool.total(),
            });
        }
        for (t, shared_tail) in self.tables.iter_mut().zip(shared_tails) {
            if let Some(i) = shared_tail {
                let (from, to) = (t.blocks[i], pool.alloc().expect("counted above"));
                if let Err(e) = pool.storage.copy_block(from, to) {
                    pool.release(to);
                    return Err(KvError::Copy(e));
                }
                pool.release(from);
                t.blocks[i] = to;
            }
        }
        for (t, missing) in self.tables.iter_mut().zip(missing) {
            for _ in 0..missing {
                let id = pool.alloc().expect("counted above");
                t.blocks.push(id);
            }
        }
        Ok(())
    }

    /// Gives back, in every sliding-window group, the blocks wholly before the window of the next
    /// query (kept back to a block boundary, see [`first_kept_position`]).
    fn release_outside_windows(&mut self) {
        let mut pool = None;
        for (t, w) in self.tables.iter_mut().zip(&self.windows) {
            let Some(w) = *w else { continue };
            let keep_from = (first_kept_position(w, self.len) / BLOCK).min(t.blocks.len());
            if keep_from > t.released {
                let pool = pool.get_or_insert_with(|| lock(&self.pool));
                for &id in &t.blocks[t.released..keep_from] {
                    pool.release(id);
                }
                t.released = keep_from;
            }
        }
    }

    /// Keeps positions `0..n` (no-op if it holds fewer) and releases the blocks past them. A cache that
    /// cannot resume at `n` starts over instead ([`Self::clear`]), and [`Self::len`] says so: one with a
    /// recurrent state (a prefix of it does not exist), or one whose sliding-window groups already gave
    /// back blocks that a query at `n` would read.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        let window_lost = self
            .tables
            .iter()
            .zip(&self.windows)
            .any(|(t, w)| w.is_some_and(|w| t.released * BLOCK > (n + 1).saturating_sub(w)));
        if self.recurrent.is_some() || window_lost {
            self.clear();
            return;
        }
        self.len = n;
        let keep = blocks_for(n);
        let mut pool = lock(&self.pool);
        for t in &mut self.tables {
            let from = keep.max(t.released);
            for &id in t.blocks.get(from..).unwrap_or(&[]) {
                pool.release(id);
            }
            t.blocks.truncate(keep);
            t.released = t.released.min(keep);
        }
    }

    /// Releases every block and zeroes the recurrent state (the sequence starts over).
    pub fn clear(&mut self) {
        self.len = 0;
        if let Some(r) = &mut self.recurrent {
            r.reset();
        }
        let mut pool = lock(&self.pool);
        for t in &mut self.tables {
            for &id in t.held() {
                pool.release(id);
            }
            *t = Table::default();
        }
    }

    /// Records that the step wrote `n` more positions (the executor calls this after writing them), and
    /// gives back what left the sliding windows.
    pub fn advance(&mut self, n: usize) {
        debug_assert!(
            self.len + n <= self.capacity(),
            "wrote past the reserved blocks"
        );
        self.len += n;
        self.release_outside_windows();
    }

    /// The pool this cache draws from.
    pub fn pool(&self) -> &SharedBlockPool {
        &self.pool
    }
}

impl Clone for SeqCache {
    /// Shares the blocks: no memory is copied; a later write into a shared partial block copies it.
    fn clone(&self) -> Self {
        let mut pool = lock(&self.pool);
        for t in &self.tables {
            for &id in t.held() {
                pool.retain(id);
            }
        }
        Self {
            pool: self.pool.clone(),
            tables: self.tables.clone(),
            windows: self.windows.clone(),
            len: self.len,
            recurrent: self.recurrent.clone(),
        }
    }
}

impl Drop for SeqCache {
    fn drop(&mut self) {
        let mut pool = lock(&self.pool);
        for t in &self.tables {
            for &id in t.held() {
                pool.release(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records copies instead of moving data.
    #[derive(Default)]
    struct Copies(Mutex<Vec<(BlockId, BlockId)>>);

    impl BlockCopy for Copies {
        fn copy_block(&self, from: BlockId, to: BlockId) -> Result<(), String> {
            self.0.lock().unwrap().push((from, to));
            Ok(())
        }
    }

    fn pool(blocks: usize) -> (SharedBlockPool, Arc<Copies>) {
        let copies = Arc::new(Copies::default());
        (shared_pool(blocks, copies.clone()), copies)
    }

    fn used(p: &SharedBlockPool) -> usize {
        lock(p).used()
    }

    #[test]
    fn reserve_takes_whole_blocks_all_or_nothing() {
        let (p, _) = pool(4);
        let mut a = SeqCache::new(p.clone());
        a.reserve(17).unwrap();
        assert_eq!((a.blocks().len(), a.capacity()), (2, 32));
        a.advance(17);
        let mut b = SeqCache::new(p.clone());
        let err = b.reserve(3 * BLOCK).unwrap_err();
        assert_eq!(
            err,
            KvError::Full {
                needed: 3,
                free: 2,
                total: 4
            }
        );
        assert_eq!(used(&p), 2, "a failed reservation takes nothing");
        b.reserve(2 * BLOCK).unwrap();
        drop(a);
        assert_eq!(used(&p), 2);
        drop(b);
        assert_eq!(used(&p), 0);
    }

    #[test]
    fn clones_share_blocks_and_copy_only_a_shared_partial_block_on_write() {
        let (p, copies) = pool(8);
        let mut a = SeqCache::new(p.clone());
        a.reserve(20).unwrap();
        a.advance(20); // one full block, one partial
        let mut b = a.clone();
        assert_eq!(used(&p), 2, "a clone copies nothing");
        assert_eq!(lock(&p).ref_count(a.blocks()[0]), 2);
        // Reading or re-reserving what is written needs no copy.
        b.reserve(20).unwrap();
        assert!(copies.0.lock().unwrap().is_empty());
        // Appending into the shared partial block: b gets its own copy of it; the full block stays shared.
        b.reserve(21).unwrap();
        assert_eq!(
            *copies.0.lock().unwrap(),
            vec![(a.blocks()[1], b.blocks()[1])]
        );
        assert_eq!(a.blocks()[0], b.blocks()[0]);
        assert_ne!(a.blocks()[1], b.blocks()[1]);
        assert_eq!(used(&p), 3);
        // a is now the partial block's only owner: it appends in place.
        a.reserve(21).unwrap();
        assert_eq!(copies.0.lock().unwrap().len(), 1);
        drop(b);
        assert_eq!(used(&p), 2);
    }

    #[test]
    fn recurrent_state_is_copied_by_clones_and_dropped_by_truncation() {
        use crate::model::hybrid::{LinearAttentionConfig, Mixer};
        let la = LinearAttentionConfig {
            num_heads: 1,
            head_dim: 2,
            conv_kernel: 2,
            lower_bound: None,
        };
        let (p, _) = pool(8);
        let mut a = SeqCache::with_recurrent(p.clone(), RecurrentState::new(&[Mixer::Linear], &la));
        assert!(!a.supports_prefix_reuse());
        a.reserve(2 * BLOCK).unwrap();
        a.advance(2 * BLOCK);
        a.parts_mut().1.unwrap().layer_mut(0).unwrap().matrix[0] = 3.0;
        let mut b = a.clone();
        b.parts_mut().1.unwrap().layer_mut(0).unwrap().matrix[0] = 5.0;
        let first = |c: &SeqCache| {
            let mut r = c.recurrent().unwrap().clone();
            r.layer_mut(0).unwrap().matrix[0]
        };
        assert_eq!((first(&a), first(&b)), (3.0, 5.0), "a clone owns its state");
        // A prefix of a recurrent state does not exist: truncation starts the sequence over.
        a.truncate(BLOCK);
        assert_eq!((a.len(), a.blocks().len(), first(&a)), (0, 0, 0.0));
        assert_eq!(used(&p), 2, "b still holds its blocks");
        let (plain, _) = pool(2);
        assert!(SeqCache::new(plain).supports_prefix_reuse());
    }

    /// Group 0 keeps everything, group 1 slides over 20 positions.
    fn sliding_pool(blocks: usize) -> SharedBlockPool {
        shared_grouped_pool(blocks, Arc::new(Copies::default()), vec![None, Some(20)])
    }

    #[test]
    fn sliding_groups_give_back_blocks_that_left_the_window() {
        let p = sliding_pool(64);
        let mut a = SeqCache::new(p.clone());
        // Decode one position at a time up to 200: the full group grows, the sliding one stays small.
        let mut most_sliding = 0;
        for len in 1..=200 {
            a.reserve(len).unwrap();
            a.advance(1);
            most_sliding = most_sliding.max(a.held_blocks() - a.table(0).len());
        }
        assert_eq!(a.table(0).len(), 13);
        assert_eq!(a.table(1).len(), 13, "tables keep their positions' indices");
        // Blocks 0..10 left the window of a query at 200 (first kept: 192 - 19 = 173, block 10).
        assert_eq!(a.held_blocks(), 13 + 3);
        assert_eq!(used(&p), 16);
        assert!(most_sliding <= 3, "{most_sliding}");
        // The held sliding blocks are the table's last ones, and the window's positions are in them.
        let window_blocks: Vec<_> = (180..200).map(|p| a.table(1)[p / BLOCK]).collect();
        assert!(window_blocks.iter().all(|b| a.table(1)[10..].contains(b)));
        drop(a);
        assert_eq!(used(&p), 0, "dropping gives back exactly what is held");
    }

    #[test]
    fn clones_and_prefixes_of_sliding_tables() {
        let p = sliding_pool(64);
        let mut a = SeqCache::new(p.clone());
        a.reserve(100).unwrap();
        a.advance(100); // full: 7 blocks; sliding: first kept 96 - 19 = 77, blocks 4..7
        assert_eq!(a.held_blocks(), 7 + 3);
        let b = a.clone();
        assert_eq!(used(&p), 10, "a clone shares only the held blocks");
        // Cut back to the block boundary the window was kept for: it can resume there.
        let mut c = a.clone();
        c.truncate(96);
        assert_eq!((c.len(), c.table(0).len(), c.table(1).len()), (96, 6, 6));
        // Cut back further than the window reaches: the sliding rows a query at 40 needs are gone,
        // so the cache starts over rather than resume with holes.
        let mut d = b.clone();
        d.truncate(40);
        assert_eq!((d.len(), d.held_blocks()), (0, 0));
        drop((a, b, c, d));
        assert_eq!(used(&p), 0);
    }

    #[test]
    fn reservations_count_every_group_and_a_full_pool_takes_nothing() {
        let p = sliding_pool(5);
        let mut a = SeqCache::new(p.clone());
        a.reserve(2 * BLOCK).unwrap(); // 2 blocks in each group
        assert_eq!(used(&p), 4);
        a.advance(2 * BLOCK); // the window (20) reaches back into block 0: nothing given back yet
        assert_eq!(used(&p), 4);
        let err = a.reserve(3 * BLOCK + 1).unwrap_err();
        assert_eq!(
            err,
            KvError::Full {
                needed: 4,
                free: 1,
                total: 5
            }
        );
        assert_eq!(used(&p), 4, "a failed reservation takes nothing");
    }

    #[test]
    fn truncate_and_clear_release_blocks() {
        let (p, _) = pool(8);
        let mut a = SeqCache::new(p.clone());
        a.reserve(5 * BLOCK).unwrap();
        a.advance(5 * BLOCK);
        let keep = a.clone();
        a.truncate(BLOCK + 1);
        assert_eq!((a.len(), a.blocks().len()), (BLOCK + 1, 2));
        assert_eq!(used(&p), 5, "the clone still holds all five");
        drop(keep);
        assert_eq!(used(&p), 2);
        a.clear();
        assert_eq!((a.len(), used(&p)), (0, 0));
        // Freed blocks come back lowest first (CPU storage stays compact).
        a.reserve(BLOCK).unwrap();
        assert_eq!(a.blocks(), &[0]);
    }
}
