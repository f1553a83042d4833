//! KDA-style gated delta-rule linear attention on the GPU (GLM-5.3-Flash's linear layers): the short
//! causal convolution with its per-sequence tail, the q/k normalisation with the forget gate and β, the
//! recurrence, and the gated RMSNorm. One typed launch per kernel of `hybrid.cu`.
//!
//! Cost: the recurrence reads and writes each sequence's `heads × d × d` state once per step (64 KiB per
//! head at d = 128). Token by token ([`KdaMethod::PerToken`]) it runs a sequence's tokens one after
//! another, each a dependent update of the state: right for decode (one token), latency-bound for a
//! prompt. In chunks ([`KdaMethod::Chunked`], the WY form) it updates the state once per 16 tokens,
//! the work within a chunk being small matrix products: what prefill uses.
use super::hybrid::{cfg, check, HybridKernels, SegmentIndex, StateTable};
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

/// The activation after the convolution (`hidden_act`), as `hybrid.cu` codes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvActivation {
    Silu,
    GeluTanh,
    Relu,
}

impl ConvActivation {
    fn code(self) -> i32 {
        match self {
            Self::Silu => 0,
            Self::GeluTanh => 1,
            Self::Relu => 2,
        }
    }
}

/// Shape of one linear-attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KdaShape {
    pub heads: usize,
    /// Key and value width per head (≤ 128).
    pub head_dim: usize,
    pub conv_kernel: usize,
    /// Forget gate `lb · sigmoid(exp(A_log) · x)` when set, `-exp(A_log) · softplus(x)` otherwise.
    pub lower_bound: Option<f32>,
}

impl KdaShape {
    /// Width of q, k and v each.
    pub fn qkv(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Floats of one sequence's state in one layer: the matrices, then the convolution tail.
    pub fn state_floats(&self) -> usize {
        self.heads * self.head_dim * self.head_dim + self.conv_floats()
    }

    fn conv_floats(&self) -> usize {
        (self.conv_kernel - 1) * 3 * self.qkv()
    }

    fn check(&self) -> Result<(), GpuError> {
        check(
            self.head_dim > 0 && self.head_dim <= 128 && self.heads > 0 && self.conv_kernel >= 1,
            || format!("linear attention shape {self:?}: head_dim must be 1..=128"),
        )
    }
}

/// How the recurrence walks a segment's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaMethod {
    /// One dependent state update per token (`kda_recurrent`).
    PerToken,
    /// One state update per chunk of [`KDA_CHUNK`] tokens (`kda_chunked`).
    Chunked,
}

/// Tokens per chunk of [`KdaMethod::Chunked`] (`KDA_CHUNK` in `hybrid.cu`).
pub const KDA_CHUNK: usize = 16;

impl KdaMethod {
    /// The method for a step whose longest segment has `max_len` rows: chunks once a segment fills
    /// one, tokens otherwise (decode, short chunks). `MOE_KDA_METHOD=token|chunked` forces one (A/B
    /// runs).
    pub fn for_step(max_len: usize) -> Self {
        static FORCED: std::sync::OnceLock<Option<KdaMethod>> = std::sync::OnceLock::new();
        let forced = FORCED.get_or_init(|| match std::env::var("MOE_KDA_METHOD").as_deref() {
            Ok("token") => Some(Self::PerToken),
            Ok("chunked") => Some(Self::Chunked),
            _ => None,
        });
        if let Some(m) = forced {
            return *m;
        }
        if max_len >= KDA_CHUNK {
            Self::Chunked
        } else {
            Self::PerToken
        }
    }
}

const BLOCK: u32 = 128;
const ELEMS: u32 = 256;

