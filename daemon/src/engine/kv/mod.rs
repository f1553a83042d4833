//! KV caches. Block accounting (which block holds which positions, who shares it) is one thing for both
//! backends ([`blocks`]); the rows themselves live in the backend's storage: [`CpuKvStore`] here, the
//! GPU's paged pool in `engine::gpu::kv`. Linear-attention layers keep a fixed-size per-sequence state
//! instead ([`recurrent`]), carried by the sequence's [`SeqCache`].
pub mod blocks;
pub mod footprint;
pub mod layout;
pub mod recurrent;
pub mod rows;

pub use blocks::{
    blocks_for, BlockCopy, BlockId, BlockPool, KvError, SeqCache, SharedBlockPool, BLOCK,
};
pub use layout::KvLayout;
pub use recurrent::RecurrentState;
pub use rows::{KvDtype, RowBuf};

use std::sync::{Mutex, MutexGuard};

/// One layer's rows on the CPU: row-major arrays indexed by block (GQA: keys and values,
/// `kv_heads × head_dim` wide; MLA: the normalised latent and the roped shared key, both in the
/// store's [`KvDtype`]; `c`: the sparse attention indexer's keys (f32) of MLA layers that have one,
/// empty elsewhere). They grow on demand to the
/// highest block handed out, so memory follows the peak number of positions in use, not the configured
/// capacity.
#[derive(Debug, Default)]
pub struct LayerRows {
    pub a: RowBuf,
    pub b: RowBuf,
    pub c: Vec<f32>,
    pub a_width: usize,
    pub b_width: usize,
    pub c_width: usize,
}

/// Floats per position of each row kind of one layer (see [`LayerRows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowWidths {
    pub a: usize,
    pub b: usize,
    /// Indexer keys (0: the layer has none).
    pub c: usize,
}

impl LayerRows {
    fn ensure_block(&mut self, block: BlockId) {
        let rows = (block as usize + 1) * BLOCK;
        if self.a.len() < rows * self.a_width {
            self.a.grow(rows * self.a_width);
            self.b.grow(rows * self.b_width);
            self.c.resize(rows * self.c_width, 0.0);
        }
    }

    /// Makes the storage hold `slot` (for writers that take the rows' pointers afterwards).
    pub fn reserve_slot(&mut self, slot: usize) {
        self.ensure_block((slot / BLOCK) as BlockId);
    }

    /// Writes one position's rows into its slot.
    pub fn write(&mut self, slot: usize, a: &[f32], b: &[f32]) {
        self.ensure_block((slot / BLOCK) as BlockId);
        debug_assert!(a.len() == self.a_width && b.len() == self.b_width);
        self.a.write(slot * self.a_width, a);
        self.b.write(slot * self.b_width, b);
    }

    /// Writes one position's indexer key row (layers with an indexer).
    pub fn write_c(&mut self, slot: usize, c: &[f32]) {
        self.ensure_block((slot / BLOCK) as BlockId);
        self.c[slot * self.c_width..(slot + 1) * self.c_width].copy_from_slice(c);
    }

    pub fn c_row(&self, slot: usize) -> &[f32] {
        &self.c[slot * self.c_width..(slot + 1) * self.c_width]
    }

    /// Values `off .. off + dst.len()` of slot `slot`'s `a` row, widened to f32.
    pub fn read_a(&self, slot: usize, off: usize, dst: &mut [f32]) {
        self.a.read(slot * self.a_width + off, dst);
    }

    /// Values `off .. off + dst.len()` of slot `slot`'s `b` row, widened to f32.
    pub fn read_b(&self, slot: usize, off: usize, dst: &mut [f32]) {
        self.b.read(slot * self.b_width + off, dst);
    }

    fn copy_block(&mut self, from: BlockId, to: BlockId) {
        self.ensure_block(from.max(to));
        let (f, t) = (from as usize * BLOCK, to as usize * BLOCK);
        let aw = self.a_width;
        self.a.copy_within(f * aw, BLOCK * aw, t * aw);
        let bw = self.b_width;
        self.b.copy_within(f * bw, BLOCK * bw, t * bw);
        let cw = self.c_width;
        self.c.copy_within(f * cw..(f + BLOCK) * cw, t * cw);
    }
}

