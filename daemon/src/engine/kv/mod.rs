//! KV caches. Block accounting (which block holds which positions, who shares it) is one thing for both
//! backends ([`blocks`]); the rows themselves live in the backend's storage: [`CpuKvStore`] here, the
//! GPU's paged pool in `engine::gpu::kv`. Linear-attention layers keep a fixed-size per-sequence state
//! instead ([`recurrent`]), carried by the sequence's [`SeqCache`].
pub mod blocks;
pub mod footprint;
pub mod recurrent;

pub use blocks::{
    blocks_for, BlockCopy, BlockId, BlockPool, KvError, SeqCache, SharedBlockPool, BLOCK,
};
pub use recurrent::RecurrentState;

use std::sync::{Mutex, MutexGuard};

/// One layer's rows on the CPU: two row-major f32 arrays indexed by block (GQA: keys and values,
/// `kv_heads × head_dim` wide; MLA: the normalised latent and the roped shared key). They grow on demand
/// to the highest block handed out, so memory follows the peak number of positions in use, not the
/// configured capacity.
#[derive(Debug, Default)]
pub struct LayerRows {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub a_width: usize,
    pub b_width: usize,
}

impl LayerRows {
    fn ensure_block(&mut self, block: BlockId) {
        let rows = (block as usize + 1) * BLOCK;
        if self.a.len() < rows * self.a_width {
            self.a.resize(rows * self.a_width, 0.0);
            self.b.resize(rows * self.b_width, 0.0);
        }
    }

    /// Writes one position's rows into its slot.
    pub fn write(&mut self, slot: usize, a: &[f32], b: &[f32]) {
        self.ensure_block((slot / BLOCK) as BlockId);
        self.a[slot * self.a_width..(slot + 1) * self.a_width].copy_from_slice(a);
        self.b[slot * self.b_width..(slot + 1) * self.b_width].copy_from_slice(b);
    }

    pub fn a_row(&self, slot: usize) -> &[f32] {
        &self.a[slot * self.a_width..(slot + 1) * self.a_width]
    }

    pub fn b_row(&self, slot: usize) -> &[f32] {
        &self.b[slot * self.b_width..(slot + 1) * self.b_width]
    }

    fn copy_block(&mut self, from: BlockId, to: BlockId) {
        self.ensure_block(from.max(to));
        let (f, t) = (from as usize * BLOCK, to as usize * BLOCK);
        let aw = self.a_width;
        self.a.copy_within(f * aw..(f + BLOCK) * aw, t * aw);
        let bw = self.b_width;
        self.b.copy_within(f * bw..(f + BLOCK) * bw, t * bw);
    }
}

/// The storage slot of position `pos` of a sequence with block table `blocks`.
pub fn slot(blocks: &[BlockId], pos: usize) -> usize {
    blocks[pos / BLOCK] as usize * BLOCK + pos % BLOCK
}

/// Every layer's rows of the CPU backend, shared by all sequences through their block tables.
#[derive(Debug)]
pub struct CpuKvStore {
    layers: Mutex<Vec<LayerRows>>,
}

impl CpuKvStore {
    /// `widths`: per layer, the widths of the two row kinds.
    pub fn new(widths: &[(usize, usize)]) -> Self {
        let layers = widths
            .iter()
            .map(|&(a_width, b_width)| LayerRows {
                a_width,
                b_width,
                ..Default::default()
            })
            .collect();
        Self {
            layers: Mutex::new(layers),
        }
    }

    /// The rows, for the duration of a step.
    pub fn lock(&self) -> MutexGuard<'_, Vec<LayerRows>> {
        self.layers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes held now (the high-water mark of blocks in use).
    pub fn bytes(&self) -> usize {
        self.lock()
            .iter()
            .map(|l| (l.a.len() + l.b.len()) * 4)
            .sum()
    }
}

impl BlockCopy for CpuKvStore {
    fn copy_block(&self, from: BlockId, to: BlockId) -> Result<(), String> {
        for l in self.lock().iter_mut() {
            l.copy_block(from, to);
        }
        Ok(())
    }
}
