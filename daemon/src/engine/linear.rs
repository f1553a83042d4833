//! Dense projections `y = x · Wᵀ (+ b)` for the CPU backend.
//!
//! Two paths. The fast one: weights packed once at load into the kernels' tile formats
//! ([`Linear::pack`], [`moe_kernels::cpu::DenseMatrix`]) and run by the persistent worker pool with the
//! best SIMD tier (AMX / AVX-512 / AVX2 / scalar); GGUF Q4_0 / Q4_1 / Q8_0 blocks are kept bit for bit.
//! The reference one, for weights not packed (f32 that bf16 would round, the GPU backend's host copy):
//! rows of W split across rayon workers, each widening its rows to f32 once and dotting them with all
//! tokens. Either way a batch of T tokens reads the weights once, not T times.
use crate::weights::{fp8, HostData, HostTensor};
use half::bf16;
use moe_kernels::cpu::moe::{format_for_ggml, SourceTensor, WeightFormat};
use moe_kernels::cpu::{
    forward_group, CpuMoeOptions, DenseCall, DenseError, DenseMatrix, GgmlBlock, MakeRow,
    WorkerPool,
};
use rayon::prelude::*;
use std::sync::Arc;

/// Weight storage of a [`Linear`], row-major `[out_dim, in_dim]`.
pub enum WeightData {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    /// FP8 E4M3 with block scales (`[ceil(out/block), ceil(in/block)]`), dequantised row by row.
    F8 {
        bytes: Vec<u8>,
        scale_inv: Vec<f32>,
        block: usize,
    },
    /// GGML blocks as a GGUF file stores them; each row a whole number of blocks.
    Ggml {
        kind: GgmlBlock,
        bytes: Vec<u8>,
    },
    /// Packed for the CPU kernels, with the pool that runs them (boxed: the matrix carries its
    /// scratch buffers).
    Packed(Box<PackedWeight>),
}

pub struct PackedWeight {
    pub mat: DenseMatrix,
    pool: Arc<WorkerPool>,
}

/// The FP8 block size the kernels read scales for.
const KERNEL_FP8_BLOCK: usize = 128;

pub struct Linear {
    pub out_dim: usize,
    pub in_dim: usize,
    pub w: WeightData,
    pub bias: Option<Vec<f32>>,
}

/// Rows handed to one worker at a time: enough work to amortise scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

impl Linear {
    /// The worker pool that runs this weight's kernels, once packed (attention runs its per-head work on
    /// the same threads).
    pub fn pool(&self) -> Option<&Arc<WorkerPool>> {
        match &self.w {
            WeightData::Packed(p) => Some(&p.pool),
            _ => None,
        }
    }

    /// Takes ownership of a `[out, in]` tensor (and optional `[out]` bias), keeping its precision.
    pub fn new(w: HostTensor, bias: Option<Vec<f32>>) -> Self {
        let (out_dim, in_dim) = crate::weights::matrix_dims(&w.shape);
        let w = match w.data {
            HostData::F32(v) => WeightData::F32(v),
            HostData::Bf16(v) => WeightData::Bf16(v),
            HostData::F8E4M3 {
                bytes,
                scale_inv,
                block,
            } => WeightData::F8 {
                bytes,
                scale_inv,
                block,
            },
            HostData::Ggml { kind, bytes } => WeightData::Ggml { kind, bytes },
        };
        Self {
            out_dim,
            in_dim,
            w,
            bias,
        }
    }

    /// Writes row `r` of W, widened to f32, into `buf`.
    pub fn row_f32(&self, r: usize, buf: &mut [f32]) {
        let n = self.in_dim;
        match &self.w {
            WeightData::F32(v) => buf.copy_from_slice(&v[r * n..(r + 1) * n]),
            WeightData::Bf16(v) => {
                for (o, x) in buf.iter_mut().zip(&v[r * n..(r + 1) * n]) {
                    *o = x.to_f32();
                }
            }
            WeightData::F8 {
                bytes,
                scale_inv,
                block,
            } => {
                let table = fp8_table();
                let col_blocks = fp8::blocks(n, *block);
                let scales = &scale_inv[(r / block) * col_blocks..];
                for (c, (o, b)) in buf.iter_mut().zip(&bytes[r * n..(r + 1) * n]).enumerate() {
                    *o = table[*b as usize] * scales[c / block];
                }
            }
            WeightData::Ggml { kind, bytes } => {
                let rb = kind.row_bytes(n).expect("row length checked at load");
                moe_kernels::cpu::ggml::dequantize(*kind, &bytes[r * rb..(r + 1) * rb], buf);
            }
            WeightData::Packed(p) => p.mat.row_f32(r, buf),
        }
    }

