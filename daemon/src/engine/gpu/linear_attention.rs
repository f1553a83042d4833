//! KDA linear-attention layers on the GPU (GLM-5.3-Flash): the CPU's `engine::cpu::linear_attention` with the
//! projections as GEMMs (q, k and v stacked into one) and the convolution, gate, recurrence and gated
//! norm as the kernels of `hybrid.cu`. Each sequence's state lives in its GPU state buffer
//! (`gpu::hybrid`); decode steps run the per-token recurrence, prefill chunks the chunked (WY) form
//! (its per-chunk terms written over the q/k/v projection rows, which the convolution has consumed).
use super::hybrid::HybridStep;
use super::{upload_linear, GpuLinear, GpuModel};
use crate::engine::linear::Linear;
use crate::model::config::Activation;
use crate::model::{LinearAttention, Model};
use anyhow::Context;
use cudarc::driver::CudaSlice;
use half::bf16;
use moe_kernels::cuda::dense::DeviceDense;
use moe_kernels::cuda::linear_attention::{ConvActivation, KdaMethod};
use moe_kernels::cuda::quant::{DenseFormat, QuantizedMatrix};
use moe_kernels::cuda::GpuDevice;

pub struct GpuLinearAttention {
    /// q, k, v stacked `[3 · qkv, hidden]`: one GEMM gives the convolution's input rows.
    pub qkv: GpuLinear,
    /// `[3 · qkv, kernel]`
    pub conv: CudaSlice<f32>,
    pub f_a: GpuLinear,
    pub f_b: GpuLinear,
    pub dt_bias: CudaSlice<f32>,
    pub a_log: CudaSlice<f32>,
    pub b: GpuLinear,
    pub g_a: GpuLinear,
    pub g_b: GpuLinear,
    pub o_norm: CudaSlice<f32>,
    pub o: GpuLinear,
}

/// q, k, v as one `[3 · out, in]` matrix in `format` (bf16 where the format cannot take the width).
fn upload_stacked(
    dev: &GpuDevice,
    parts: [&Linear; 3],
    format: DenseFormat,
) -> anyhow::Result<GpuLinear> {
    let (rows, cols) = (parts[0].out_dim, parts[0].in_dim);
    anyhow::ensure!(
        parts.iter().all(|p| p.out_dim == rows && p.in_dim == cols),
        "q, k and v projections of a linear-attention layer differ in shape"
    );
    let w = match QuantizedMatrix::quantize(format, 3 * rows, cols, |r, buf| {
        parts[r / rows].row_f32(r % rows, buf)
    }) {
        Some(q) => dev.upload_quantized(&q)?,
        None => {
            let mut all = Vec::with_capacity(3 * rows * cols);
            for p in parts {
                all.extend(super::linear_bf16(p));
            }
            DeviceDense::Bf16(dev.stream.clone_htod(&all)?)
        }
    };
    Ok(GpuLinear {
        w,
        bias: None,
        out_dim: 3 * rows,
        in_dim: cols,
    })
}

impl GpuLinearAttention {
    pub fn upload(
        dev: &GpuDevice,
        la: &LinearAttention,
        format: DenseFormat,
    ) -> anyhow::Result<Self> {
        let s = &dev.stream;
        let up = |l: &Linear| upload_linear(dev, l, format);
        Ok(Self {
            qkv: upload_stacked(dev, [&la.q, &la.k, &la.v], format)?,
            conv: s.clone_htod(&la.conv)?,
            f_a: up(&la.f_a)?,
            f_b: up(&la.f_b)?,
            dt_bias: s.clone_htod(&la.dt_bias)?,
            a_log: s.clone_htod(&la.a_log)?,
            b: up(&la.b)?,
            g_a: up(&la.g_a)?,
            g_b: up(&la.g_b)?,
            o_norm: s.clone_htod(&la.o_norm)?,
            o: up(&la.o)?,
        })
    }
}

impl GpuModel {
    /// `b(a(x))` for a low-rank pair into `out`, the middle rounded to bf16 as every GEMM input
    /// (`mid`, `mid_b`: the step's low-rank buffers).
    fn low_rank(
        &self,
        (a, b): (&GpuLinear, &GpuLinear),
        x: &CudaSlice<bf16>,
        n: usize,
        (mid, mid_b): (&mut CudaSlice<f32>, &mut CudaSlice<bf16>),
        out: &mut CudaSlice<f32>,
    ) -> anyhow::Result<()> {
        self.linear(a, x, mid, n, false)?;
        self.dev.round_to_bf16(mid, mid_b, n * a.out_dim)?;
        self.linear(b, mid_b, out, n, false)
    }

    /// Layer `li`'s linear attention over the step from the normalised input `hb`; adds its output
    /// projection into `x` and advances every sequence's state. Enqueues kernels and GEMMs on the
    /// step's buffers only (no allocation, no host data), so a decode step can be captured.
    pub(super) fn linear_attention(
        &self,
        la: &GpuLinearAttention,
        host: &Model,
        li: usize,
        hb: &CudaSlice<bf16>,
        x: &mut CudaSlice<f32>,
        hy: &mut HybridStep<'_>,
    ) -> anyhow::Result<()> {
        let cfg = &host.config;
        let hybrid = self
            .hybrid
            .as_ref()
            .context("linear attention without hybrid kernels")?;
        let shape = hybrid.kda.context("linear attention without its config")?;
        let off = hybrid.state_offsets[li]
            .with_context(|| format!("layer {li} has no recurrent state part"))?;
        let n = hy.rows();
        let HybridStep { bufs, states, .. } = hy;
        let states = states
            .as_mut()
            .context("a linear-attention step without recurrent states")?;
        let seg = &bufs.seg;
        let b = bufs
            .linear
            .as_mut()
            .context("a linear-attention step without its buffers")?;
        let (dev, k) = (&self.dev, &hybrid.kernels);
        let act = match cfg.activation {
            Activation::Silu => ConvActivation::Silu,
            Activation::GeluTanh => ConvActivation::GeluTanh,
            Activation::Relu => ConvActivation::Relu,
        };
        self.linear(&la.qkv, hb, &mut b.raw, n, false)?;
        k.kda_conv(
            dev,
            shape,
            act,
            &b.raw,
            &la.conv,
            seg,
            states,
            off,
            &mut b.mixed,
        )?;
        let mid = (&mut b.mid, &mut b.mid_b);
        self.low_rank((&la.f_a, &la.f_b), hb, n, mid, &mut b.g)?;
        self.linear(&la.b, hb, &mut b.beta, n, false)?;
        let mid = (&mut b.mid, &mut b.mid_b);
        self.low_rank((&la.g_a, &la.g_b), hb, n, mid, &mut b.gate)?;
        k.kda_prepare(
            dev,
            shape,
            n,
            &mut b.mixed,
            &mut b.g,
            &mut b.beta,
            &la.a_log,
            &la.dt_bias,
        )?;
        // The convolution's input rows are dead from here: the chunked recurrence's scratch.
        k.kda_recurrent(
            dev,
            KdaMethod::for_step(shape, seg.max_len),
            shape,
            &b.mixed,
            &b.g,
            &b.beta,
            seg,
            states,
            off,
            &mut b.raw,
            &mut b.core,
        )?;
        k.gated_rms_norm(
            dev,
            n,
            shape.heads,
            &b.core,
            &b.gate,
            &la.o_norm,
            cfg.rms_norm_eps,
            &mut b.normed,
        )?;
        self.linear(&la.o, &b.normed, x, n, self.tp_attention_accumulates())
    }
}
