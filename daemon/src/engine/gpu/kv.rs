//! Paged KV storage on the GPU: per storage slot one K and one V pool of `blocks × BLOCK` rows of
//! `width` values, bf16 or (`--kv-cache-dtype int8|fp8`, GQA models) 8-bit codes with one scale per
//! group of 32 values (`moe_kernels::cuda::kv_q8`), and the ops that read and write them in either form (a slot per layer, or per layer of a group when sliding-window layers have their own block tables:
//! `engine::kv::layout`). Which block belongs to which sequence is decided by the driver through the
//! engine's block pool (`engine::kv::blocks`); this file only holds the memory and copies blocks for
//! copy-on-write. Layers with a sparse-attention indexer also keep its key rows (f32, `c`), addressed by
//! the same blocks (such models have one slot per layer).
use crate::engine::kv::{BlockCopy, BlockId, KvLayout, BLOCK};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moe_kernels::cuda::kv_q8::{KvCode, Q8Rows};
use moe_kernels::cuda::ops::{CacheRows, PagedIndex};
use moe_kernels::cuda::GpuDevice;
use moe_sizing::KvCacheDtype;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// One storage slot's K or V rows.
pub enum KvRows {
    Bf16(CudaSlice<bf16>),
    /// 8-bit codes and per-(row, KV head) scales.
    Q8(Q8Rows),
}

impl KvRows {
    /// The bf16 rows (MLA layers and the indexer read only those; 8-bit caches are refused for them
    /// at start).
    pub fn bf16(&self) -> anyhow::Result<&CudaSlice<bf16>> {
        match self {
            KvRows::Bf16(rows) => Ok(rows),
            KvRows::Q8(_) => anyhow::bail!("this attention reads bf16 KV rows only"),
        }
    }

    /// The rows as the attention and gather ops take them.
    pub fn as_cache(&self) -> CacheRows<'_> {
        match self {
            KvRows::Bf16(rows) => CacheRows::Bf16(rows),
            KvRows::Q8(rows) => CacheRows::Q8(rows),
        }
    }
}

