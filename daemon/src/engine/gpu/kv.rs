//! Paged KV cache on the GPU: per layer one K and one V pool of `blocks × BLOCK × width` f32, handed out
//! in blocks of [`BLOCK`] positions. A sequence owns a block table; dropping its cache returns the blocks.
use cudarc::driver::CudaSlice;
use moe_kernels::cuda::GpuDevice;
use std::sync::{Arc, Mutex};

/// Positions per block.
pub const BLOCK: usize = 16;

pub struct GpuKvPool {
    pub k: Vec<CudaSlice<f32>>,
    pub v: Vec<CudaSlice<f32>>,
    /// Row widths per layer: K and V (kv_heads × head_dim each), or MLA's latent and rope key.
    pub width: usize,
    pub v_width: usize,
    pub total_blocks: usize,
    free: Vec<u32>,
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
            k.push(dev.stream.alloc_zeros::<f32>(blocks * BLOCK * width)?);
            v.push(dev.stream.alloc_zeros::<f32>(blocks * BLOCK * v_width)?);
        }
        Ok(Self {
            k,
            v,
            width,
            v_width,
            total_blocks: blocks,
            free: (0..blocks as u32).rev().collect(),
        })
    }

    pub fn bytes_for(layers: usize, (width, v_width): (usize, usize), blocks: usize) -> usize {
        layers * blocks * BLOCK * (width + v_width) * 4
    }

    pub fn used_blocks(&self) -> usize {
        self.total_blocks - self.free.len()
    }
}

/// A sequence's blocks in the shared pool.
pub struct GpuSeqKv {
    pub pool: Arc<Mutex<GpuKvPool>>,
    pub stream: Arc<cudarc::driver::CudaStream>,
    pub blocks: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
#[error("GPU KV cache is full ({0} blocks of {BLOCK} positions in use); raise --kv-cache-tokens or shorten requests")]
pub struct KvFull(pub usize);

impl GpuSeqKv {
    /// Makes room for positions `0..len`.
    pub fn reserve(&mut self, pool: &mut GpuKvPool, len: usize) -> Result<(), KvFull> {
        let need = len.div_ceil(BLOCK);
        while self.blocks.len() < need {
            match pool.free.pop() {
                Some(b) => self.blocks.push(b),
                None => return Err(KvFull(pool.used_blocks())),
            }
        }
        Ok(())
    }

    /// Keeps the blocks holding positions `0..len`.
    pub fn truncate(&mut self, len: usize) {
        let keep = len.div_ceil(BLOCK);
        if self.blocks.len() > keep {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            pool.free.extend(self.blocks.drain(keep..));
        }
    }
}

impl Clone for GpuSeqKv {
    /// Copies the blocks (device to device), so the clone can be extended independently.
    fn clone(&self) -> Self {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        let mut blocks = Vec::with_capacity(self.blocks.len());
        let (kw, vw) = (pool.width, pool.v_width);
        for &src in &self.blocks {
            let Some(dst) = pool.free.pop() else { break };
            for layer in 0..pool.k.len() {
                for which in 0..2 {
                    let (cache, row) = if which == 0 {
                        (&mut pool.k[layer], BLOCK * kw)
                    } else {
                        (&mut pool.v[layer], BLOCK * vw)
                    };
                    let tmp = self
                        .stream
                        .clone_dtod(&cache.slice(src as usize * row..(src as usize + 1) * row));
                    if let Ok(tmp) = tmp {
                        let mut d = cache.slice_mut(dst as usize * row..(dst as usize + 1) * row);
                        let _ = self.stream.memcpy_dtod(&tmp, &mut d);
                    }
                }
            }
            blocks.push(dst);
        }
        Self {
            pool: self.pool.clone(),
            stream: self.stream.clone(),
            blocks,
        }
    }
}

impl Drop for GpuSeqKv {
    fn drop(&mut self) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.free.append(&mut self.blocks);
    }
}

impl std::fmt::Debug for GpuSeqKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuSeqKv({} blocks)", self.blocks.len())
    }
}
