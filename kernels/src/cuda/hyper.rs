//! Hyper-connections on the GPU (GLM-5.3-Flash): `m` residual streams per token `[rows, m, hidden]`,
//! collapsed into a block's input and expanded from its output with per-token weights (`pre`, `post` and
//! the Sinkhorn-normalised `comb`, kept in a mix buffer `[rows, 2m + m²]` between the two). The stream
//! projection itself is one f32 GEMM by the caller (`streams · fnᵀ`); these kernels do the rest.
use super::hybrid::{cfg, check, HybridKernels};
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};

/// Most streams the kernels take (their per-thread arrays).
pub const MAX_STREAMS: usize = 8;
const ELEMS: u32 = 256;

/// The fixed parameters of one hyper-connection: `base` `[(2 + m)·m]`, scales (pre, post, comb).
pub struct HyperParams<'a> {
    pub streams: usize,
    pub base: &'a CudaSlice<f32>,
    pub scale: [f32; 3],
    pub sinkhorn_iters: usize,
    /// Added after the sigmoid of `pre` and after the softmax and in the Sinkhorn sums of `comb`.
    pub eps: f32,
    /// RMS epsilon of the streams' normalisation (the model's `rms_norm_eps`).
    pub norm_eps: f32,
}

/// Floats per token of a mix buffer for `m` streams.
pub fn mix_width(m: usize) -> usize {
    2 * m + m * m
}

fn check_streams(m: usize) -> Result<(), GpuError> {
    check((1..=MAX_STREAMS).contains(&m), || {
        format!("{m} hyper-connection streams (1..={MAX_STREAMS} supported)")
    })
}

impl HybridKernels {
    /// One of the element-wise stream kernels (`hc_broadcast`, `hc_mean`, `hc_expand`: one thread per
    /// (row, hidden element), arguments `(m, hidden, input, second input or null, output)`), after the
    /// caller's size check `fits`.
    #[allow(clippy::too_many_arguments)]
    fn per_element(
        &self,
        dev: &GpuDevice,
        f: &CudaFunction,
        (rows, m, hidden): (usize, usize, usize),
        fits: bool,
        input: &CudaSlice<f32>,
        second: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        check_streams(m)?;
        check(fits, || {
            format!("hyper-connection buffers too small for {rows} × {m} × {hidden}")
        })?;
        if rows == 0 {
            return Ok(());
        }
        let (m_i, h_i, null) = (m as i32, hidden as i32, 0u64);
        let mut l = dev.stream.launch_builder(f);
        l.arg(&m_i).arg(&h_i).arg(input);
        match second {
            Some(b) => l.arg(b),
            None => l.arg(&null),
        };
        l.arg(out);
        // SAFETY: m ≤ MAX_STREAMS (the kernels' register arrays); the caller checked that every buffer
        // holds what rows × m × hidden (and the mix width) indexing reaches.
        unsafe { l.launch(cfg((rows, hidden.div_ceil(ELEMS as usize), 1), ELEMS, 0)) }?;
        Ok(())
    }

    /// Every stream of each row ← `x` `[rows, hidden]` (the embeddings).
    pub fn hc_broadcast(
        &self,
        dev: &GpuDevice,
        rows: usize,
        m: usize,
        hidden: usize,
        x: &CudaSlice<f32>,
        streams: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let fits = x.len() >= rows * hidden && streams.len() >= rows * m * hidden;
        let shape = (rows, m, hidden);
        self.per_element(dev, &self.hc_broadcast, shape, fits, x, None, streams)
    }

    /// `x` ← the streams' mean (the hyper head before the final norm).
    pub fn hc_mean(
        &self,
        dev: &GpuDevice,
        rows: usize,
        m: usize,
        hidden: usize,
        streams: &CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let fits = x.len() >= rows * hidden && streams.len() >= rows * m * hidden;
        let shape = (rows, m, hidden);
        self.per_element(dev, &self.hc_mean, shape, fits, streams, None, x)
    }

    /// A block's input `x` `[rows, hidden]` and its weights `mix`, from the streams and their projection
    /// `proj_out` `[rows, (2 + m)·m]` (= streams · fnᵀ, before the 1/rms scaling this kernel applies).
    #[allow(clippy::too_many_arguments)]
    pub fn hc_collapse(
        &self,
        dev: &GpuDevice,
        rows: usize,
        hidden: usize,
        p: &HyperParams<'_>,
        streams: &CudaSlice<f32>,
        proj_out: &CudaSlice<f32>,
        mix: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let m = p.streams;
        check_streams(m)?;
        check(
            streams.len() >= rows * m * hidden
                && proj_out.len() >= rows * (2 + m) * m
                && p.base.len() >= (2 + m) * m
                && mix.len() >= rows * mix_width(m)
                && x.len() >= rows * hidden
                && p.sinkhorn_iters >= 1,
            || format!("hc_collapse: buffers too small for {rows} × {m} × {hidden}"),
        )?;
        let (m_i, h_i, it) = (m as i32, hidden as i32, p.sinkhorn_iters as i32);
        let [ps, qs, cs] = p.scale;
        let mut l = dev.stream.launch_builder(&self.hc_collapse);
        l.arg(streams)
            .arg(proj_out)
            .arg(p.base)
            .arg(&ps)
            .arg(&qs)
            .arg(&cs)
            .arg(&m_i)
            .arg(&h_i)
            .arg(&it)
            .arg(&p.eps)
            .arg(&p.norm_eps)
            .arg(mix)
            .arg(x);
        // SAFETY: m ≤ MAX_STREAMS (the kernel's shared arrays); sizes checked above.
        unsafe { l.launch(cfg((rows, 1, 1), ELEMS, 0)) }?;
        Ok(())
    }

    /// New streams after a block: `x` holds the block's input plus its output (the block added into it).
    #[allow(clippy::too_many_arguments)]
    pub fn hc_expand(
        &self,
        dev: &GpuDevice,
        rows: usize,
        m: usize,
        hidden: usize,
        x: &CudaSlice<f32>,
        mix: &CudaSlice<f32>,
        streams: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let fits = streams.len() >= rows * m * hidden
            && mix.len() >= rows * mix_width(m)
            && x.len() >= rows * hidden;
        let shape = (rows, m, hidden);
        self.per_element(dev, &self.hc_expand, shape, fits, x, Some(mix), streams)
    }
}
