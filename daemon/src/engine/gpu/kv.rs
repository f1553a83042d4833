//! Paged KV storage on the GPU: per layer one K and one V pool of `blocks × BLOCK × width` bf16. Which
//! block belongs to which sequence is decided by the driver through the engine's block pool
//! (`engine::kv::blocks`); this file only holds the memory and copies blocks for copy-on-write.
use crate::engine::kv::{BlockCopy, BlockId, BLOCK};
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
}

impl GpuKvPool {
    pub fn new(
        dev: &GpuDevice,
        layers: usize,
        (width, v_width): (usize, usize),
        blocks: usize,
    ) -> anyhow::Result<Self> {
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(dev.stream.alloc_zeros::<bf16>(blocks * BLOCK * width)?);
            v.push(dev.stream.alloc_zeros::<bf16>(blocks * BLOCK * v_width)?);
        }
        Ok(Self {
            k,
            v,
            width,
            v_width,
            total_blocks: blocks,
        })
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
        let (kw, vw) = (pool.width, pool.v_width);
        let (from, to) = (from as usize, to as usize);
        for (k, v) in pool.k.iter_mut().zip(pool.v.iter_mut()) {
            for (cache, row) in [(k, BLOCK * kw), (v, BLOCK * vw)] {
                // Source and destination are views of one allocation: stage through a temporary.
                let tmp = self
                    .stream
                    .clone_dtod(&cache.slice(from * row..(from + 1) * row))
                    .map_err(|e| e.to_string())?;
                let mut dst = cache.slice_mut(to * row..(to + 1) * row);
                self.stream
                    .memcpy_dtod(&tmp, &mut dst)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }
}