/// Per layer, the row widths a model's KV blocks hold (from its config alone): K and V
/// (`kv_heads × head_dim` each), or MLA's normalised latent and roped shared key, plus the sparse-attention
/// indexer's keys on layers that run their own indexer (GLM-5: 128 floats per position). Linear-attention
/// layers keep a per-sequence recurrent state instead: no rows.
pub fn row_widths(cfg: &crate::model::ModelConfig) -> Vec<RowWidths> {
    use crate::model::config::IndexerLayer;
    use crate::model::hybrid::Mixer;
    (0..cfg.num_layers)
        .map(|l| match &cfg.mla {
            _ if cfg.mixers.get(l) == Some(&Mixer::Linear) => RowWidths { a: 0, b: 0, c: 0 },
            Some(m) => RowWidths {
                a: m.kv_lora_rank,
                b: m.qk_rope_head_dim,
                c: cfg
                    .indexer
                    .as_ref()
                    .filter(|ix| ix.layers.get(l) == Some(&IndexerLayer::Own))
                    .map_or(0, |ix| ix.row_width()),
            },
            None => RowWidths {
                a: cfg.num_kv_heads * cfg.head_dim,
                b: cfg.num_kv_heads * cfg.head_dim,
                c: 0,
            },
        })
        .collect()
}

/// The CPU KV rows' element type unless the engine options name one: f16 for GQA models (half the
/// bytes attention reads per step), f32 for MLA models (their latent rows are already compressed, and
/// the sparse-attention indexer's keys beside them are f32).
pub fn default_dtype(cfg: &crate::model::ModelConfig) -> KvDtype {
    if cfg.mla.is_some() {
        KvDtype::F32
    } else {
        KvDtype::F16
    }
}

/// Bytes one position takes in the CPU backend's KV blocks, all layers together, with the model's
/// [`default_dtype`] rows (indexer keys f32).
pub fn bytes_per_position(cfg: &crate::model::ModelConfig) -> usize {
    let value = default_dtype(cfg).bytes();
    row_widths(cfg)
        .iter()
        .map(|w| (w.a + w.b) * value + w.c * 4)
        .sum()
}

/// The storage slot of position `pos` of a sequence with block table `blocks`.
pub fn slot(blocks: &[BlockId], pos: usize) -> usize {
    blocks[pos / BLOCK] as usize * BLOCK + pos % BLOCK
}

/// Every layer's rows of the CPU backend, shared by all sequences through their block tables: one
/// [`LayerRows`] per storage slot of the [`KvLayout`] (per layer without sliding-window groups).
#[derive(Debug)]
pub struct CpuKvStore {
    layers: Mutex<Vec<LayerRows>>,
}

impl CpuKvStore {
    /// `widths`: per slot, the widths of its row kinds; `dtype`: the element type of the `a` and `b`
    /// rows.
    pub fn new(widths: &[RowWidths], dtype: KvDtype) -> Self {
        let layers = widths
            .iter()
            .map(|w| LayerRows {
                a: RowBuf::new(dtype),
                b: RowBuf::new(dtype),
                a_width: w.a,
                b_width: w.b,
                c_width: w.c,
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
            .map(|l| l.a.bytes() + l.b.bytes() + l.c.len() * 4)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The indexer's keys travel with the block: copy-on-write copies them, and the footprint counts them.
    #[test]
    fn indexer_rows_live_in_the_blocks() {
        let store = CpuKvStore::new(&[RowWidths { a: 2, b: 1, c: 3 }], KvDtype::F16);
        let slot_in = |block: usize, i: usize| block * BLOCK + i;
        store.lock()[0].write(slot_in(1, 5), &[1.0, 2.0], &[3.0]);
        store.lock()[0].write_c(slot_in(1, 5), &[4.0, 5.0, 6.0]);
        store.copy_block(1, 3).unwrap();
        {
            let rows = &store.lock()[0];
            assert_eq!(rows.c_row(slot_in(3, 5)), &[4.0, 5.0, 6.0]);
            let mut a = [0f32; 2];
            rows.read_a(slot_in(3, 5), 0, &mut a);
            assert_eq!(a, [1.0, 2.0]);
        }
        assert_eq!(store.bytes(), 4 * BLOCK * ((2 + 1) * 2 + 3 * 4));
    }
}