    /// What the CPU kernels read for this weight (`None` once packed).
    pub fn source(&self) -> Option<SourceTensor<'_>> {
        Some(match &self.w {
            WeightData::F32(v) => SourceTensor::F32(v),
            WeightData::Bf16(v) => SourceTensor::Bf16(bf16_bits(v)),
            WeightData::F8 {
                bytes, scale_inv, ..
            } => SourceTensor::Fp8E4M3 {
                data: bytes,
                scale_inv,
            },
            WeightData::Ggml { kind, bytes } => SourceTensor::Ggml {
                kind: *kind,
                data: bytes,
            },
            WeightData::Packed(_) => return None,
        })
    }

    /// The packed format that keeps this weight's values: bf16 as is, FP8 with 128×128 blocks as is,
    /// GGML F16 / Q4_0 / Q4_1 / Q8_0 bit for bit, Q4_K / Q5_K / Q6_K with their codes kept (see
    /// `format_for_ggml`), f32 only when every value is a bf16 (else `None`: packing would round it).
    pub fn kernel_format(&self) -> Option<WeightFormat> {
        match &self.w {
            WeightData::Bf16(_) => Some(WeightFormat::Bf16),
            WeightData::F8 { block, .. } if *block == KERNEL_FP8_BLOCK => {
                Some(WeightFormat::Fp8Block)
            }
            WeightData::F8 { .. } | WeightData::Packed(_) => None,
            WeightData::Ggml { kind, .. } => Some(format_for_ggml(*kind)),
            WeightData::F32(v) => v
                .iter()
                .all(|x| x.to_bits() & 0xFFFF == 0)
                .then_some(WeightFormat::Bf16),
        }
    }

    /// Repacks the weight for the CPU kernels (dropping the checkpoint copy) when a format keeps its
    /// values ([`kernel_format`](Self::kernel_format)); returns whether it did. `opts`: the tier cap
    /// and what few-row calls feed grouped int weights (`None`: the format's accurate default).
    pub fn pack(
        &mut self,
        pool: &Arc<WorkerPool>,
        opts: &CpuMoeOptions,
    ) -> Result<bool, DenseError> {
        let Some(format) = self.kernel_format() else {
            return Ok(false);
        };
        let src = self.source().expect("not packed yet");
        let mut mat = DenseMatrix::new(format, self.out_dim, self.in_dim, &src, opts.max_tier)?;
        if let Some(input) = opts.dense_input {
            mat.set_grouped_input(input);
        }
        self.w = WeightData::Packed(Box::new(PackedWeight {
            mat,
            pool: Arc::clone(pool),
        }));
        Ok(true)
    }

    pub fn is_packed(&self) -> bool {
        matches!(self.w, WeightData::Packed(_))
    }

    /// The whole weight as f32 (for small matrices that a kernel wants in f32, e.g. routers).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.out_dim * self.in_dim];
        for (r, row) in out.chunks_mut(self.in_dim).enumerate() {
            self.row_f32(r, row);
        }
        out
    }

    /// `x`: `[tokens, in_dim]` → returns `[tokens, out_dim]`.
    pub fn forward(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), tokens * self.in_dim);
        if let WeightData::Packed(p) = &self.w {
            let mut y = vec![0f32; tokens * self.out_dim];
            p.mat
                .forward(&p.pool, x, tokens, self.bias.as_deref(), &mut y)
                .expect("x and bias lengths match the layer (checked at load and by the caller)");
            return y;
        }
        let (n_in, n_out) = (self.in_dim, self.out_dim);
        // Transposed result [out_dim, tokens] so each worker writes one contiguous block.
        let mut yt = vec![0f32; n_out * tokens];
        yt.par_chunks_mut(ROWS_PER_TASK * tokens)
            .enumerate()
            .for_each(|(chunk, block)| {
                let mut row = vec![0f32; n_in];
                for (i, out_row) in block.chunks_mut(tokens).enumerate() {
                    let r = chunk * ROWS_PER_TASK + i;
                    self.row_f32(r, &mut row);
                    let b = self.bias.as_ref().map_or(0.0, |b| b[r]);
                    for (t, o) in out_row.iter_mut().enumerate() {
                        *o = dot(&row, &x[t * n_in..(t + 1) * n_in]) + b;
                    }
                }
            });
        if tokens == 1 {
            return yt;
        }
        let mut y = vec![0f32; tokens * n_out];
        for r in 0..n_out {
            for t in 0..tokens {
                y[t * n_out + r] = yt[r * tokens + t];
            }
        }
        y
    }
}

impl Linear {
    /// [`forward`](Self::forward) as one vector per token (a batch's logits): on a packed weight
    /// written in place by the kernels (`DenseMatrix::forward_rows`), no copy of each row out of
    /// the `[tokens, out_dim]` block.
    pub fn forward_rows(&self, x: &[f32], tokens: usize) -> Vec<Vec<f32>> {
        if let WeightData::Packed(p) = &self.w {
            return p
                .mat
                .forward_rows(&p.pool, x, tokens, self.bias.as_deref())
                .expect("x and bias lengths match the layer (checked at load and by the caller)");
        }
        let y = self.forward(x, tokens);
        y.chunks(self.out_dim.max(1)).map(<[f32]>::to_vec).collect()
    }

