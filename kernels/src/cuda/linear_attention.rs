//! KDA-style gated delta-rule linear attention on the GPU (GLM-5.3-Flash's linear layers): the short
//! causal convolution with its per-sequence tail, the q/k normalisation with the forget gate and β, the
//! recurrence, and the gated RMSNorm. One typed launch per kernel of `hybrid.cu`.
//!
//! Cost: the recurrence reads and writes each sequence's `heads × d × d` state once per step (64 KiB per
//! head at d = 128). Token by token ([`KdaMethod::PerToken`]) it runs a sequence's tokens one after
//! another, each a dependent update of the state: right for decode (one token), latency-bound for a
//! prompt. In chunks ([`KdaMethod::Chunked`], the WY form) it first computes every chunk's own terms
//! (decayed k·k and q·k products, the triangular solve, W) for all chunks at once, one block per
//! (chunk, head), then walks each sequence's chunks in order updating the state once per 16 tokens:
//! what prefill uses.
use super::hybrid::{cfg, check, HybridKernels, SegmentIndex, StateTable};
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchArgs, PushKernelArg};
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

    /// Floats of the scratch [`KdaMethod::Chunked`] writes for a step of `rows` rows: the size of the
    /// step's q/k/v rows (`[rows, 3·qkv]`), so the convolution's input rows, dead by then, can hold it.
    pub fn chunk_scratch_floats(&self, rows: usize) -> usize {
        rows * 3 * self.qkv()
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
    /// Every chunk's own terms in parallel (`kda_chunk_prep`), then one state update per chunk of
    /// [`KDA_CHUNK`] tokens (`kda_chunk_scan`). Needs `head_dim >= KDA_CHUNK` and a scratch buffer of
    /// [`KdaShape::chunk_scratch_floats`].
    Chunked,
}

/// Tokens per chunk of [`KdaMethod::Chunked`] (`KDA_CHUNK` in `hybrid.cu`).
pub const KDA_CHUNK: usize = 16;

impl KdaMethod {
    /// The method for a step whose longest segment has `max_len` rows: chunks once a segment fills
    /// one, tokens otherwise (decode, short chunks, heads narrower than a chunk).
    /// `MOE_KDA_METHOD=token|chunked` forces one where the shape allows it (A/B runs).
    pub fn for_step(shape: KdaShape, max_len: usize) -> Self {
        static FORCED: std::sync::OnceLock<Option<KdaMethod>> = std::sync::OnceLock::new();
        let forced = FORCED.get_or_init(|| match std::env::var("MOE_KDA_METHOD").as_deref() {
            Ok("token") => Some(Self::PerToken),
            Ok("chunked") => Some(Self::Chunked),
            _ => None,
        });
        if shape.head_dim < KDA_CHUNK {
            return Self::PerToken;
        }
        match forced {
            Some(m) => *m,
            None if max_len >= KDA_CHUNK => Self::Chunked,
            None => Self::PerToken,
        }
    }
}

const BLOCK: u32 = 128;
const ELEMS: u32 = 256;

/// What the three recurrence kernels of `hybrid.cu` (`kda_recurrent`, `kda_chunk_prep`,
/// `kda_chunk_scan`) take first, in their order: the prepared q/k/v rows `[rows, 3·qkv]`, the log
/// decays `[rows, qkv]`, β `[rows, heads]`, the head count and width, and each segment's first row
/// and length. The caller checks the buffers' sizes before launching.
struct RecurrenceInputs<'a> {
    qkv: &'a CudaSlice<f32>,
    g: &'a CudaSlice<f32>,
    beta: &'a CudaSlice<f32>,
    heads: &'a i32,
    d: &'a i32,
    seg: &'a SegmentIndex,
}

impl<'a> RecurrenceInputs<'a> {
    /// A launch of `kernel` with these arguments pushed; the kernel's own follow.
    fn launch(&self, dev: &'a GpuDevice, kernel: &'a CudaFunction) -> LaunchArgs<'a> {
        let mut l = dev.stream.launch_builder(kernel);
        l.arg(self.qkv)
            .arg(self.g)
            .arg(self.beta)
            .arg(self.heads)
            .arg(self.d)
            .arg(&self.seg.row0)
            .arg(&self.seg.len);
        l
    }
}

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
    /// the state; outputs `[rows, qkv]` into `out`. Inputs as [`Self::kda_prepare`] leaves them.
    /// [`KdaMethod::Chunked`] writes its per-chunk terms into `scratch` (at least
    /// [`KdaShape::chunk_scratch_floats`]; the per-token method leaves it alone). Both methods compute
    /// the same recurrence (f32, summed in another order).
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
        scratch: &mut CudaSlice<f32>,
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
        let columns = (seg.segments, shape.heads, d.div_ceil(per_block));
        let inputs = RecurrenceInputs {
            qkv,
            g,
            beta,
            heads: &heads,
            d: &d_i,
            seg,
        };
        if method == KdaMethod::PerToken {
            let mut l = inputs.launch(dev, &self.kda_recurrent);
            l.arg(&states.addrs).arg(&off).arg(out);
            // SAFETY: d ≤ 128 (the shared arrays, 32 rows × ≤ 4 lanes per column); buffers and state
            // parts checked above; the table borrows the states.
            unsafe { l.launch(cfg(columns, BLOCK, 0)) }?;
            return Ok(());
        }
        check(
            d >= KDA_CHUNK
                && scratch.len() >= shape.chunk_scratch_floats(seg.rows)
                && seg.segments <= u16::MAX as usize
                && shape.heads <= u16::MAX as usize,
            || {
                format!(
                    "kda_recurrent in chunks: head_dim {d} under {KDA_CHUNK}, or scratch of {} \
                     floats for {} rows, or {} segments × {} heads",
                    scratch.len(),
                    seg.rows,
                    seg.segments,
                    shape.heads
                )
            },
        )?;
        let mut l = inputs.launch(dev, &self.kda_chunk_prep);
        l.arg(&mut *scratch);
        let chunks = seg.max_len.div_ceil(KDA_CHUNK).max(1);
        // SAFETY: KDA_CHUNK ≤ d ≤ 128 (the shared arrays and the scratch row layout); inputs checked
        // above; every block past its segment's length returns; it writes the scratch rows of its
        // chunk's real rows only, inside `rows × 3·qkv` (checked).
        unsafe { l.launch(cfg((chunks, seg.segments, shape.heads), BLOCK, 0)) }?;
        let mut l = inputs.launch(dev, &self.kda_chunk_scan);
        l.arg(&states.addrs).arg(&off).arg(&*scratch).arg(out);
        // SAFETY: as above; it reads the scratch rows kda_chunk_prep wrote before it in stream order.
        unsafe { l.launch(cfg(columns, BLOCK, 0)) }?;
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
