//! The sparse-attention indexer on the GPU (GLM-5's per-token DSA, GLM-5.3-Flash's key pools) and MLA
//! attention over the positions it selects.
//!
//! Indexer rows live in a per-layer f32 cache `[slots, width]` addressed by the same block tables as the
//! MLA latent (width = d for per-token keys; 2d for key pools: key, then the pooling gate logits, which
//! a complete pool's last slot trades for the pooled key).
//! A step: keys normalised ([`HybridKernels::idx_layer_norm`]) and written
//! ([`HybridKernels::idx_write_rows`]); for key pools, the pools this step completes pooled
//! ([`HybridKernels::idx_pool_complete`]); every query scores its candidates
//! ([`HybridKernels::idx_scores`]) and keeps the best ([`HybridKernels::idx_topk`], a radix select per
//! row: 32 counting passes, ties to the lower index); MLA then attends the list
//! ([`HybridKernels::mla_attention_selected`]).
//!
//! Cost per query and layer: `heads × d` multiply-adds per candidate (pools, or positions), all of the
//! sequence's candidates every step, as on the CPU; each pooled key is computed once, when its pool
//! completes.
use super::hybrid::{cfg, check, HybridKernels, SegmentIndex};
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

/// Largest indexer head width the scoring kernel takes.
pub const MAX_HEAD_DIM: usize = 128;
/// Largest key pool.
pub const MAX_POOL: usize = 16;
/// Most blocks of [`HybridKernels::idx_scores`] per query row (each strides over its share).
const SCORE_BLOCKS_PER_ROW: usize = 256;
const BLOCK: u32 = 128;

/// Where a paged cache's positions live: per sequence, `max_blocks` block ids (`[sequences, max_blocks]`
/// i32), `block_size` positions per block.
pub struct PagedTables<'a> {
    pub tables: &'a CudaSlice<i32>,
    pub max_blocks: usize,
    pub block_size: usize,
}

/// One layer's indexer rows `[slots, width]` f32 and how a query's candidates map onto them:
/// candidate j of a row is the key in columns `key_off .. key_off + d` of the row of position
/// `j · unit + unit − 1` of the query's sequence (per-position keys: unit 1, key_off 0; key pools:
/// unit = pool, key_off = d, the pooled key in the pool's last slot). A query at position p has
/// `(p + 1) / unit` candidates.
pub struct IndexerRows<'a> {
    pub cache: &'a CudaSlice<f32>,
    pub width: usize,
    pub unit: usize,
    pub key_off: usize,
    pub paged: &'a PagedTables<'a>,
}

/// The positions each query row attends: `[rows, stride]` ascending lists of `len[row]` positions.
pub struct DeviceSelection {
    pub rows: usize,
    pub stride: usize,
    positions: CudaSlice<i32>,
    len: CudaSlice<i32>,
}

impl DeviceSelection {
    pub fn alloc(dev: &GpuDevice, rows: usize, stride: usize) -> Result<Self, GpuError> {
        Ok(Self {
            rows,
            stride,
            positions: dev.stream.alloc_zeros(rows * stride.max(1))?,
            len: dev.stream.alloc_zeros(rows.max(1))?,
        })
    }

    /// Uses the first `rows` rows of the buffers (a persistent selection reused by steps of any size up
    /// to the one it was allocated for).
    pub fn set_rows(&mut self, rows: usize) -> Result<(), GpuError> {
        check(
            rows <= self.len.len() && rows * self.stride <= self.positions.len(),
            || {
                format!(
                    "a selection of {rows} rows in buffers for {}",
                    self.len.len()
                )
            },
        )?;
        self.rows = rows;
        Ok(())
    }

    /// The lists and their lengths, copied to the host (tests and diagnostics; synchronises).
    pub fn to_host(&self, dev: &GpuDevice) -> Result<(Vec<i32>, Vec<i32>), GpuError> {
        Ok((
            dev.stream.clone_dtoh(&self.positions)?,
            dev.stream.clone_dtoh(&self.len)?,
        ))
    }
}

/// Shape of absorbed MLA.
#[derive(Debug, Clone, Copy)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub lora: usize,
    pub v_dim: usize,
}

impl HybridKernels {
    /// In place LayerNorm (eps 1e-6, weight `w`, bias `b` of width d) of each row of `k` `[rows, d]`.
    pub fn idx_layer_norm(
        &self,
        dev: &GpuDevice,
        rows: usize,
        k: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let d = w.len();
        check(d > 0 && b.len() == d && k.len() >= rows * d, || {
            format!("idx_layer_norm: {rows} rows × {d}")
        })?;
        let d_i = d as i32;
        let mut l = dev.stream.launch_builder(&self.idx_layer_norm);
        l.arg(k).arg(&d_i).arg(w).arg(b);
        // SAFETY: sizes checked above.
        unsafe { l.launch(cfg((rows, 1, 1), BLOCK, 0)) }?;
        Ok(())
    }

