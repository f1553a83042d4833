//! Normalisations: row RMSNorm, per-head RMSNorm with RoPE, and MLA's latent split.
use super::{ensure, grid, grid_dim, int};
use crate::cuda::{GpuDevice, GpuError};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

/// How RoPE pairs the rotary dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotaryStyle {
    /// `rotate_half`: dimension i with i + rotary_dim / 2 (Llama, Qwen, GLM).
    Neox,
    /// Adjacent pairs (2i, 2i + 1) (DeepSeek MLA with `rope_interleave`).
    Interleaved,
}

impl RotaryStyle {
    /// `qk_norm_rope`'s `style` argument.
    pub(super) fn code(self) -> i32 {
        match self {
            RotaryStyle::Neox => 0,
            RotaryStyle::Interleaved => 1,
        }
    }
}

/// RoPE applied by [`GpuDevice::qk_norm_rope`]: dims `offset..offset + rotary_dim` of each head are
/// rotated by `position · inv_freq[i]` and scaled by `attn_factor` (YaRN's mscale; 1 otherwise).
pub struct Rotation<'a> {
    /// Position of each row of the step (device, trusted to index nothing: read as values).
    pub positions: &'a CudaSlice<i32>,
    /// `rotary_dim / 2` inverse frequencies.
    pub inv_freq: &'a CudaSlice<f32>,
    pub attn_factor: f32,
    pub rotary_dim: usize,
    /// First rotary dimension within a head (MLA: after the no-position part).
    pub offset: usize,
    pub style: RotaryStyle,
}

/// `qk_norm_rope` keeps a head in a 1024-float shared array.
const MAX_HEAD_DIM: usize = 1024;

/// A [`Rotation`]'s kernel arguments (`norm_rope_head`'s): positions and inverse frequencies
/// (device addresses), attention factor, rotary width, style code, first rotary dim. No rotation: a
/// rotary width of 0 (the kernels then read neither positions nor frequencies).
pub(super) struct RotationArgs {
    pub positions: u64,
    pub inv_freq: u64,
    pub attn_factor: f32,
    pub rotary_dim: i32,
    pub style: i32,
    pub offset: i32,
}

impl GpuDevice {
    /// `rope`'s arguments for a launch over `rows` rows of heads of `head_dim`, checked: its rotary
    /// dims lie within the head, and start at 0 unless `allow_offset` (kernels that rotate GQA heads).
    pub(super) fn rotation_inputs(
        &self,
        op: &str,
        rope: Option<&Rotation<'_>>,
        (rows, head_dim): (usize, usize),
        allow_offset: bool,
    ) -> Result<RotationArgs, GpuError> {
        let Some(r) = rope else {
            return Ok(RotationArgs {
                positions: 0,
                inv_freq: 0,
                attn_factor: 1.0,
                rotary_dim: 0,
                style: 0,
                offset: 0,
            });
        };
        ensure(
            op,
            (allow_offset || r.offset == 0) && r.offset + r.rotary_dim <= head_dim,
            || {
                let from = if allow_offset { "" } else { " (from dim 0)" };
                format!(
                    "rotary dims {}..{} outside head_dim {head_dim}{from}",
                    r.offset,
                    r.offset + r.rotary_dim
                )
            },
        )?;
        Ok(RotationArgs {
            positions: self.input(op, "positions", r.positions, rows)?,
            inv_freq: self.input(op, "inv_freq", r.inv_freq, r.rotary_dim / 2)?,
            attn_factor: r.attn_factor,
            rotary_dim: int(op, "rotary_dim", r.rotary_dim)?,
            style: r.style.code(),
            offset: int(op, "offset", r.offset)?,
        })
    }
}

