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
    pub fn new(total_blocks: usize, storage: Arc<dyn BlockCopy>) -> Self {
        let total = total_blocks.min(BlockId::MAX as usize);
        Self {
            refs: vec![0; total],
            free: (0..total as BlockId).map(Reverse).collect(),
            storage,
        }
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

fn lock(pool: &SharedBlockPool) -> MutexGuard<'_, BlockPool> {
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

/// Blocks needed to hold `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK)
}

/// One sequence's KV: a block table in the shared pool and the number of positions written, plus the
/// recurrent state of linear-attention layers for models that have them. Dropping it releases its
/// blocks; cloning shares them (and copies the recurrent state, which cannot be shared: it changes with
/// every token).
#[derive(Debug)]
pub struct SeqCache {
    pool: SharedBlockPool,
    blocks: Vec<BlockId>,
    len: usize,
    recurrent: Option<Box<RecurrentState>>,
}

impl SeqCache {
    pub fn new(pool: SharedBlockPool) -> Self {
        Self {
            pool,
            blocks: Vec::new(),
            len: 0,
            recurrent: None,
        }
    }

    /// A cache that also carries linear-attention state (starting at zero).
    pub fn with_recurrent(pool: SharedBlockPool, state: RecurrentState) -> Self {
        Self {
            pool,
            blocks: Vec::new(),
            len: 0,
            recurrent: Some(Box::new(state)),
        }
    }

    /// The linear-attention state, for models with linear layers.
    pub fn recurrent(&self) -> Option<&RecurrentState> {
        self.recurrent.as_deref()
    }

    /// The block table and the linear-attention state together (the executor reads one and writes
    /// the other in the same step).
    pub fn parts_mut(&mut self) -> (&[BlockId], Option<&mut RecurrentState>) {
        (&self.blocks, self.recurrent.as_deref_mut())
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

    /// The block table: position `p` lives in `blocks()[p / BLOCK]` at row `p % BLOCK`.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Positions the reserved blocks can hold.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * BLOCK
    }

    /// Makes positions `0..positions` writable: allocates missing blocks and, if the partial last block
    /// is shared with another sequence, replaces it with a private copy. All or nothing: on failure no
    /// block was taken.
    pub fn reserve(&mut self, positions: usize) -> Result<(), KvError> {
        let mut pool = lock(&self.pool);
        let shared_tail = (!self.len.is_multiple_of(BLOCK) && positions > self.len)
            .then_some(self.len / BLOCK)
            .filter(|&i| pool.ref_count(self.blocks[i]) > 1);
        let missing = blocks_for(positions).saturating_sub(self.blocks.len());
        let needed = missing + usize::from(shared_tail.is_some());
        if needed > pool.free() {
            return Err(KvError::Full {
                needed,
                free: pool.free(),
                total: pool.total(),
            });
        }
        if let Some(i) = shared_tail {
            let (from, to) = (self.blocks[i], pool.alloc().expect("counted above"));
            if let Err(e) = pool.storage.copy_block(from, to) {
                pool.release(to);
                return Err(KvError::Copy(e));
            }
            pool.release(from);
            self.blocks[i] = to;
        }
        for _ in 0..missing {
            let id = pool.alloc().expect("counted above");
            self.blocks.push(id);
        }
        Ok(())
    }

    /// Keeps positions `0..n` (no-op if it holds fewer) and releases the blocks past them. A cache with
    /// a recurrent state cannot keep a prefix: it starts over ([`Self::clear`]), and [`Self::len`]
    /// says so.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        if self.recurrent.is_some() {
            self.clear();
            return;
        }
        self.len = n;
        let keep = blocks_for(n);
        let mut pool = lock(&self.pool);
        for id in self.blocks.drain(keep..) {
            pool.release(id);
        }
    }

    /// Releases every block and zeroes the recurrent state (the sequence starts over).
    pub fn clear(&mut self) {
        self.len = 0;
        if let Some(r) = &mut self.recurrent {
            r.reset();
        }
        let mut pool = lock(&self.pool);
        for id in self.blocks.drain(..) {
            pool.release(id);
        }
    }

    /// Records that the step wrote `n` more positions (the executor calls this after writing them).
    pub fn advance(&mut self, n: usize) {
        debug_assert!(
            self.len + n <= self.capacity(),
            "wrote past the reserved blocks"
        );
        self.len += n;
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
        for &id in &self.blocks {
            pool.retain(id);
        }
        Self {
            pool: self.pool.clone(),
            blocks: self.blocks.clone(),
            len: self.len,
            recurrent: self.recurrent.clone(),
        }
    }
}

impl Drop for SeqCache {
    fn drop(&mut self) {
        let mut pool = lock(&self.pool);
        for &id in &self.blocks {
            pool.release(id);
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
