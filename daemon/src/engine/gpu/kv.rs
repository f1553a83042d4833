//! Paged KV storage on the GPU: per storage slot one K and one V pool of `blocks × BLOCK × width` bf16
//! (a slot per layer, or per layer of a group when sliding-window layers have their own block tables:
//! `engine::kv::layout`). Which block belongs to which sequence is decided by the driver through the
//! engine's block pool (`engine::kv::blocks`); this file only holds the memory and copies blocks for
//! copy-on-write. Layers with a sparse-attention indexer also keep its key rows (f32, `c`), addressed by
//! the same blocks (such models have one slot per layer).
use crate::engine::kv::{BlockCopy, BlockId, KvLayout, BLOCK};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use moe_kernels::cuda::GpuDevice;
use std::sync::{Arc, Mutex};

pub struct GpuKvPool {
    pub k: Vec<CudaSlice<bf16>>,
    pub v: Vec<CudaSlice<bf16>>,
    /// Row widths per layer: K and V (kv_heads × head_dim each), or MLA's latent and rope key.
    pub width: usize,
    pub v_width: usize,
    pub total_blocks: usize,
    /// Per layer, the indexer's rows `[blocks × BLOCK, c_width]` (f32) where the layer runs its own
    /// indexer; added by [`GpuKvPool::add_indexer_rows`].
    pub c: Vec<Option<CudaSlice<f32>>>,
    pub c_width: usize,
    /// Per layer: the slot its rows live in.
    slot_of: Vec<usize>,
}

impl GpuKvPool {
    /// `has_rows[layer]`: false for layers that keep no KV rows (linear attention: a per-sequence state
    /// instead), which get a minimal placeholder. One K and one V pool per slot of `layout`.
    pub fn new(
        dev: &GpuDevice,
        layout: &KvLayout,
        has_rows: &[bool],
        (width, v_width): (usize, usize),
        blocks: usize,
    ) -> anyhow::Result<Self> {
        // Slot i holds layer i of every group: its rows exist if the first group's layer has them.
        let slot_rows: Vec<bool> = layout.groups()[0]
            .layers
            .iter()
            .map(|&l| has_rows.get(l).copied().unwrap_or(true))
            .collect();
        let layers = slot_rows.len();
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for &rows in &slot_rows {
            let n = if rows { blocks * BLOCK } else { 0 };
            // (NoPE MLA has no rope key: a zero width still gets a minimal buffer)
            k.push(dev.stream.alloc_zeros::<bf16>((n * width).max(1))?);
            v.push(dev.stream.alloc_zeros::<bf16>((n * v_width).max(1))?);
        }
        Ok(Self {
            k,
            v,
            width,
            v_width,
            total_blocks: blocks,
            c: (0..layers).map(|_| None).collect(),
            c_width: 0,
            slot_of: (0..layout.num_layers())
                .map(|l| layout.slot_of(l))
                .collect(),
        })
    }

    /// The slot of layer `li`'s K and V rows.
    pub fn slot(&self, li: usize) -> usize {
        self.slot_of[li]
    }

    /// Allocates indexer rows of `width` f32 per position for `layer` (every indexed layer of a model
    /// has the same width).
    pub fn add_indexer_rows(
        &mut self,
        dev: &GpuDevice,
        layer: usize,
        width: usize,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.c_width == 0 || self.c_width == width,
            "indexer rows of two widths"
        );
        self.c_width = width;
        self.c[layer] = Some(
            dev.stream
                .alloc_zeros::<f32>(self.total_blocks * BLOCK * width)?,
        );
        Ok(())
    }

    pub fn bytes_for(layers: usize, (width, v_width): (usize, usize), blocks: usize) -> usize {
        layers * blocks * BLOCK * (width + v_width) * std::mem::size_of::<bf16>()
    }
}

/// Copy-on-write for the GPU pool: block copies are queued on the compute stream, so they land before
/// the step that writes into the new block.
pub struct GpuKvCopier {
    pub pool: Arc<Mutex<GpuKvPool>>,
    pub stream: Arc<CudaStream>,
}

impl BlockCopy for GpuKvCopier {
    fn copy_block(&self, from: BlockId, to: BlockId) -> Result<(), String> {
        let mut guard = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        let pool = &mut *guard;
        let (kw, vw, cw) = (pool.width, pool.v_width, pool.c_width);
        let (from, to) = (from as usize, to as usize);
        for (k, v) in pool.k.iter_mut().zip(pool.v.iter_mut()) {
            // (placeholders of layers without rows hold one element)
            if k.len() > 1 {
                copy_rows(&self.stream, k, BLOCK * kw, from, to)?;
            }
            if v.len() > 1 {
                copy_rows(&self.stream, v, BLOCK * vw, from, to)?;
            }
        }
        for c in pool.c.iter_mut().flatten() {
            copy_rows(&self.stream, c, BLOCK * cw, from, to)?;
        }
        Ok(())
    }
}

/// Copies block `from`'s `row` elements over block `to`'s in `cache` (nothing for a zero width).
fn copy_rows<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    cache: &mut CudaSlice<T>,
    row: usize,
    from: usize,
    to: usize,
) -> Result<(), String> {
    if row == 0 {
        return Ok(());
    }
    // Source and destination are views of one allocation: stage through a temporary.
    let tmp = stream
        .clone_dtod(&cache.slice(from * row..(from + 1) * row))
        .map_err(|e| e.to_string())?;
    let mut dst = cache.slice_mut(to * row..(to + 1) * row);
    stream
        .memcpy_dtod(&tmp, &mut dst)
        .map_err(|e| e.to_string())
}