    /// Writes each row's key (and, for key pools, gate logits) into the indexer cache at `slots[row]`.
    #[allow(clippy::too_many_arguments)]
    pub fn idx_write_rows(
        &self,
        dev: &GpuDevice,
        rows: usize,
        d: usize,
        key: &CudaSlice<f32>,
        gate: Option<&CudaSlice<f32>>,
        slots: &CudaSlice<i32>,
        cache: &mut CudaSlice<f32>,
        width: usize,
    ) -> Result<(), GpuError> {
        let need = if gate.is_some() { 2 * d } else { d };
        check(
            width >= need
                && key.len() >= rows * d
                && gate.is_none_or(|g| g.len() >= rows * d)
                && slots.len() >= rows,
            || format!("idx_write_rows: {rows} rows × {d} into width {width}"),
        )?;
        let (d_i, w_i) = (d as i32, width as i32);
        let null = 0u64;
        let mut l = dev.stream.launch_builder(&self.idx_write_rows);
        l.arg(key);
        match gate {
            Some(g) => l.arg(g),
            None => l.arg(&null),
        };
        l.arg(&d_i).arg(slots).arg(&w_i).arg(cache);
        // SAFETY: sizes checked above; the slots come from block tables the engine reserved in this
        // cache's pool (every slot < blocks × block size, the cache's rows).
        unsafe { l.launch(cfg((rows, 1, 1), BLOCK, 0)) }?;
        Ok(())
    }

    /// For each row whose position ends a pool of `pool` positions: that pool's key (per channel, a
    /// softmax over the pool's slots of gate logit + `ape[slot]` weighs the slots' keys) into the gate
    /// columns of the pool's last slot, which no one reads once the pool is complete. Runs after
    /// [`Self::idx_write_rows`] of the same step, so each pooled key is computed once, when its pool
    /// gains its last key. `pos`, `seq_of_row` `[rows]`.
    #[allow(clippy::too_many_arguments)]
    pub fn idx_pool_complete(
        &self,
        dev: &GpuDevice,
        rows: usize,
        cache: &mut CudaSlice<f32>,
        d: usize,
        pool: usize,
        ape: &CudaSlice<f32>,
        paged: &PagedTables<'_>,
        seq_of_row: &CudaSlice<i32>,
        pos: &CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        check(
            (1..=MAX_POOL).contains(&pool)
                && ape.len() >= pool * d
                && pos.len() >= rows
                && seq_of_row.len() >= rows,
            || format!("idx_pool_complete: pool {pool} (≤ {MAX_POOL}), {rows} rows"),
        )?;
        if rows == 0 {
            return Ok(());
        }
        let (w_i, d_i, p_i, mb, bs) = (
            2 * d as i32,
            d as i32,
            pool as i32,
            paged.max_blocks as i32,
            paged.block_size as i32,
        );
        let mut l = dev.stream.launch_builder(&self.idx_pool_complete);
        l.arg(cache)
            .arg(&w_i)
            .arg(&d_i)
            .arg(&p_i)
            .arg(ape)
            .arg(paged.tables)
            .arg(&mb)
            .arg(&bs)
            .arg(seq_of_row)
            .arg(pos);
        // SAFETY: pool ≤ MAX_POOL (the kernel's arrays); a row's pool is positions ≤ its own, all in its
        // sequence's reserved blocks (whose rows the cache holds) and written by this or earlier steps.
        unsafe { l.launch(cfg((rows, 1, 1), BLOCK, 0)) }?;
        Ok(())
    }

    /// Scores of each row's `(pos[row] + 1) / keys.unit` candidates (at most `stride`, the rest of the
    /// row untouched): Σ_h w[h] · relu(scale · q_h · key). `q` `[rows, heads, d]`, `w` `[rows, heads]`,
    /// `scores` `[rows, stride]`. Nothing per step is a launch argument (see `hybrid.cu`), so a graph
    /// captured at one context length replays at any other up to `stride` candidates.
    #[allow(clippy::too_many_arguments)]
    pub fn idx_scores(
        &self,
        dev: &GpuDevice,
        seg: &SegmentIndex,
        (heads, d): (usize, usize),
        scale: f32,
        q: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        keys: &IndexerRows<'_>,
        stride: usize,
        scores: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let rows = seg.rows;
        check(
            d > 0
                && d <= MAX_HEAD_DIM
                && keys.unit >= 1
                && keys.width >= keys.key_off + d
                && q.len() >= rows * heads * d
                && w.len() >= rows * heads
                && pos.len() >= rows
                && scores.len() >= rows * stride,
            || format!("idx_scores: {rows} rows, {heads} heads × {d} (d ≤ {MAX_HEAD_DIM})"),
        )?;
        if stride == 0 || rows == 0 {
            return Ok(());
        }
        let (h_i, d_i, s_i) = (heads as i32, d as i32, stride as i32);
        let (unit, width, off) = (keys.unit as i32, keys.width as i32, keys.key_off as i32);
        let (mb, bs) = (keys.paged.max_blocks as i32, keys.paged.block_size as i32);
        let mut l = dev.stream.launch_builder(&self.idx_scores);
        l.arg(q)
            .arg(w)
            .arg(&h_i)
            .arg(&d_i)
            .arg(&scale)
            .arg(pos)
            .arg(&seg.seg_of_row)
            .arg(&unit)
            .arg(keys.cache)
            .arg(&width)
            .arg(&off)
            .arg(keys.paged.tables)
            .arg(&mb)
            .arg(&bs)
            .arg(&s_i)
            .arg(scores);
        let smem = ((heads * d + heads) * 4) as u32;
        // Blocks per row stride over the candidates: enough to fill the GPU at one row, and no more
        // than the candidates need.
        let per_row = stride.div_ceil(BLOCK as usize).min(SCORE_BLOCKS_PER_ROW);
        // SAFETY: d ≤ MAX_HEAD_DIM (the kernel's register array); sizes checked above; the kernel caps
        // each row's candidates at `stride`, and they name written positions of the row's own sequence.
        unsafe { l.launch(cfg((rows, per_row, 1), BLOCK, smem)) }?;
        Ok(())
    }

