//! The FP8 KV cache (`--kv-cache-dtype fp8`): rows of E4M3 codes with one f32 scale per cache row and
//! KV head (`kv_fp8.cu`). Per row and head, scale = amax / 448 and code = e4m3(value / scale), so every
//! head uses the whole E4M3 range without calibration; reading gives e4m3(code) · scale. A row costs
//! `width + 4 · kv_heads` bytes against `2 · width` in bf16 (52 % for 128-wide heads).
//!
//! Ops: [`GpuDevice::kv_append_fp8`] (write a step's rows), [`GpuDevice::paged_attention_fp8`] (GQA
//! attention of decode rows and short chunks, the bf16 kernel's code over FP8 reads) and
//! [`GpuDevice::gather_kv_fp8`] (rows → contiguous bf16 for long prefill's GEMMs). [`quantize_row`] is
//! the host twin the GPU tests compare the kernel's codes and scales with. Cache rows are addressed
//! as in [`super::ops::PagedIndex`].
use super::ops::{ensure, grid, grid_dim, int, smem, PagedIndex};
use super::quant::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use std::ops::Range;

/// One cache's rows in FP8: `codes` `[rows, kv_heads · head_dim]`, `scales` `[rows, kv_heads]`.
pub struct Fp8Rows {
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<f32>,
}

impl Fp8Rows {
    /// Zeroed rows for `rows` positions of `kv_heads × head_dim` values.
    pub fn alloc(
        dev: &GpuDevice,
        rows: usize,
        (kv_heads, head_dim): (usize, usize),
    ) -> Result<Self, GpuError> {
        Ok(Self {
            codes: dev
                .stream
                .alloc_zeros::<u8>((rows * kv_heads * head_dim).max(1))?,
            scales: dev.stream.alloc_zeros::<f32>((rows * kv_heads).max(1))?,
        })
    }

    /// Device bytes of `rows` positions.
    pub fn bytes_for(rows: usize, (kv_heads, head_dim): (usize, usize)) -> usize {
        rows * kv_heads * (head_dim + std::mem::size_of::<f32>())
    }
}

/// Threads of the attention kernel's blocks (as the bf16 `paged_attention`).
const ATTN_THREADS: usize = 128;

/// The host twin of `kv_append_fp8` for one head's values: (codes, scale).
pub fn quantize_row(values: &[f32]) -> (Vec<u8>, f32) {
    let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
    (values.iter().map(|&v| f32_to_e4m3(v / s)).collect(), s)
}

/// What a row quantized by [`quantize_row`] reads back as.
pub fn dequantize_row(codes: &[u8], scale: f32) -> Vec<f32> {
    codes.iter().map(|&c| e4m3_to_f32(c) * scale).collect()
}

