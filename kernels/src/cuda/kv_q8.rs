//! The 8-bit KV cache (`--kv-cache-dtype int8|fp8`): rows of 8-bit codes with one f32 scale per group
//! of [`scale_group`] values of a row (32 for the usual head widths; a group stays within one KV head),
//! read back as value(code) · scale (`kv_q8.cu`). Two codes:
//!
//! - [`KvCode::Int8`]: scale = amax / 127, code = round(value / scale) (llama.cpp's q8_0: blocks of 32).
//!   The error is at most scale / 2: ~0.5 % RMS of a Gaussian group, and a large channel only coarsens
//!   the 31 values of its own block (with one scale per 64-wide head, SmolLM2's perplexity moved
//!   +0.33 % against bf16 K/V; with blocks of 32, −0.3 %, within noise: transformers, see
//!   docs/CONSUMER-GPU.md).
//! - [`KvCode::E4m3`]: scale = amax / 448, code = e4m3(value / scale) (vLLM's `fp8`, with per-row
//!   scales instead of calibrated per-tensor ones). Three mantissa bits: up to 6.25 % per value
//!   however the scale is chosen, ~2.5 % RMS: about five times the int8 code's error on such rows.
//!
//! A row costs `width · (1 + 4 / group)` bytes against `2 · width` in bf16 (56 % with groups of 32),
//! either code. The append kernel writes the codes; the attention and gather ops of
//! [`super::ops::attention`] read them through [`super::ops::CacheRows::Q8`]. [`quantize_row`] is the
//! host twin the GPU tests compare the kernel's codes and scales with.
use super::ops::grid;
use super::ops::int;
use super::quant::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};

/// How an 8-bit KV cache encodes a value divided by its row's scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCode {
    /// E4M3 (fn), saturating at ±448.
    E4m3,
    /// Signed integers −127..=127.
    Int8,
}

impl KvCode {
    /// The code magnitude a row's amax maps onto.
    pub fn max(self) -> f32 {
        match self {
            KvCode::E4m3 => E4M3_MAX,
            KvCode::Int8 => 127.0,
        }
    }

    /// `KV_CODE_*` of kv_q8.cu.
    pub(crate) fn kernel_code(self) -> i32 {
        match self {
            KvCode::E4m3 => 0,
            KvCode::Int8 => 1,
        }
    }

    fn encode(self, x: f32) -> u8 {
        match self {
            KvCode::E4m3 => f32_to_e4m3(x),
            // round half to even, as the kernel's __float2int_rn
            KvCode::Int8 => x.clamp(-127.0, 127.0).round_ties_even() as i8 as u8,
        }
    }

    fn decode(self, c: u8) -> f32 {
        match self {
            KvCode::E4m3 => e4m3_to_f32(c),
            KvCode::Int8 => c as i8 as f32,
        }
    }
}

/// Values per scale of an 8-bit cache row with heads `head_dim` wide: the largest of 32, 16 and 8 that
/// divides it (so a group stays within a head), else the whole head.
pub fn scale_group(head_dim: usize) -> usize {
    [32, 16, 8]
        .into_iter()
        .find(|g| head_dim.is_multiple_of(*g))
        .unwrap_or(head_dim.max(1))
}

/// One cache's rows in 8 bits: `codes` `[rows, kv_heads · head_dim]`, `scales` `[rows, kv_heads ·
/// head_dim / group]`.
pub struct Q8Rows {
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<f32>,
    pub code: KvCode,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Values per scale ([`scale_group`] of head_dim).
    pub group: usize,
}

impl Q8Rows {
    /// Zeroed rows for `rows` positions of `kv_heads × head_dim` values.
    pub fn alloc(
        dev: &GpuDevice,
        rows: usize,
        (kv_heads, head_dim): (usize, usize),
        code: KvCode,
    ) -> Result<Self, GpuError> {
        let group = scale_group(head_dim);
        let width = kv_heads * head_dim;
        Ok(Self {
            codes: dev.stream.alloc_zeros::<u8>((rows * width).max(1))?,
            scales: dev
                .stream
                .alloc_zeros::<f32>((rows * width / group).max(1))?,
            code,
            kv_heads,
            head_dim,
            group,
        })
    }

    /// Device bytes of `rows` positions.
    pub fn bytes_for(rows: usize, (kv_heads, head_dim): (usize, usize)) -> usize {
        let width = kv_heads * head_dim;
        rows * (width + width / scale_group(head_dim) * std::mem::size_of::<f32>())
    }

    /// Values per row (`kv_heads · head_dim`).
    pub fn width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Scales per row.
    pub fn groups(&self) -> usize {
        self.width() / self.group
    }
}

/// The host twin of `kv_append_q8` for one scale group's values: (codes, scale).
pub fn quantize_row(values: &[f32], code: KvCode) -> (Vec<u8>, f32) {
    let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = if amax > 0.0 { amax / code.max() } else { 1.0 };
    (values.iter().map(|&v| code.encode(v / s)).collect(), s)
}

/// What a row quantized by [`quantize_row`] reads back as.
pub fn dequantize_row(codes: &[u8], scale: f32, code: KvCode) -> Vec<f32> {
    codes.iter().map(|&c| code.decode(c) * scale).collect()
}

