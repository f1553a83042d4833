//! Dense projections on the GPU in bf16, FP8 or int8 (W8A16) or int4 (W4A16): one op,
//! [`GpuDevice::dense_matmul`].
//!
//! Decode steps (at most [`GEMV_MAX_TOKENS_PER_CALL`] × 2 rows) run the quantized GEMVs of
//! `dense_quant.cu`, which stream the weights once; larger steps dequantize slabs of rows into a bf16
//! scratch buffer and multiply each slab with cuBLAS (the dequantization is amortised over the
//! step's rows). bf16 weights always go to cuBLAS.
use super::ops::grid;
use super::quant::{DenseFormat, QuantizedMatrix, W8Code};
use super::{GpuDevice, GpuError};
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchArgs, PushKernelArg};
use half::bf16;

/// Tokens one GEMV launch handles (the kernel's register accumulators).
pub const GEMV_MAX_TOKENS_PER_CALL: usize = 8;
/// Steps of up to this many rows use the GEMV kernels (in launches of 8); more dequantize + cuBLAS.
pub const GEMV_MAX_ROWS: usize = 2 * GEMV_MAX_TOKENS_PER_CALL;
/// Size of the bf16 dequantization scratch buffer prefill uses (slabs of rows of one matrix).
pub const DEQUANT_SCRATCH_BYTES: usize = 64 << 20;
const GEMV_ROWS_PER_BLOCK: usize = 4;

/// A dense `[out, in]` weight on the GPU.
pub enum DeviceDense {
    Bf16(CudaSlice<bf16>),
    Int4 {
        /// `[out, in / 8]`
        packed: CudaSlice<u32>,
        /// f16 bits `[out, in / group]`
        scales: CudaSlice<u16>,
        /// f16 bits `[out, in / group]`: group minimums of asymmetric codes (u·d + m); `None`:
        /// symmetric codes ((u − 8)·d).
        mins: Option<CudaSlice<u16>>,
        group: usize,
    },
    /// 8-bit codes: E4M3 (`--dense-dtype fp8`) or int8 (kept GGUF codes).
    W8 {
        code: W8Code,
        /// `[out, in]` codes
        bytes: CudaSlice<u8>,
        /// `[out, in / group]`
        scales: CudaSlice<f32>,
        group: usize,
    },
}

impl DeviceDense {
    pub fn format(&self) -> DenseFormat {
        match self {
            DeviceDense::Bf16(_) => DenseFormat::Bf16,
            DeviceDense::Int4 { .. } => DenseFormat::Int4,
            DeviceDense::W8 {
                code: W8Code::E4m3, ..
            } => DenseFormat::Fp8,
            DeviceDense::W8 {
                code: W8Code::Int8, ..
            } => DenseFormat::Int8,
        }
    }

    /// The bf16 matrix, for callers that need cuBLAS operands (routed experts are always bf16).
    pub fn as_bf16(&self) -> Option<&CudaSlice<bf16>> {
        match self {
            DeviceDense::Bf16(w) => Some(w),
            _ => None,
        }
    }

    /// Bytes this weight occupies on the GPU.
    pub fn bytes(&self) -> usize {
        match self {
            DeviceDense::Bf16(w) => w.len() * 2,
            DeviceDense::Int4 {
                packed,
                scales,
                mins,
                ..
            } => packed.len() * 4 + (scales.len() + mins.as_ref().map_or(0, |m| m.len())) * 2,
            DeviceDense::W8 { bytes, scales, .. } => bytes.len() + scales.len() * 4,
        }
    }
}

impl GpuDevice {
    /// Uploads a quantized host matrix.
    pub fn upload_quantized(&self, q: &QuantizedMatrix) -> Result<DeviceDense, GpuError> {
        let s = &self.stream;
        Ok(match q {
            QuantizedMatrix::Int4 {
                packed,
                scales,
                mins,
                group,
                ..
            } => DeviceDense::Int4 {
                packed: s.clone_htod(packed)?,
                scales: s.clone_htod(scales)?,
                mins: match mins {
                    Some(m) => Some(s.clone_htod(m)?),
                    None => None,
                },
                group: *group,
            },
            QuantizedMatrix::W8 {
                bytes,
                scales,
                group,
                code,
                ..
            } => DeviceDense::W8 {
                code: *code,
                bytes: s.clone_htod(bytes)?,
                scales: s.clone_htod(scales)?,
                group: *group,
            },
        })
    }

    /// The bf16 scratch buffer [`GpuDevice::dense_matmul`] dequantizes prefill slabs into.
    pub fn alloc_dequant_scratch(&self) -> Result<CudaSlice<bf16>, GpuError> {
        Ok(self.stream.alloc_zeros::<bf16>(DEQUANT_SCRATCH_BYTES / 2)?)
    }

    /// `y[n, out] (=|+=) x[n, in] · Wᵀ` with f32 accumulation, whatever W's format. `scratch` is
    /// needed by quantized weights when `n > GEMV_MAX_ROWS` (it must hold at least one row).
    pub fn dense_matmul(
        &self,
        w: &DeviceDense,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<f32>,
        (n, out, inp): (usize, usize, usize),
        accumulate: bool,
        scratch: Option<&mut CudaSlice<bf16>>,
    ) -> Result<(), GpuError> {
        if x.len() < n * inp || y.len() < n * out {
            return Err(GpuError::Shape(format!(
                "dense_matmul: x holds {} of {n}×{inp}, y {} of {n}×{out}",
                x.len(),
                y.len()
            )));
        }
        match w {
            DeviceDense::Bf16(w) => self.gemm_bf16(x, w, y, n, out, inp, accumulate),
            _ if n <= GEMV_MAX_ROWS => {
                for t0 in (0..n).step_by(GEMV_MAX_TOKENS_PER_CALL) {
                    let rows = (n - t0).min(GEMV_MAX_TOKENS_PER_CALL);
                    self.dense_gemv(w, x, y, (t0, rows), (out, inp), accumulate)?;
                }
                Ok(())
            }
            _ => {
                let scratch = scratch.ok_or_else(|| {
                    GpuError::Shape(
                        "quantized prefill needs a dequantization scratch buffer".into(),
                    )
                })?;
                self.dense_dequant_gemm(w, x, y, (n, out, inp), accumulate, scratch)
            }
        }
    }