pub struct GpuKvPool {
    pub k: Vec<KvRows>,
    pub v: Vec<KvRows>,
    /// 8-bit rows' code, KV heads and head dim (`None`: bf16 rows).
    q8: Option<(KvCode, (usize, usize))>,
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
    /// instead), which get a minimal placeholder. One K and one V pool per slot of `layout`, in
    /// `dtype`; `gqa_heads` (KV heads, head dim) are needed for 8-bit rows (GQA attention).
    pub fn new(
        dev: &GpuDevice,
        layout: &KvLayout,
        has_rows: &[bool],
        (width, v_width): (usize, usize),
        blocks: usize,
        (dtype, gqa_heads): (KvCacheDtype, Option<(usize, usize)>),
    ) -> anyhow::Result<Self> {
        let code = match dtype {
            KvCacheDtype::Bf16 => None,
            KvCacheDtype::Fp8 => Some(KvCode::E4m3),
            KvCacheDtype::Int8 => Some(KvCode::Int8),
        };
        let q8 = match (code, gqa_heads) {
            (None, _) => None,
            (Some(code), Some((heads, dim))) if heads * dim == width && width == v_width => {
                Some((code, (heads, dim)))
            }
            (Some(_), _) => anyhow::bail!(
                "--kv-cache-dtype {} needs grouped-query attention (K and V rows of KV heads); this model's attention keeps bf16 rows only",
                dtype.as_str()
            ),
        };
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
            match q8 {
                Some((code, geometry)) => {
                    k.push(KvRows::Q8(Q8Rows::alloc(dev, n, geometry, code)?));
                    v.push(KvRows::Q8(Q8Rows::alloc(dev, n, geometry, code)?));
                }
                None => {
                    // (NoPE MLA has no rope key: a zero width still gets a minimal buffer)
                    k.push(KvRows::Bf16(
                        dev.stream.alloc_zeros::<bf16>((n * width).max(1))?,
                    ));
                    v.push(KvRows::Bf16(
                        dev.stream.alloc_zeros::<bf16>((n * v_width).max(1))?,
                    ));
                }
            }
        }
        Ok(Self {
            k,
            v,
            q8,
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

    pub fn dtype(&self) -> KvCacheDtype {
        match self.q8 {
            Some((KvCode::E4m3, _)) => KvCacheDtype::Fp8,
            Some((KvCode::Int8, _)) => KvCacheDtype::Int8,
            None => KvCacheDtype::Bf16,
        }
    }

    /// Writes a step's `rows` rows `k` and `v` into layer `li`'s caches at `slots` (rounded to bf16, or
    /// quantized to 8-bit codes with their scales). MLA passes its latent and rope key as k and v.
    pub fn append(
        &mut self,
        dev: &GpuDevice,
        li: usize,
        (k, v): (&CudaSlice<f32>, &CudaSlice<f32>),
        rows: usize,
        slots: &CudaSlice<i32>,
    ) -> anyhow::Result<()> {
        let s = self.slot(li);
        match (&mut self.k[s], &mut self.v[s]) {
            (KvRows::Bf16(kc), KvRows::Bf16(vc)) => {
                dev.kv_append(k, v, (rows, self.width, self.v_width), kc, vc, slots, BLOCK)?
            }
            (KvRows::Q8(kc), KvRows::Q8(vc)) => dev.kv_append_q8((k, v), rows, kc, vc, slots)?,
            _ => anyhow::bail!("layer {li}: K and V rows of different types"),
        }
        Ok(())
    }

    /// GQA attention of step rows `rows` against layer `li`'s caches (see
    /// `GpuDevice::paged_attention`; `warps`: its twin with the positions spread over warps,
    /// `GpuDevice::paged_attention_warps`, the fused decode segment's).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        dev: &GpuDevice,
        li: usize,
        q: &impl DevicePtr<f32>,
        index: &PagedIndex<'_>,
        heads: (usize, usize, usize),
        (scale, window): (f32, Option<usize>),
        (rows, warps): (Range<usize>, bool),
        out: &mut impl DevicePtrMut<bf16>,
    ) -> anyhow::Result<()> {
        let s = self.slot(li);
        let caches = (self.k[s].as_cache(), self.v[s].as_cache());
        let sw = (scale, window);
        if warps {
            dev.paged_attention_warps(q, caches, index, heads, sw, rows, out)?;
        } else {
            dev.paged_attention(q, caches, index, heads, sw, rows, out)?;
        }
        Ok(())
    }

    /// Positions `0..positions` of one sequence (block `table`) of layer `li` as contiguous bf16 rows
    /// (`[positions, width]` and `[positions, v_width]`: long prefill's GEMM operands).
    pub fn gather_bf16(
        &self,
        dev: &GpuDevice,
        li: usize,
        table: &impl DevicePtr<i32>,
        positions: usize,
        (k_out, v_out): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
    ) -> anyhow::Result<()> {
        let s = self.slot(li);
        dev.gather_kv(
            (self.k[s].as_cache(), self.v[s].as_cache()),
            table,
            (positions, BLOCK),
            (self.width, self.v_width),
            k_out,
            v_out,
        )?;
        Ok(())
    }

    /// Layer `li`'s bf16 K and V rows, writable (the fused decode segment appends to them in its norm
    /// + RoPE launch); `None` for 8-bit rows, which keep their own append.
    pub fn bf16_rows_mut(
        &mut self,
        li: usize,
    ) -> Option<(&mut CudaSlice<bf16>, &mut CudaSlice<bf16>)> {
        let s = self.slot(li);
        match (&mut self.k[s], &mut self.v[s]) {
            (KvRows::Bf16(k), KvRows::Bf16(v)) => Some((k, v)),
            _ => None,
        }
    }

    /// Layer `li`'s bf16 K and V rows (MLA attention and the sparse indexer read them directly).
    pub fn bf16_rows(&self, li: usize) -> anyhow::Result<(&CudaSlice<bf16>, &CudaSlice<bf16>)> {
        let s = self.slot(li);
        Ok((self.k[s].bf16()?, self.v[s].bf16()?))
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
        for (rows, width) in pool
            .k
            .iter_mut()
            .map(|k| (k, kw))
            .chain(pool.v.iter_mut().map(|v| (v, vw)))
        {
            match rows {
                // (placeholders of layers without rows hold one element)
                KvRows::Bf16(r) if r.len() > 1 => {
                    copy_rows(&self.stream, r, BLOCK * width, from, to)?
                }
                KvRows::Q8(r) if r.codes.len() > 1 => {
                    copy_rows(&self.stream, &mut r.codes, BLOCK * width, from, to)?;
                    let groups = r.groups();
                    copy_rows(&self.stream, &mut r.scales, BLOCK * groups, from, to)?;
                }
                _ => {}
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