    /// Per row: the best `min(topk, count)` of its `count = (pos[row] + 1) / pool` candidates (ties to
    /// the lower index) as ascending positions (candidate j = positions j·pool .. j·pool + pool − 1),
    /// then with pools (pool > 1) the row's own incomplete pool `count·pool ..= pos[row]`.
    #[allow(clippy::too_many_arguments)]
    pub fn idx_topk(
        &self,
        dev: &GpuDevice,
        scores: &CudaSlice<f32>,
        stride: usize,
        pos: &CudaSlice<i32>,
        topk: usize,
        pool: usize,
        sel: &mut DeviceSelection,
    ) -> Result<(), GpuError> {
        let rows = sel.rows;
        check(
            topk > 0
                && pool >= 1
                && sel.stride >= topk * pool + pool
                && scores.len() >= rows * stride
                && pos.len() >= rows,
            || {
                format!(
                    "idx_topk: {rows} rows, top {topk} of pools of {pool}, list stride {}",
                    sel.stride
                )
            },
        )?;
        let (st, k, p, ss) = (stride as i32, topk as i32, pool as i32, sel.stride as i32);
        let mut l = dev.stream.launch_builder(&self.idx_topk);
        l.arg(scores)
            .arg(&st)
            .arg(pos)
            .arg(&k)
            .arg(&p)
            .arg(&mut sel.positions)
            .arg(&ss)
            .arg(&mut sel.len);
        // SAFETY: a row keeps ≤ topk candidates of `pool` positions plus < pool own positions, within
        // the list stride (checked); scores hold rows × stride and the kernel reads ≤ stride per row.
        unsafe { l.launch(cfg((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// Absorbed MLA of each (row, head) over the positions `sel` lists for the row (caches bf16
    /// `[slots, lora]` and `[slots, rope]`, `kv_b` `[heads·(nope + v), lora]`); bf16 `out` `[rows, heads·v]`.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention_selected(
        &self,
        dev: &GpuDevice,
        dims: MlaDims,
        q: &CudaSlice<f32>,
        latent: &CudaSlice<bf16>,
        rope_keys: &CudaSlice<bf16>,
        paged: &PagedTables<'_>,
        seq_of_row: &CudaSlice<i32>,
        sel: &DeviceSelection,
        kv_b: &CudaSlice<f32>,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let rows = sel.rows;
        let MlaDims {
            heads,
            nope,
            rope,
            lora,
            v_dim,
        } = dims;
        check(
            q.len() >= rows * heads * (nope + rope)
                && kv_b.len() >= heads * (nope + v_dim) * lora
                && seq_of_row.len() >= rows
                && out.len() >= rows * heads * v_dim,
            || format!("mla_attention_selected: {rows} rows of {dims:?}"),
        )?;
        let (mb, ss, h, n, r, lr, vd, bs) = (
            paged.max_blocks as i32,
            sel.stride as i32,
            heads as i32,
            nope as i32,
            rope as i32,
            lora as i32,
            v_dim as i32,
            paged.block_size as i32,
        );
        let mut l = dev.stream.launch_builder(&self.mla_attention_selected);
        l.arg(q)
            .arg(latent)
            .arg(rope_keys)
            .arg(paged.tables)
            .arg(&mb)
            .arg(seq_of_row)
            .arg(&sel.positions)
            .arg(&ss)
            .arg(&sel.len)
            .arg(&h)
            .arg(&n)
            .arg(&r)
            .arg(&lr)
            .arg(&vd)
            .arg(kv_b)
            .arg(&bs)
            .arg(&scale)
            .arg(out);
        let smem = ((nope + rope + 2 * lora) as u32 + BLOCK) * 4;
        // SAFETY: sizes checked above; every listed position was written to the row's sequence's
        // reserved blocks (the indexer lists only positions ≤ the row's own).
        unsafe { l.launch(cfg((rows, heads, 1), BLOCK, smem)) }?;
        Ok(())
    }
}
