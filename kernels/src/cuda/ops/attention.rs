//! Attention over paged caches: appending a step's rows, GQA and MLA (absorbed) attention of decode
//! rows and short chunks, and the gather + causal softmax around long prefill's GEMMs.
//!
//! Caches are `[blocks · block_size, width]` rows, bf16 or (GQA) 8-bit codes with per-(row, KV head)
//! scales (`kv_q8`); row `table[p / block_size] · block_size + p % block_size` holds position p of a
//! sequence whose block table is `table`. GQA attention and the gather take either kind
//! ([`CacheRows`]): one op, one set of shape checks, the kernel chosen by the rows' kind.
use super::{ensure, grid, grid_dim, int, smem};
use crate::cuda::kv_q8::Q8Rows;
use crate::cuda::{GpuDevice, GpuError};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchArgs, PushKernelArg};
use half::bf16;
use std::ops::Range;

/// Where each row of a step sits in the paged cache (device buffers, one entry per step row).
///
/// Trusted values: every table entry is a block of the cache the op is given, and a row's position
/// lies inside its sequence's table (the scheduler's block manager reserves both before the step).
pub struct PagedIndex<'a> {
    /// `[sequences, max_blocks]` block ids.
    pub block_tables: &'a CudaSlice<i32>,
    pub max_blocks: usize,
    /// Sequence (row of `block_tables`) and position of each step row.
    pub seq_of_row: &'a CudaSlice<i32>,
    pub pos_of_row: &'a CudaSlice<i32>,
    /// Positions per cache block.
    pub block_size: usize,
}

/// One paged K or V cache as the GQA attention and gather ops read it.
#[derive(Clone, Copy)]
pub enum CacheRows<'a> {
    Bf16(&'a CudaSlice<bf16>),
    /// 8-bit codes and per-(row, KV head) scales.
    Q8(&'a Q8Rows),
}

/// Device addresses of a K/V cache pair, after checking each holds one row of `width`.
enum CachePair {
    Bf16(u64, u64),
    /// codes K, codes V, scales K, scales V; values per scale and the code.
    Q8([u64; 4], [i32; 2]),
}

impl GpuDevice {
    /// The pair's addresses; both caches must be of one kind (and, 8-bit, of one geometry and
    /// code) with rows `width` wide.
    fn cache_pair(
        &self,
        op: &str,
        (k, v): (CacheRows<'_>, CacheRows<'_>),
        width: usize,
    ) -> Result<CachePair, GpuError> {
        match (k, v) {
            (CacheRows::Bf16(k), CacheRows::Bf16(v)) => Ok(CachePair::Bf16(
                self.input(op, "k_cache", k, width)?,
                self.input(op, "v_cache", v, width)?,
            )),
            (CacheRows::Q8(k), CacheRows::Q8(v)) => {
                ensure(
                    op,
                    (k.kv_heads, k.head_dim, k.group, k.code)
                        == (v.kv_heads, v.head_dim, v.group, v.code)
                        && k.width() == width,
                    || format!("8-bit K/V caches do not match rows of {width}"),
                )?;
                Ok(CachePair::Q8(
                    [
                        self.input(op, "k codes", &k.codes, width)?,
                        self.input(op, "v codes", &v.codes, width)?,
                        self.input(op, "k scales", &k.scales, k.groups())?,
                        self.input(op, "v scales", &v.scales, k.groups())?,
                    ],
                    [int(op, "group", k.group)?, k.code.kernel_code()],
                ))
            }
            _ => Err(GpuError::Shape(format!(
                "{op}: K and V caches of different kinds"
            ))),
        }
    }
}

impl CachePair {
    /// Pushes the caches' kernel arguments (bf16: k, v; 8-bit: k and v codes, k and v scales, group,
    /// code).
    fn push<'b>(&'b self, l: &mut LaunchArgs<'b>) {
        match self {
            CachePair::Bf16(k, v) => {
                l.arg(k).arg(v);
            }
            CachePair::Q8(p, [group, code]) => {
                l.arg(&p[0])
                    .arg(&p[1])
                    .arg(&p[2])
                    .arg(&p[3])
                    .arg(group)
                    .arg(code);
            }
        }
    }
}

/// Head geometry of absorbed MLA (shared with the sparse-attention indexer's kernels).
pub use crate::cuda::indexer::MlaDims;

/// Threads of the attention kernels' blocks (one tile of positions per iteration).
const ATTN_THREADS: usize = 128;
/// `paged_attention` keeps two output dims per thread (and `paged_attention_warps` 8 per lane).
const MAX_PAGED_HEAD_DIM: usize = 2 * ATTN_THREADS;
/// `paged_attention_warps`' block: `PA_WARPS` warps of `segment.cu`.
const WARPS_ATTN_THREADS: usize = 8 * 32;