impl GpuDevice {
    /// `out_bf16[r] = x[r] · w / rms(x[r])` for `rows` rows of `dim`, and the same in f32 into
    /// `out_f32` when given. One block of 256 threads per row.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        eps: f32,
        (rows, dim): (usize, usize),
        out_bf16: &mut impl DevicePtrMut<bf16>,
        out_f32: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), GpuError> {
        const OP: &str = "rms_norm";
        if rows == 0 {
            return Ok(());
        }
        let dim_i = int(OP, "dim", dim)?;
        int(OP, "rows", rows)?;
        let x = self.input(OP, "x", x, rows * dim)?;
        let w = self.input(OP, "w", w, dim)?;
        let ob = self.output(OP, "out_bf16", out_bf16, rows * dim)?;
        let of = match out_f32 {
            Some(o) => self.output(OP, "out_f32", o, rows * dim)?,
            None => 0,
        };
        let mut l = self.stream.launch_builder(&self.k.rms_norm);
        l.arg(&x).arg(&w).arg(&eps).arg(&dim_i).arg(&ob).arg(&of);
        // SAFETY: argument order and types are those of kernels.cu's `rms_norm`; block r reads row r
        // of x (rows·dim checked) and w (dim), and writes row r of the outputs (checked, or null).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// In place on `x` (`[rows, heads, head_dim]`): each head RMS-normalised with `norm` (weights
    /// `[head_dim]`, eps) when given, then rotated by `rope` when given. Neither: nothing to do. One
    /// block per (row, head), one thread per dimension (head_dim ≤ 1024).
    pub fn qk_norm_rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        (rows, heads, head_dim): (usize, usize, usize),
        norm: Option<(&CudaSlice<f32>, f32)>,
        rope: Option<&Rotation<'_>>,
    ) -> Result<(), GpuError> {
        const OP: &str = "qk_norm_rope";
        if (norm.is_none() && rope.is_none()) || rows == 0 {
            return Ok(());
        }
        ensure(OP, head_dim <= MAX_HEAD_DIM, || {
            format!("head_dim {head_dim} > {MAX_HEAD_DIM}")
        })?;
        grid_dim(OP, "heads", heads)?;
        let (heads_i, dh_i) = (int(OP, "heads", heads)?, int(OP, "head_dim", head_dim)?);
        int(OP, "rows", rows)?;
        let xp = self.output(OP, "x", x, rows * heads * head_dim)?;
        let (nw, eps) = match norm {
            Some((w, eps)) => (self.input(OP, "norm", w, head_dim)?, eps),
            None => (0, 0.0),
        };
        let r = self.rotation_inputs(OP, rope, (rows, head_dim), true)?;
        let mut l = self.stream.launch_builder(&self.k.qk_norm_rope);
        l.arg(&xp).arg(&heads_i).arg(&dh_i).arg(&nw).arg(&eps);
        l.arg(&r.positions)
            .arg(&r.inv_freq)
            .arg(&r.attn_factor)
            .arg(&r.rotary_dim)
            .arg(&r.style)
            .arg(&r.offset);
        let threads = head_dim.div_ceil(32) * 32;
        // SAFETY: argument order and types as kernels.cu's `qk_norm_rope`; block (t, h) reads and writes
        // head h of row t (rows·heads·head_dim checked), the norm weights (head_dim) and, when rotating,
        // positions[t] and inv_freq[0..rotary_dim/2] (checked); head_dim ≤ 1024 fits its shared array.
        unsafe { l.launch(grid((rows, heads, 1), threads, 0)) }?;
        Ok(())
    }

    /// MLA: `ckv` (`[rows, lora + rope]`, kv_a_proj_with_mqa's output) → the RMS-normalised latent
    /// `[rows, lora]` (weights `w`, eps) and the not yet rotated shared key `[rows, rope]`.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_split_latent(
        &self,
        ckv: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        eps: f32,
        (rows, lora, rope): (usize, usize, usize),
        latent: &mut impl DevicePtrMut<f32>,
        krope: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "mla_split_latent";
        if rows == 0 {
            return Ok(());
        }
        int(OP, "rows", rows)?;
        let (lora_i, rope_i) = (int(OP, "lora", lora)?, int(OP, "rope", rope)?);
        let c = self.input(OP, "ckv", ckv, rows * (lora + rope))?;
        let w = self.input(OP, "w", w, lora)?;
        let lat = self.output(OP, "latent", latent, rows * lora)?;
        let kr = self.output(OP, "krope", krope, rows * rope)?;
        let mut l = self.stream.launch_builder(&self.k.mla_split_latent);
        l.arg(&c).arg(&w).arg(&eps).arg(&lora_i).arg(&rope_i);
        l.arg(&lat).arg(&kr);
        // SAFETY: argument order and types as kernels.cu's `mla_split_latent`; block t reads row t of
        // ckv and writes row t of latent and krope (all checked above).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }
}