impl HybridKernels {
    /// `out = act(conv(x))` over each segment's rows `[rows, 3·qkv]` with the segment's convolution tail
    /// (layer part at `layer_off` floats of each state), then the tails advanced to the segments' ends.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_conv(
        &self,
        dev: &GpuDevice,
        shape: KdaShape,
        act: ConvActivation,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        seg: &SegmentIndex,
        states: &mut StateTable<'_>,
        layer_off: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        shape.check()?;
        let ch = 3 * shape.qkv();
        let conv_off = layer_off + shape.state_floats() - shape.conv_floats();
        states.check_part(seg, conv_off, shape.conv_floats())?;
        check(
            x.len() >= seg.rows * ch
                && out.len() >= seg.rows * ch
                && weight.len() >= ch * shape.conv_kernel,
            || format!("kda_conv: buffers too small for {} rows × {ch}", seg.rows),
        )?;
        let (ch_i, kern, act_i, off) = (
            ch as i32,
            shape.conv_kernel as i32,
            act.code(),
            conv_off as i64,
        );
        let tiles = ch.div_ceil(ELEMS as usize);
        let mut l = dev.stream.launch_builder(&self.kda_conv);
        l.arg(x)
            .arg(&ch_i)
            .arg(&kern)
            .arg(weight)
            .arg(&seg.seg_of_row)
            .arg(&seg.row0)
            .arg(&states.addrs)
            .arg(&off)
            .arg(&act_i)
            .arg(out);
        // SAFETY: x and out hold rows × ch floats, weight ch × kernel (checked above); the segment
        // arrays cover `rows` rows; every state address is a live buffer of the table holding the
        // tail at conv_off (checked by `check_part`), borrowed by the table.
        unsafe { l.launch(cfg((seg.rows, tiles, 1), ELEMS, 0)) }?;
        let mut l = dev.stream.launch_builder(&self.kda_conv_tail);
        l.arg(x)
            .arg(&ch_i)
            .arg(&kern)
            .arg(&seg.row0)
            .arg(&seg.len)
            .arg(&states.addrs)
            .arg(&off);
        // SAFETY: as above; it runs after kda_conv in stream order, which read the old tails.
        unsafe { l.launch(cfg((seg.segments, tiles, 1), ELEMS, 0)) }?;
        Ok(())
    }

    /// In place: q, k of `qkv` `[rows, 3·qkv]` L2-normalised (q also by 1/√d), `g` `[rows, qkv]` from
    /// the forget projection to the log decay (with `a_log` `[heads]`, `dt_bias` `[qkv]`), `beta`
    /// `[rows, heads]` through a sigmoid.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_prepare(
        &self,
        dev: &GpuDevice,
        shape: KdaShape,
        rows: usize,
        qkv: &mut CudaSlice<f32>,
        g: &mut CudaSlice<f32>,
        beta: &mut CudaSlice<f32>,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        shape.check()?;
        let w = shape.qkv();
        check(
            qkv.len() >= rows * 3 * w
                && g.len() >= rows * w
                && beta.len() >= rows * shape.heads
                && a_log.len() >= shape.heads
                && dt_bias.len() >= w,
            || format!("kda_prepare: buffers too small for {rows} rows of {shape:?}"),
        )?;
        let (heads, d) = (shape.heads as i32, shape.head_dim as i32);
        let (has_bound, lb) = match shape.lower_bound {
            Some(lb) => (1i32, lb),
            None => (0, 0.0f32),
        };
        let mut l = dev.stream.launch_builder(&self.kda_prepare);
        l.arg(qkv)
            .arg(g)
            .arg(beta)
            .arg(a_log)
            .arg(dt_bias)
            .arg(&heads)
            .arg(&d)
            .arg(&has_bound)
            .arg(&lb);
        // SAFETY: every buffer holds what rows × heads × d indexing reaches (checked above).
        unsafe { l.launch(cfg((rows, shape.heads, 1), BLOCK, 0)) }?;
        Ok(())
    }

    /// The recurrence over each segment's tokens from its state (layer part at `layer_off`), advancing
    /// the state; outputs `[rows, qkv]` into `out`. Inputs as [`Self::kda_prepare`] leaves them. Both
    /// methods compute the same recurrence (f32, summed in another order).
    #[allow(clippy::too_many_arguments)]
    pub fn kda_recurrent(
        &self,
        dev: &GpuDevice,
        method: KdaMethod,
        shape: KdaShape,
        qkv: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        seg: &SegmentIndex,
        states: &mut StateTable<'_>,
        layer_off: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        shape.check()?;
        let (w, d) = (shape.qkv(), shape.head_dim);
        states.check_part(seg, layer_off, shape.heads * d * d)?;
        check(
            qkv.len() >= seg.rows * 3 * w
                && g.len() >= seg.rows * w
                && beta.len() >= seg.rows * shape.heads
                && out.len() >= seg.rows * w,
            || format!("kda_recurrent: buffers too small for {} rows", seg.rows),
        )?;
        let parts = d.div_ceil(32).next_power_of_two(); // 1, 2 or 4 lanes per value column
        let per_block = BLOCK as usize / parts;
        let (heads, d_i, off) = (shape.heads as i32, d as i32, layer_off as i64);
        let kernel = match method {
            KdaMethod::PerToken => &self.kda_recurrent,
            KdaMethod::Chunked => &self.kda_chunked,
        };
        let mut l = dev.stream.launch_builder(kernel);
        l.arg(qkv)
            .arg(g)
            .arg(beta)
            .arg(&heads)
            .arg(&d_i)
            .arg(&seg.row0)
            .arg(&seg.len)
            .arg(&states.addrs)
            .arg(&off)
            .arg(out);
        // SAFETY: d ≤ 128 (both kernels' shared arrays and 32 rows × ≤ 4 lanes per column); buffers
        // and state parts checked above; the table borrows the states. Both kernels take the same
        // arguments and launch shape.
        unsafe {
            l.launch(cfg(
                (seg.segments, shape.heads, d.div_ceil(per_block)),
                BLOCK,
                0,
            ))
        }?;
        Ok(())
    }

    /// Per head of `x` `[rows, heads·d]`: RMSNorm · `weight` `[d]` · sigmoid(`gate`) into bf16 `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_rms_norm(
        &self,
        dev: &GpuDevice,
        rows: usize,
        heads: usize,
        x: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let d = weight.len();
        check(
            heads > 0
                && d > 0
                && x.len() >= rows * heads * d
                && gate.len() >= rows * heads * d
                && out.len() >= rows * heads * d,
            || format!("gated_rms_norm: buffers too small for {rows} rows × {heads} × {d}"),
        )?;
        let (heads_i, d_i) = (heads as i32, d as i32);
        let mut l = dev.stream.launch_builder(&self.gated_rms_norm);
        l.arg(x)
            .arg(gate)
            .arg(weight)
            .arg(&heads_i)
            .arg(&d_i)
            .arg(&eps)
            .arg(out);
        // SAFETY: sizes checked above.
        unsafe { l.launch(cfg((rows, heads, 1), BLOCK, 0)) }?;
        Ok(())
    }
}
