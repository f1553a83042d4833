//! `cpu_dense_bench`: ms per call of one packed dense matrix (a projection, lm_head) on random GGML
//! blocks, the weight bandwidth it reaches and that as a share of the DRAM read bandwidth measured in
//! the same process, for each way of feeding grouped int weights ([`GroupedInput`]). Decode is one
//! GEMV per matrix per token: the figure that matters is GB/s at 1 token against the DRAM read rate.
//!
//! `run_cpu_dense_bench(&args)` returns the report (a markdown table).

use std::fmt::Write;
use std::time::Instant;

use super::bench::{dram_read_bw, BenchError};
use super::dense::{forward_group, DenseCall, DenseMatrix, GroupedInput};
use super::features::CpuTier;
use super::ggml::GgmlBlock;
use super::memory::{HugeBuffer, HugepageMode};
use super::moe::{format_for_ggml, SourceTensor};
use super::options::CpuMoeOptions;
use super::pool::WorkerPool;

/// One benchmark case: matrices run together in one group call (q/k/v), or a single one.
#[derive(Clone, Debug)]
pub struct DenseShape {
    pub name: String,
    /// `(rows, cols)` of each matrix of the group call (HF `[out, in]`), all with the same `cols`.
    pub mats: Vec<(usize, usize)>,
}

impl std::str::FromStr for DenseShape {
    type Err = String;
    /// `name=ROWSxCOLS[+ROWSxCOLS…]`, e.g. `qkv=4096x2048+512x2048+512x2048`.
    fn from_str(s: &str) -> Result<DenseShape, String> {
        let (name, dims) = s
            .split_once('=')
            .ok_or(format!("{s:?}: expected name=RxC"))?;
        let mats = dims
            .split('+')
            .map(|d| {
                let (r, c) = d.split_once('x').ok_or(format!("{d:?}: expected RxC"))?;
                let n = |v: &str| v.parse::<usize>().map_err(|e| format!("{d:?}: {e}"));
                Ok((n(r)?, n(c)?))
            })
            .collect::<Result<Vec<_>, String>>()?;
        if mats.iter().any(|m| m.0 == 0 || m.1 != mats[0].1) {
            return Err(format!("{s:?}: matrices need rows > 0 and the same cols"));
        }
        Ok(DenseShape {
            name: name.to_string(),
            mats,
        })
    }
}

/// Flags of the dense benchmark.
#[derive(Clone, Debug)]
pub struct CpuDenseBenchArgs {
    pub shapes: Vec<DenseShape>,
    pub kind: GgmlBlock,
    pub inputs: Vec<GroupedInput>,
    pub tokens: Vec<usize>,
    pub threads: usize,
    pub iters: usize,
    pub tier: Option<CpuTier>,
    pub probe_mib: usize,
}

impl Default for CpuDenseBenchArgs {
    /// Qwen3-30B-A3B's attention projections and lm_head in Q8_0.
    fn default() -> Self {
        let shape = |s: &str| s.parse().expect("valid default shape");
        CpuDenseBenchArgs {
            shapes: vec![
                shape("qkv=4096x2048+512x2048+512x2048"),
                shape("o=2048x4096"),
                shape("lm_head=151936x2048"),
            ],
            kind: GgmlBlock::Q8_0,
            inputs: vec![
                GroupedInput::Int8,
                GroupedInput::Int8Pair,
                GroupedInput::Int8PairAll,
                GroupedInput::Bf16,
            ],
            tokens: vec![1, 4],
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            iters: 20,
            tier: None,
            probe_mib: 1024,
        }
    }
}