impl GpuDevice {
    /// Writes rows `k` and `v` (`[rows, kv_heads · head_dim]` f32, the caches' geometry) into 8-bit
    /// cache rows `slot_of_row` (trusted: rows of the caches). One block per row, one warp per scale
    /// group at a time.
    pub fn kv_append_q8(
        &self,
        (k, v): (&impl DevicePtr<f32>, &impl DevicePtr<f32>),
        rows: usize,
        k_cache: &mut Q8Rows,
        v_cache: &mut Q8Rows,
        slot_of_row: &CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "kv_append_q8";
        if rows == 0 {
            return Ok(());
        }
        super::ops::ensure(
            OP,
            (
                k_cache.kv_heads,
                k_cache.head_dim,
                k_cache.group,
                k_cache.code,
            ) == (
                v_cache.kv_heads,
                v_cache.head_dim,
                v_cache.group,
                v_cache.code,
            ),
            || "K and V caches of different geometry or code".into(),
        )?;
        int(OP, "rows", rows)?;
        let (width, groups) = (k_cache.width(), k_cache.groups());
        let (w, g, code) = (
            int(OP, "width", width)?,
            int(OP, "group", k_cache.group)?,
            k_cache.code.kernel_code(),
        );
        let kp = self.input(OP, "k", k, rows * width)?;
        let vp = self.input(OP, "v", v, rows * width)?;
        let kc = self.output(OP, "k codes", &mut k_cache.codes, width)?;
        let vc = self.output(OP, "v codes", &mut v_cache.codes, width)?;
        let ks = self.output(OP, "k scales", &mut k_cache.scales, groups)?;
        let vs = self.output(OP, "v scales", &mut v_cache.scales, groups)?;
        let sl = self.input(OP, "slot_of_row", slot_of_row, rows)?;
        let mut l = self.stream.launch_builder(&self.k.kv_append_q8);
        l.arg(&kp).arg(&vp).arg(&w).arg(&g).arg(&code);
        l.arg(&kc).arg(&vc).arg(&ks).arg(&vs).arg(&sl);
        // SAFETY: argument order and types as kv_q8.cu's `kv_append_q8`; block t reads row t of k and
        // v (checked) and writes codes and scales of cache row slot_of_row[t] (trusted, see above).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A head of small values beside one of large values: each gets its own scale and reads back
    /// within the code's precision, and the row's amax exactly.
    #[test]
    fn rows_keep_each_heads_range_within_the_codes_precision() {
        let small: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) * 1e-4).collect();
        let large: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) * 3.0).collect();
        for head in [&small, &large] {
            let amax = head.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (codes, s) = quantize_row(head, KvCode::E4m3);
            let back = dequantize_row(&codes, s, KvCode::E4m3);
            assert_eq!(back.iter().fold(0f32, |m, v| m.max(v.abs())), amax);
            for (a, b) in head.iter().zip(&back) {
                // 3 mantissa bits: rounding error ≤ 2^-4 relative for normal values, ≤ half the
                // subnormal step 2^-9 (in units of the scale) below 2^-6
                assert!(
                    (a - b).abs() <= a.abs() / 16.0 + s * 2f32.powi(-10),
                    "{a} {b}"
                );
            }
            let (codes, s) = quantize_row(head, KvCode::Int8);
            let back = dequantize_row(&codes, s, KvCode::Int8);
            assert!((back.iter().fold(0f32, |m, v| m.max(v.abs())) - amax).abs() <= amax * 1e-6);
            for (a, b) in head.iter().zip(&back) {
                // half a step of amax / 127, plus the f32 division's rounding
                assert!((a - b).abs() <= s * 0.5 * (1.0 + 1e-5), "{a} {b}");
            }
        }
        for code in [KvCode::E4m3, KvCode::Int8] {
            let (codes, s) = quantize_row(&[0.0; 8], code);
            assert_eq!((codes, s), (vec![0; 8], 1.0));
        }
        // int8 codes are two's complement bytes; ties round to even as the kernel does
        let (codes, _) = quantize_row(&[-127.0, 0.5, 1.5, 2.5], KvCode::Int8);
        assert_eq!(codes, vec![(-127i8) as u8, 0, 2, 2]);
    }

    /// On Gaussian-like rows the int8 code is about five times more accurate than E4M3 (0.5 % against
    /// 2.5 % RMS on this row).
    #[test]
    fn int8_rows_are_more_accurate_than_e4m3_rows() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f32 / (1u64 << 53) as f32
        };
        // sum of 4 uniforms: roughly Gaussian
        let row: Vec<f32> = (0..128)
            .map(|_| (0..4).map(|_| next() - 0.5).sum())
            .collect();
        let err = |code| {
            let (c, s) = quantize_row(&row, code);
            let back = dequantize_row(&c, s, code);
            let num: f32 = row.iter().zip(&back).map(|(a, b)| (a - b) * (a - b)).sum();
            (num / row.iter().map(|a| a * a).sum::<f32>()).sqrt()
        };
        let (e4m3, int8) = (err(KvCode::E4m3), err(KvCode::Int8));
        assert!(
            int8 < 0.01 && e4m3 > 0.015 && e4m3 > 3.0 * int8,
            "{e4m3} {int8}"
        );
    }
}