    /// [`forward`](Self::forward) of the `tokens` rows that `make(t, row)` computes (`in_dim` values
    /// each): on a packed weight in the pool region that converts the input, so the rows are made in
    /// parallel (`DenseMatrix::forward_made`); otherwise made here, one after another, first.
    pub fn forward_made(&self, make: &MakeRow<'_>, tokens: usize) -> Vec<f32> {
        if let WeightData::Packed(p) = &self.w {
            let mut y = vec![0f32; tokens * self.out_dim];
            p.mat
                .forward_made(&p.pool, make, tokens, self.bias.as_deref(), &mut y)
                .expect("bias length matches the layer (checked at load)");
            return y;
        }
        let mut x = vec![0f32; tokens * self.in_dim];
        for (t, row) in x.chunks_mut(self.in_dim).enumerate() {
            make(t, row);
        }
        self.forward(&x, tokens)
    }
}

/// Several projections of the same input (q/k/v, gate/up): when all are packed on one pool with the
/// same activation kind, the input is converted once and one pool region runs them all; otherwise
/// one call each.
pub fn forward_many<const N: usize>(ls: [&Linear; N], x: &[f32], tokens: usize) -> [Vec<f32>; N] {
    let packed: Option<Vec<&PackedWeight>> = ls
        .iter()
        .map(|l| match &l.w {
            WeightData::Packed(p) => Some(&**p),
            _ => None,
        })
        .collect();
    let together = packed.as_ref().is_some_and(|ps| {
        ps.iter()
            .all(|p| Arc::ptr_eq(&p.pool, &ps[0].pool) && p.mat.shares_input_with(&ps[0].mat))
    });
    let (Some(ps), true) = (packed, together) else {
        return ls.map(|l| l.forward(x, tokens));
    };
    let mut outs: [Vec<f32>; N] = std::array::from_fn(|i| vec![0f32; tokens * ls[i].out_dim]);
    let mut calls: Vec<DenseCall> = ps
        .iter()
        .zip(ls)
        .zip(outs.iter_mut())
        .map(|((p, l), y)| DenseCall {
            w: &p.mat,
            bias: l.bias.as_deref(),
            y,
        })
        .collect();
    forward_group(&ps[0].pool, &mut calls, x, tokens)
        .expect("x and bias lengths match the layers (checked at load and by the caller)");
    outs
}

fn bf16_bits(v: &[bf16]) -> &[u16] {
    // SAFETY: bf16 is a transparent wrapper of u16 (same size and alignment).
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u16, v.len()) }
}

fn fp8_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(fp8::e4m3_table)
}

/// f32 dot product on the widest SIMD tier of this CPU (the kernels crate's runtime-dispatched
/// `dot_f32`: this crate is compiled for baseline x86-64).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    moe_kernels::cpu::dot_f32(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(rows: usize, cols: usize, f: impl Fn(usize) -> f32) -> HostTensor {
        HostTensor {
            shape: vec![rows, cols],
            data: HostData::F32((0..rows * cols).map(f).collect()),
        }
    }

    #[test]
    fn matches_naive_for_every_storage() {
        let (o, i, t) = (37, 19, 5);
        let w = tensor(o, i, |k| ((k * 7919) % 13) as f32 * 0.25 - 1.5);
        let wf = w.to_f32();
        let x: Vec<f32> = (0..t * i).map(|k| (k % 5) as f32 - 2.0).collect();
        let bias: Vec<f32> = (0..o).map(|k| k as f32 * 0.1).collect();
        let mut expect = vec![0f32; t * o];
        for tt in 0..t {
            for r in 0..o {
                expect[tt * o + r] =
                    (0..i).map(|c| wf[r * i + c] * x[tt * i + c]).sum::<f32>() + bias[r];
            }
        }
        let bf = HostTensor {
            shape: vec![o, i],
            data: HostData::Bf16(w.to_bf16()),
        };
        // Values are multiples of 0.25 in [-1.5, 1.5]: exact in bf16 and in FP8 with scale 1.
        let fp8: Vec<u8> = wf
            .iter()
            .map(|v| (0u8..=255).find(|b| fp8::e4m3_to_f32(*b) == *v).unwrap())
            .collect();
        let f8 = HostTensor {
            shape: vec![o, i],
            data: HostData::F8E4M3 {
                bytes: fp8,
                scale_inv: vec![1.0; fp8::blocks(o, 8) * fp8::blocks(i, 8)],
                block: 8,
            },
        };
        for w in [w, bf, f8] {
            let lin = Linear::new(w, Some(bias.clone()));
            let y = lin.forward(&x, t);
            for (a, b) in y.iter().zip(&expect) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }
}