/// Random GGML blocks of `kind` for a `[rows, cols]` matrix: random codes, f16 scales set to small
/// finite values (the codes' bytes would otherwise hold NaNs and infinities).
fn random_blocks(
    pool: &WorkerPool,
    kind: GgmlBlock,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Vec<u8> {
    let rb = kind.row_bytes(cols).expect("cols checked by the caller");
    let (_, bb) = kind.block();
    let mut data = vec![0u8; rows * rb];
    let base = data.as_mut_ptr() as usize;
    let rows_per_item = (1 << 20) / rb.max(1) + 1;
    pool.run(&[rows.div_ceil(rows_per_item)], &|_, item, _| {
        let r0 = item * rows_per_item;
        let n = rows_per_item.min(rows - r0);
        // SAFETY: rows r0 .. r0 + n are written by this item only; `data` outlives the region.
        let d = unsafe { std::slice::from_raw_parts_mut((base as *mut u8).add(r0 * rb), n * rb) };
        let mut s = seed ^ (item as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for b in d.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *b = s as u8;
        }
        let f16 = |x: f32| half::f16::from_f32(x).to_le_bytes();
        for blk in d.chunks_exact_mut(bb) {
            match kind {
                GgmlBlock::Q6K => blk[208..210].copy_from_slice(&f16(0.0007)),
                GgmlBlock::Q4K | GgmlBlock::Q5K | GgmlBlock::Q4_1 | GgmlBlock::Q5_1 => {
                    blk[..2].copy_from_slice(&f16(0.001));
                    blk[2..4].copy_from_slice(&f16(0.0009));
                }
                GgmlBlock::Q4_0 | GgmlBlock::Q5_0 | GgmlBlock::Q8_0 => {
                    blk[..2].copy_from_slice(&f16(0.001))
                }
                GgmlBlock::F16 | GgmlBlock::Bf16 => {
                    blk[1] &= 0x3B; // small finite values
                }
                GgmlBlock::F32 => blk[3] = 0x3C,
            }
        }
    });
    data
}

/// Runs the benchmark and returns the report.
pub fn run_cpu_dense_bench(a: &CpuDenseBenchArgs) -> Result<String, BenchError> {
    let mut out = String::new();
    let pool = CpuMoeOptions {
        threads: Some(a.threads),
        ..Default::default()
    }
    .build_pool()?;
    let bw = {
        let mut probe = HugeBuffer::new(a.probe_mib.max(1) << 20, HugepageMode::Auto, None);
        probe.iter_mut().step_by(4096).for_each(|b| *b = 1);
        dram_read_bw(&pool, &probe)
    };
    let format = format_for_ggml(a.kind);
    let _ = writeln!(
        out,
        "# bench cpu-dense: {} as {format:?}, {} threads, tier {} (detected {}), DRAM read {bw:.1} GB/s",
        a.kind.name(),
        a.threads,
        a.tier.unwrap_or(CpuTier::Amx).clamp_to_cpu(),
        super::features::detected_tier()
    );
    let _ = writeln!(
        out,
        "| shape | input | tokens | ms (mean) | ms (median) | GB/s weights | % DRAM read BW (median) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for (si, shape) in a.shapes.iter().enumerate() {
        let cols = shape.mats[0].1;
        if a.kind.row_bytes(cols).is_none() {
            return Err(BenchError::Args("cols not a whole number of GGML blocks"));
        }
        let mut mats = Vec::new();
        for (mi, &(rows, cols)) in shape.mats.iter().enumerate() {
            let data = random_blocks(&pool, a.kind, rows, cols, (si * 16 + mi) as u64 + 1);
            let src = SourceTensor::Ggml {
                kind: a.kind,
                data: &data,
            };
            mats.push(DenseMatrix::new(format, rows, cols, &src, a.tier)?);
        }
        let bytes: usize = mats.iter().map(DenseMatrix::bytes).sum();
        for &input in &a.inputs {
            for m in mats.iter_mut() {
                m.set_grouped_input(input);
            }
            for &tokens in &a.tokens {
                let x: Vec<f32> = (0..tokens * cols)
                    .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut ys: Vec<Vec<f32>> =
                    mats.iter().map(|m| vec![0f32; tokens * m.rows()]).collect();
                let call = |ys: &mut Vec<Vec<f32>>| {
                    let mut calls: Vec<DenseCall> = mats
                        .iter()
                        .zip(ys.iter_mut())
                        .map(|(w, y)| DenseCall { w, bias: None, y })
                        .collect();
                    forward_group(&pool, &mut calls, &x, tokens)
                };
                for _ in 0..3 {
                    call(&mut ys)?;
                }
                let mut times = Vec::with_capacity(a.iters);
                let start = Instant::now();
                for _ in 0..a.iters {
                    let t = Instant::now();
                    call(&mut ys)?;
                    times.push(t.elapsed().as_secs_f64());
                }
                let mean = start.elapsed().as_secs_f64() / a.iters.max(1) as f64;
                times.sort_by(f64::total_cmp);
                let median = times[times.len() / 2];
                let _ = writeln!(
                    out,
                    "| {} | {input:?} | {tokens} | {:.3} | {:.3} | {:.1} | {:.0}% |",
                    shape.name,
                    mean * 1e3,
                    median * 1e3,
                    bytes as f64 / mean / 1e9,
                    100.0 * bytes as f64 / median / 1e9 / bw,
                );
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_shapes_and_rejects_mixed_widths() {
        let s: DenseShape = "qkv=64x32+16x32".parse().unwrap();
        assert_eq!(s.mats, vec![(64, 32), (16, 32)]);
        assert!("x=64x32+16x64".parse::<DenseShape>().is_err());
        assert!("64x32".parse::<DenseShape>().is_err());
    }

    #[test]
    fn tiny_bench_reports_every_line() {
        let a = CpuDenseBenchArgs {
            shapes: vec!["a=40x64+8x64".parse().unwrap()],
            tokens: vec![1, 3],
            threads: 1,
            iters: 2,
            probe_mib: 1,
            ..Default::default()
        };
        let r = run_cpu_dense_bench(&a).unwrap();
        assert_eq!(
            r.lines().filter(|l| l.starts_with("| a |")).count(),
            8, // tokens × inputs
            "{r}"
        );
    }
}