impl GpuDevice {
    /// Writes rows `k` and `v` (`[rows, kv_heads · head_dim]` f32) into FP8 cache rows `slot_of_row`
    /// (trusted: rows of the caches). One block per row, one warp per head at a time.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append_fp8(
        &self,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        (rows, kv_heads, head_dim): (usize, usize, usize),
        k_cache: &mut Fp8Rows,
        v_cache: &mut Fp8Rows,
        slot_of_row: &CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "kv_append_fp8";
        if rows == 0 {
            return Ok(());
        }
        int(OP, "rows", rows)?;
        let width = kv_heads * head_dim;
        let (kvh, dh) = (
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
        );
        let kp = self.input(OP, "k", k, rows * width)?;
        let vp = self.input(OP, "v", v, rows * width)?;
        let kc = self.output(OP, "k codes", &mut k_cache.codes, width)?;
        let vc = self.output(OP, "v codes", &mut v_cache.codes, width)?;
        let ks = self.output(OP, "k scales", &mut k_cache.scales, kv_heads)?;
        let vs = self.output(OP, "v scales", &mut v_cache.scales, kv_heads)?;
        let sl = self.input(OP, "slot_of_row", slot_of_row, rows)?;
        let mut l = self.stream.launch_builder(&self.k.kv_append_fp8);
        l.arg(&kp).arg(&vp).arg(&kvh).arg(&dh);
        l.arg(&kc).arg(&vc).arg(&ks).arg(&vs).arg(&sl);
        // SAFETY: argument order and types as kv_fp8.cu's `kv_append_fp8`; block t reads row t of k and
        // v (checked) and writes codes and scales of cache row slot_of_row[t] (trusted, see above).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// [`GpuDevice::paged_attention`] over FP8 caches: GQA attention of step rows `rows`, positions
    /// `lo..=pos` of each (`lo = pos - window + 1` with a sliding window), online softmax; `q` `[step
    /// rows, heads, head_dim]` f32, `out` bf16 rows of the same shape. head_dim ≤ 256.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_fp8(
        &self,
        q: &impl DevicePtr<f32>,
        k_cache: &Fp8Rows,
        v_cache: &Fp8Rows,
        index: &PagedIndex<'_>,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        (scale, window): (f32, Option<usize>),
        rows: Range<usize>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "paged_attention_fp8";
        if rows.is_empty() {
            return Ok(());
        }
        ensure(OP, head_dim <= 2 * ATTN_THREADS, || {
            format!("head_dim {head_dim} > {}", 2 * ATTN_THREADS)
        })?;
        ensure(OP, kv_heads > 0 && heads % kv_heads == 0, || {
            format!("{heads} heads over {kv_heads} KV heads")
        })?;
        grid_dim(OP, "heads", heads)?;
        let end = rows.end;
        let (mb, h, kvh, dh, blk, win, row0) = (
            int(OP, "max_blocks", index.max_blocks)?,
            int(OP, "heads", heads)?,
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
            int(OP, "block_size", index.block_size)?,
            int(OP, "window", window.unwrap_or(0))?,
            int(OP, "row0", rows.start)?,
        );
        let width = kv_heads * head_dim;
        let qp = self.input(OP, "q", q, end * heads * head_dim)?;
        let kc = self.input(OP, "k codes", &k_cache.codes, width)?;
        let vc = self.input(OP, "v codes", &v_cache.codes, width)?;
        let ks = self.input(OP, "k scales", &k_cache.scales, kv_heads)?;
        let vs = self.input(OP, "v scales", &v_cache.scales, kv_heads)?;
        let tables = self.input(OP, "block_tables", index.block_tables, index.max_blocks)?;
        let seq = self.input(OP, "seq_of_row", index.seq_of_row, end)?;
        let pos = self.input(OP, "pos_of_row", index.pos_of_row, end)?;
        let o = self.output(OP, "out", out, end * heads * head_dim)?;
        let mut l = self.stream.launch_builder(&self.k.paged_attention_fp8);
        l.arg(&qp).arg(&kc).arg(&vc).arg(&ks).arg(&vs);
        l.arg(&tables).arg(&mb).arg(&seq).arg(&pos);
        l.arg(&h).arg(&kvh).arg(&dh).arg(&blk);
        l.arg(&scale).arg(&win).arg(&row0).arg(&o);
        let shared = smem(OP, (head_dim + ATTN_THREADS) * 4)?;
        // SAFETY: argument order and types as kv_fp8.cu's `paged_attention_fp8`; block (t, h) reads q
        // and writes out at row row0 + t < rows.end (checked), reads seq/pos of that row (checked) and
        // the cache rows (codes and scales) its table names (trusted, see `PagedIndex`).
        unsafe { l.launch(grid((rows.len(), heads, 1), ATTN_THREADS, shared)) }?;
        Ok(())
    }

    /// Positions `0..positions` of one sequence (block table `table`, trusted) from FP8 caches into
    /// contiguous bf16 `k_out` / `v_out` `[positions, kv_heads · head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_kv_fp8(
        &self,
        k_cache: &Fp8Rows,
        v_cache: &Fp8Rows,
        table: &impl DevicePtr<i32>,
        (positions, block_size): (usize, usize),
        (kv_heads, head_dim): (usize, usize),
        k_out: &mut impl DevicePtrMut<bf16>,
        v_out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "gather_kv_fp8";
        if positions == 0 {
            return Ok(());
        }
        int(OP, "positions", positions)?;
        let width = kv_heads * head_dim;
        let (blk, kvh, dh) = (
            int(OP, "block_size", block_size)?,
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
        );
        let kc = self.input(OP, "k codes", &k_cache.codes, width)?;
        let vc = self.input(OP, "v codes", &v_cache.codes, width)?;
        let ks = self.input(OP, "k scales", &k_cache.scales, kv_heads)?;
        let vs = self.input(OP, "v scales", &v_cache.scales, kv_heads)?;
        let tp = self.input(OP, "table", table, positions.div_ceil(block_size.max(1)))?;
        let ko = self.output(OP, "k_out", k_out, positions * width)?;
        let vo = self.output(OP, "v_out", v_out, positions * width)?;
        let mut l = self.stream.launch_builder(&self.k.gather_kv_fp8);
        l.arg(&kc).arg(&vc).arg(&ks).arg(&vs).arg(&tp);
        l.arg(&blk).arg(&kvh).arg(&dh).arg(&ko).arg(&vo);
        // SAFETY: argument order and types as kv_fp8.cu's `gather_kv_fp8`; block p reads table entry
        // p / block_size (checked) and the cache row it names (trusted), and writes row p of the
        // outputs (checked).
        unsafe { l.launch(grid((positions, 1, 1), 256, 0)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_keep_each_heads_range_within_e4m3_precision() {
        // a head of small values beside one of large values: each gets its own scale
        let small: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) * 1e-4).collect();
        let large: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) * 3.0).collect();
        for head in [&small, &large] {
            let (codes, s) = quantize_row(head);
            let back = dequantize_row(&codes, s);
            let amax = head.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(back.iter().fold(0f32, |m, v| m.max(v.abs())), amax);
            for (a, b) in head.iter().zip(&back) {
                // 3 mantissa bits: rounding error ≤ 2^-4 relative for normal values, ≤ half the
                // subnormal step 2^-9 (in units of the scale) below 2^-6
                assert!(
                    (a - b).abs() <= a.abs() / 16.0 + s * 2f32.powi(-10),
                    "{a} {b}"
                );
            }
        }
        let (codes, s) = quantize_row(&[0.0; 8]);
        assert_eq!((codes, s), (vec![0; 8], 1.0));
    }
}