/// Which kernel runs GQA attention over the paged caches.
#[derive(Clone, Copy)]
enum PagedKernel {
    /// `paged_attention`: tiles of 128 positions, a thread per position then per output dim.
    Tiles,
    /// `paged_attention_warps`: runs of positions per warp, a lane per 8 dims.
    Warps,
}

impl GpuDevice {
    /// Writes rows `k` (`[rows, k_width]`) and `v` (`[rows, v_width]`) into the caches at
    /// `slot_of_row` (trusted: slots of the caches' blocks), rounded to bf16. MLA passes its latent and
    /// rope key as k and v.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &self,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        (rows, k_width, v_width): (usize, usize, usize),
        k_cache: &mut CudaSlice<bf16>,
        v_cache: &mut CudaSlice<bf16>,
        slot_of_row: &CudaSlice<i32>,
        block_size: usize,
    ) -> Result<(), GpuError> {
        const OP: &str = "kv_append";
        if rows == 0 {
            return Ok(());
        }
        int(OP, "rows", rows)?;
        let (kw, vw, blk) = (
            int(OP, "k_width", k_width)?,
            int(OP, "v_width", v_width)?,
            int(OP, "block_size", block_size)?,
        );
        let kp = self.input(OP, "k", k, rows * k_width)?;
        let vp = self.input(OP, "v", v, rows * v_width)?;
        let kc = self.output(OP, "k_cache", k_cache, k_width)?;
        let vc = self.output(OP, "v_cache", v_cache, v_width)?;
        let sl = self.input(OP, "slot_of_row", slot_of_row, rows)?;
        let mut l = self.stream.launch_builder(&self.k.kv_append);
        l.arg(&kp).arg(&vp).arg(&kw).arg(&vw).arg(&kc).arg(&vc);
        l.arg(&sl).arg(&blk);
        // SAFETY: argument order and types as kernels.cu's `kv_append`; block t reads row t of k and v
        // (checked) and writes cache row slot_of_row[t] (trusted to lie in the caches, see above).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// GQA attention of step rows `rows` against their sequences' paged caches (bf16 or 8-bit),
    /// positions `lo..=pos` of each row (`lo = pos - window + 1` for a sliding window, else 0), online
    /// softmax. `q`: `[step rows, heads, head_dim]` f32; `out`: bf16 rows of the same shape (only
    /// `rows` are written). One block of 128 threads per (row, head); head_dim ≤ 256.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &impl DevicePtr<f32>,
        caches: (CacheRows<'_>, CacheRows<'_>),
        index: &PagedIndex<'_>,
        heads: (usize, usize, usize),
        scale_window: (f32, Option<usize>),
        rows: Range<usize>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        let call = (q, caches, index, heads, scale_window);
        self.paged_attention_by(PagedKernel::Tiles, call, rows, out)
    }

    /// [`GpuDevice::paged_attention`] with each block's positions spread over its 8 warps in runs of 4
    /// (`segment.cu`'s `paged_attention_warps`): a key's dot product is one warp sum of coalesced
    /// loads and a warp keeps 4 keys' loads in flight, where the tile kernel has each thread walk a
    /// whole key and then every value row in turn. Same contract and results up to f32 summation
    /// order; the decode segment's attention (`MOE_GPU_SEGMENT`).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_warps(
        &self,
        q: &impl DevicePtr<f32>,
        caches: (CacheRows<'_>, CacheRows<'_>),
        index: &PagedIndex<'_>,
        heads: (usize, usize, usize),
        scale_window: (f32, Option<usize>),
        rows: Range<usize>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        let call = (q, caches, index, heads, scale_window);
        self.paged_attention_by(PagedKernel::Warps, call, rows, out)
    }

    #[allow(clippy::type_complexity)]
    fn paged_attention_by(
        &self,
        kernel: PagedKernel,
        (q, caches, index, (heads, kv_heads, head_dim), (scale, window)): (
            &impl DevicePtr<f32>,
            (CacheRows<'_>, CacheRows<'_>),
            &PagedIndex<'_>,
            (usize, usize, usize),
            (f32, Option<usize>),
        ),
        rows: Range<usize>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "paged_attention";
        if rows.is_empty() {
            return Ok(());
        }
        ensure(OP, head_dim <= MAX_PAGED_HEAD_DIM, || {
            format!("head_dim {head_dim} > {MAX_PAGED_HEAD_DIM}")
        })?;
        ensure(OP, kv_heads > 0 && heads % kv_heads == 0, || {
            format!("{heads} heads over {kv_heads} KV heads")
        })?;
        grid_dim(OP, "heads", heads)?;
        let end = rows.end;
        let args = (
            int(OP, "max_blocks", index.max_blocks)?,
            int(OP, "heads", heads)?,
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
            int(OP, "block_size", index.block_size)?,
            int(OP, "window", window.unwrap_or(0))?,
            int(OP, "row0", rows.start)?,
        );
        let (mb, h, kvh, dh, blk, win, row0) = args;
        let pair = self.cache_pair(OP, caches, kv_heads * head_dim)?;
        let qp = self.input(OP, "q", q, end * heads * head_dim)?;
        let tables = self.input(OP, "block_tables", index.block_tables, index.max_blocks)?;
        let seq = self.input(OP, "seq_of_row", index.seq_of_row, end)?;
        let pos = self.input(OP, "pos_of_row", index.pos_of_row, end)?;
        let o = self.output(OP, "out", out, end * heads * head_dim)?;
        let f = match (kernel, &pair) {
            (PagedKernel::Tiles, CachePair::Bf16(..)) => &self.k.paged_attention,
            (PagedKernel::Tiles, CachePair::Q8(..)) => &self.k.paged_attention_q8,
            (PagedKernel::Warps, CachePair::Bf16(..)) => &self.k.paged_attention_warps,
            (PagedKernel::Warps, CachePair::Q8(..)) => &self.k.paged_attention_warps_q8,
        };
        let mut l = self.stream.launch_builder(f);
        l.arg(&qp);
        pair.push(&mut l);
        l.arg(&tables).arg(&mb).arg(&seq).arg(&pos);
        l.arg(&h).arg(&kvh).arg(&dh).arg(&blk);
        l.arg(&scale).arg(&win).arg(&row0).arg(&o);
        let (threads, shared) = match kernel {
            PagedKernel::Tiles => (ATTN_THREADS, smem(OP, (head_dim + ATTN_THREADS) * 4)?),
            PagedKernel::Warps => (WARPS_ATTN_THREADS, 0),
        };
        // SAFETY: argument order and types as kernels.cu's `paged_attention` (bf16 caches) or kv_q8.cu's
        // `paged_attention_q8` (codes, scales, code in their place), and segment.cu's `_warps` twins
        // (same signatures); block (t, h) reads q and writes out at row row0 + t < rows.end (checked),
        // reads seq/pos of that row (checked) and the cache rows its table names (trusted, see
        // `PagedIndex`); the tile kernel's shared memory holds q and a tile, the warps kernel's is static.
        unsafe { l.launch(grid((rows.len(), heads, 1), threads, shared)) }?;
        Ok(())
    }

    /// Absorbed MLA attention of every step row (`rows`) against the paged latent and rope-key caches:
    /// `q_lat = W_ukᵀ q_nope`, scores over positions `0..=pos`, `o_lat = Σ p · latent`,
    /// `out = W_uv o_lat` (bf16 `[rows, heads, v_dim]`). `kv_b`: kv_b_proj `[heads · (nope + v_dim),
    /// lora]` f32. One block of 128 threads per (row, head).
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention(
        &self,
        q: &impl DevicePtr<f32>,
        latent_cache: &CudaSlice<bf16>,
        rope_cache: &CudaSlice<bf16>,
        index: &PagedIndex<'_>,
        rows: usize,
        d: MlaDims,
        kv_b: &CudaSlice<f32>,
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "mla_attention";
        if rows == 0 {
            return Ok(());
        }
        grid_dim(OP, "heads", d.heads)?;
        int(OP, "rows", rows)?;
        let mb = int(OP, "max_blocks", index.max_blocks)?;
        let (h, nope, rope) = (
            int(OP, "heads", d.heads)?,
            int(OP, "nope", d.nope)?,
            int(OP, "rope", d.rope)?,
        );
        let (lora, vd, blk) = (
            int(OP, "lora", d.lora)?,
            int(OP, "v_dim", d.v_dim)?,
            int(OP, "block_size", index.block_size)?,
        );
        let qp = self.input(OP, "q", q, rows * d.heads * (d.nope + d.rope))?;
        let lc = self.input(OP, "latent_cache", latent_cache, d.lora)?;
        let rc = self.input(OP, "rope_cache", rope_cache, d.rope)?;
        let tables = self.input(OP, "block_tables", index.block_tables, index.max_blocks)?;
        let seq = self.input(OP, "seq_of_row", index.seq_of_row, rows)?;
        let pos = self.input(OP, "pos_of_row", index.pos_of_row, rows)?;
        let kvb = self.input(OP, "kv_b", kv_b, d.heads * (d.nope + d.v_dim) * d.lora)?;
        let o = self.output(OP, "out", out, rows * d.heads * d.v_dim)?;
        let mut l = self.stream.launch_builder(&self.k.mla_attention);
        l.arg(&qp)
            .arg(&lc)
            .arg(&rc)
            .arg(&tables)
            .arg(&mb)
            .arg(&seq)
            .arg(&pos);
        l.arg(&h)
            .arg(&nope)
            .arg(&rope)
            .arg(&lora)
            .arg(&vd)
            .arg(&kvb)
            .arg(&blk);
        l.arg(&scale).arg(&o);
        let shared = smem(OP, (d.nope + d.rope + 2 * d.lora + ATTN_THREADS) * 4)?;
        // SAFETY: argument order and types as kernels.cu's `mla_attention`; block (t, h) reads row t
        // of q, seq and pos, head h's rows of kv_b and writes row t of out (all checked), and reads
        // the cache rows its table names (trusted, see `PagedIndex`); shared memory holds q's parts,
        // the latent query and output and a score tile.
        unsafe { l.launch(grid((rows, d.heads, 1), ATTN_THREADS, shared)) }?;
        Ok(())
    }

    /// Positions `0..positions` of one sequence (block table `table`, trusted as in [`PagedIndex`])
    /// from the paged caches into contiguous bf16 `k_out` `[positions, k_width]` and `v_out`
    /// `[positions, v_width]` (long prefill's GEMM operands). 8-bit caches read back as
    /// bf16(value(code) · scale); their K and V widths are the rows' `kv_heads · head_dim`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_kv(
        &self,
        caches: (CacheRows<'_>, CacheRows<'_>),
        table: &impl DevicePtr<i32>,
        (positions, block_size): (usize, usize),
        (k_width, v_width): (usize, usize),
        k_out: &mut impl DevicePtrMut<bf16>,
        v_out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "gather_kv";
        if positions == 0 {
            return Ok(());
        }
        int(OP, "positions", positions)?;
        let (blk, kw, vw) = (
            int(OP, "block_size", block_size)?,
            int(OP, "k_width", k_width)?,
            int(OP, "v_width", v_width)?,
        );
        let pair = match caches {
            (CacheRows::Bf16(k), CacheRows::Bf16(v)) => CachePair::Bf16(
                self.input(OP, "k_cache", k, k_width)?,
                self.input(OP, "v_cache", v, v_width)?,
            ),
            _ => {
                ensure(OP, k_width == v_width, || {
                    format!("8-bit K and V rows of widths {k_width} and {v_width}")
                })?;
                self.cache_pair(OP, caches, k_width)?
            }
        };
        let tp = self.input(OP, "table", table, positions.div_ceil(block_size.max(1)))?;
        let ko = self.output(OP, "k_out", k_out, positions * k_width)?;
        let vo = self.output(OP, "v_out", v_out, positions * v_width)?;
        let mut l = match &pair {
            CachePair::Bf16(..) => self.stream.launch_builder(&self.k.gather_kv_bf16),
            CachePair::Q8(..) => self.stream.launch_builder(&self.k.gather_kv_q8),
        };
        pair.push(&mut l);
        l.arg(&tp).arg(&blk);
        match &pair {
            CachePair::Bf16(..) => l.arg(&kw).arg(&vw),
            CachePair::Q8(..) => l.arg(&kw),
        };
        l.arg(&ko).arg(&vo);
        // SAFETY: argument order and types as kernels.cu's `gather_kv_bf16` (k, v, table, block_size,
        // k_width, v_width, outputs) or kv_q8.cu's `gather_kv_q8` (codes, scales, group, code, table,
        // block_size, width, outputs); block p reads table entry p / block_size (checked) and the
        // cache row it names (trusted), and writes row p of the outputs (checked).
        unsafe { l.launch(grid((positions, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// Causal softmax of scaled scores `s` (`rows` rows of `lk` keys; row r is the query at absolute
    /// position `q_pos0 + r % rows_per_head`, keys at positions `0..lk`) into bf16 probabilities `p`,
    /// masked keys exactly 0 (and, with a `window`, keys before `q - window + 1`). One block per row.
    #[allow(clippy::too_many_arguments)]
    pub fn causal_softmax_rows(
        &self,
        s: &impl DevicePtr<f32>,
        (rows, lk): (usize, usize),
        rows_per_head: usize,
        q_pos0: usize,
        window: Option<usize>,
        p: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "causal_softmax_rows";
        if rows == 0 {
            return Ok(());
        }
        int(OP, "rows", rows)?;
        let (lk_i, rph, qp0, win) = (
            int(OP, "lk", lk)?,
            int(OP, "rows_per_head", rows_per_head)?,
            int(OP, "q_pos0", q_pos0)?,
            int(OP, "window", window.unwrap_or(0))?,
        );
        let sp = self.input(OP, "s", s, rows * lk)?;
        let pp = self.output(OP, "p", p, rows * lk)?;
        let mut l = self.stream.launch_builder(&self.k.causal_softmax_rows);
        l.arg(&sp).arg(&lk_i).arg(&rph).arg(&qp0).arg(&win).arg(&pp);
        // SAFETY: argument order and types as kernels.cu's `causal_softmax_rows`; block r reads row r of
        // s and writes row r of p (rows·lk checked).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }
}