    /// The quantized weight's GEMV and slab-dequantization kernels and its group (bf16 weights have
    /// none: they go to cuBLAS).
    fn quantized_kernels(
        &self,
        w: &DeviceDense,
    ) -> Result<(&CudaFunction, &CudaFunction, i32), GpuError> {
        match w {
            DeviceDense::Int4 { group, .. } => {
                Ok((&self.k.gemv_w4a16, &self.k.dense_dequant_w4, *group as i32))
            }
            DeviceDense::W8 { group, .. } => {
                Ok((&self.k.gemv_w8a16, &self.k.dense_dequant_w8, *group as i32))
            }
            DeviceDense::Bf16(_) => Err(GpuError::Shape(
                "bf16 weights have no quantized kernels (they go to cuBLAS)".into(),
            )),
        }
    }

    /// Rows `t0..t0+rows` (≤ 8) of the step through the quantized GEMV.
    fn dense_gemv(
        &self,
        w: &DeviceDense,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<f32>,
        (t0, rows): (usize, usize),
        (out, inp): (usize, usize),
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let (gemv, _, g) = self.quantized_kernels(w)?;
        let xs = x.slice(t0 * inp..(t0 + rows) * inp);
        let mut ys = y.slice_mut(t0 * out..(t0 + rows) * out);
        let (n_i, out_i, in_i, acc_i) = (rows as i32, out as i32, inp as i32, accumulate as i32);
        let cfg = grid(
            (out.div_ceil(GEMV_ROWS_PER_BLOCK), 1, 1),
            GEMV_ROWS_PER_BLOCK * 32,
            0,
        );
        let mins = self.mins_address(w);
        let mut l = self.stream.launch_builder(gemv);
        push_quantized_weight(&mut l, w, &mins);
        l.arg(&xs).arg(&n_i).arg(&out_i);
        l.arg(&in_i).arg(&g).arg(&acc_i).arg(&mut ys);
        // SAFETY: the weight's codes hold out·in values and its scales (and int4 mins, when present)
        // out·in/group (built together by `QuantizedMatrix`), xs rows·in and ys rows·out elements
        // (sliced above); the kernel reads and writes nothing else.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// Device address of an int4 weight's group minimums; 0 (the kernels' "symmetric") otherwise.
    fn mins_address(&self, w: &DeviceDense) -> u64 {
        match w {
            DeviceDense::Int4 { mins: Some(m), .. } => m.device_ptr(&self.stream).0,
            _ => 0,
        }
    }

    /// Prefill: slabs of W's rows dequantized into `scratch`, each multiplied into its columns of y.
    fn dense_dequant_gemm(
        &self,
        w: &DeviceDense,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<f32>,
        (n, out, inp): (usize, usize, usize),
        accumulate: bool,
        scratch: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let (_, dequant, g) = self.quantized_kernels(w)?;
        let slab = (scratch.len() / inp.max(1)).min(out);
        if slab == 0 {
            return Err(GpuError::Shape(format!(
                "dequantization scratch of {} elements holds no row of {inp}",
                scratch.len()
            )));
        }
        let in_i = inp as i32;
        let mins = self.mins_address(w);
        for r0 in (0..out).step_by(slab) {
            let rows = slab.min(out - r0);
            let r0_i = r0 as i32;
            let cfg = grid((rows, 1, 1), 256, 0);
            let mut l = self.stream.launch_builder(dequant);
            push_quantized_weight(&mut l, w, &mins);
            l.arg(&in_i).arg(&g).arg(&r0_i);
            l.arg(&mut *scratch);
            // SAFETY: rows r0..r0+rows < out of the matrix are read; scratch holds slab·in ≥
            // rows·in elements.
            unsafe { l.launch(cfg) }?;
            // x holds n·inp and y n·out elements (checked by `dense_matmul`), the scratch ≥ rows·inp,
            // and r0 + rows ≤ out.
            self.gemm_ex_into_columns(
                x,
                &*scratch,
                y,
                (n, rows, inp),
                (r0, out),
                accumulate,
                cublas_sys::cudaDataType_t::CUDA_R_16BF,
            )?;
        }
        Ok(())
    }
}

/// The first kernel arguments of every quantized kernel: the codes and their scales, then for int4
/// the group minimums' address `mins` (0: symmetric codes), for 8-bit weights the code.
fn push_quantized_weight<'a>(l: &mut LaunchArgs<'a>, w: &'a DeviceDense, mins: &'a u64) {
    match w {
        DeviceDense::Int4 { packed, scales, .. } => {
            l.arg(packed).arg(scales).arg(mins);
        }
        DeviceDense::W8 {
            bytes,
            scales,
            code,
            ..
        } => {
            l.arg(bytes).arg(scales).arg(code);
        }
        // `quantized_kernels` refused bf16 weights before any launch was built.
        DeviceDense::Bf16(_) => {}
    }
}
