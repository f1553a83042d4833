//! Dense projections `y = x·Wᵀ (+ b)` on the packed tile formats of the expert kernels: attention
//! projections, dense MLPs, shared experts, lm_head. One matrix, packed once at load (bf16, int8,
//! int4, or llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks kept bit for bit), run by the persistent worker pool
//! with the tier detected once (AMX for many rows of bf16 / int8, AVX-512 VNNI / BF16, AVX2, scalar).
//!
//! # Work split (where the time goes)
//! A call converts the activation rows once (bf16 or int8 with per-group sums, as the tier reads them),
//! then hands out chunks of 16-row N-tiles through the pool's atomic counter. Each chunk streams its
//! weight bytes once for *all* rows of the call (blocks of up to 8 rows share each 64-byte load; later
//! blocks re-read the chunk from L1/L2), so a batch of T tokens costs one pass over the weights, not T.
//! Decode is weight-bandwidth-bound; prefill is dot-instruction-bound.

use std::cell::RefCell;
use std::sync::Mutex;

use crate::cpu::features::CpuTier;
use crate::cpu::memory::{HugeBuffer, HugepageMode};
use crate::cpu::moe::act::{ActBuf, ActKind, ActRef};
use crate::cpu::moe::act_i8::OUTLIER_RMS_RATIO;
use crate::cpu::moe::gemm::{act_kind, amx_int_supports, amx_supports, gemm, gemm_amx_int};
use crate::cpu::moe::pack::{check_source, pack_matrix, GroupedCodes, MatLayout, MatRef};
use crate::cpu::moe::{PackError, SourceTensor, WeightFormat};
use crate::cpu::pool::WorkerPool;

/// Matrices at least this large get (transparent or reserved) huge pages; smaller ones would waste
/// most of a 2 MiB page each.
const HUGEPAGE_MIN_BYTES: usize = 8 << 20;

/// Calls with at least this many rows use AMX when the tier and format have it.
const AMX_MIN_ROWS: usize = 16;

/// [`AMX_MIN_ROWS`], or `MOE_CPU_DENSE_AMX_MIN_ROWS` when set (A/B runs of where AMX starts to pay).
fn amx_min_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("MOE_CPU_DENSE_AMX_MIN_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&r| r >= 1)
            .unwrap_or(AMX_MIN_ROWS)
    })
}

/// Calls of fewer rows than [`amx_min_rows`] but at least this many run grouped 8-bit codes (Q8_0,
/// Q6_K, Q5_K) on AMX-INT8 (`dense_amx_int`) with the same int8 activations as the VNNI kernels (the
/// same integer dots, scaled in another order: within 1e-5). The Q8_0 lm_head of SmolLM2-135M (int8
/// pairs with a residual in every group: 16 rows for 8 tokens), 2 threads: 0.88 ms at 8 tokens
/// against 1.61 on VNNI on the build machine's Xeon; 2.3× one token's time against 2.8× on VNNI on
/// the H200 host's (2026-12-02, docs/PERF.md). 4-bit codes stay on VNNI ([`amx_int4_min_rows`]).
const AMX_INT_MIN_ROWS: usize = 8;

/// [`AMX_INT_MIN_ROWS`], or `MOE_CPU_DENSE_AMX_INT_MIN_ROWS` when set (0: off, the VNNI kernels
/// below [`amx_min_rows`]; A/B runs).
fn amx_int_min_rows() -> usize {
    rows_from_env("MOE_CPU_DENSE_AMX_INT_MIN_ROWS", AMX_INT_MIN_ROWS)
}

/// From how many rows grouped 4-bit codes (Q4_0, Q4_1, Q4_K) run on AMX-INT8: by default never below
/// [`amx_min_rows`] (`MOE_CPU_DENSE_AMX_INT4_MIN_ROWS=N` for A/B runs). Their codes are split into
/// bytes per N-tile and a group of 32 inputs is half a tile's depth, so the split and the per-group
/// scaling cost more than VNNI's dots: SmolLM2-135M's projections at 8 tokens, 2 threads, on the H200
/// host's Xeon: 5.1× one token's time for gate/up on AMX-INT8 against 2.8× on VNNI (down 4.8× / 3.0×).
fn amx_int4_min_rows() -> usize {
    rows_from_env("MOE_CPU_DENSE_AMX_INT4_MIN_ROWS", usize::MAX)
}

/// `var` as a row count (0: never), else `default`.
fn rows_from_env(var: &str, default: usize) -> usize {
    match std::env::var(var)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(0) => usize::MAX,
        Some(r) => r,
        None => default,
    }
}

/// Which AMX-INT8 kernel runs a dense call's grouped int weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxIntKernel {
    /// `dense_amx_int::gemm`: codes split once per N-tile, two C tiles in turn, totals in registers.
    Pipelined,
    /// The experts' `kern_amx_int`, one group at a time (the same numbers: A/B runs).
    PerGroup,
}

impl AmxIntKernel {
    /// `Pipelined`, or `PerGroup` with `MOE_CPU_DENSE_AMX_INT_KERNEL=pergroup` (A/B runs).
    fn from_env() -> AmxIntKernel {
        static K: std::sync::OnceLock<AmxIntKernel> = std::sync::OnceLock::new();
        *K.get_or_init(
            || match std::env::var("MOE_CPU_DENSE_AMX_INT_KERNEL").as_deref() {
                Ok("pergroup") => AmxIntKernel::PerGroup,
                _ => AmxIntKernel::Pipelined,
            },
        )
    }
}

/// Rows converted per work item when activations are converted in parallel.
const CONVERT_ROWS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum DenseError {
    #[error(transparent)]
    Pack(#[from] PackError),
    #[error("matrices of one group call must share their input (width, tier, activation kind)")]
    Mixed,
    #[error("{what} has {got} values, expected {want}")]
    Len {
        what: &'static str,
        got: usize,
        want: usize,
    },
}

#[derive(Default)]
struct Scratch {
    act: ActBuf,
    rows: Vec<u32>,
    /// Groups the residual rows of a `Blocks` call have codes in.
    live: Vec<u16>,
}

/// One packed `[rows, cols]` weight matrix (HF `[out, in]`).
pub struct DenseMatrix {
    l: MatLayout,
    buf: HugeBuffer,
    tier: CpuTier,
    grouped: GroupedInput,
    /// Calls from this many rows on (below the bf16-widened AMX path) use AMX-INT8.
    amx_int_min_rows: usize,
    amx_int_kernel: AmxIntKernel,
    scratch: Mutex<Scratch>,
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: pool threads write disjoint elements through it while the owner is borrowed.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

thread_local! {
    static TILE_OUT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One matrix of a group call as the workers see it.
struct Target<'a> {
    mat: MatRef<'a>,
    /// Widened to bf16 per chunk (grouped int formats on AVX-512).
    wide: bool,
    amx: bool,
    /// Grouped int codes on AMX-INT8 with int8 activations, by this kernel.
    amx_int: Option<AmxIntKernel>,
    bias: Option<&'a [f32]>,
    /// Where each token's output row starts.
    rows: &'a [SyncPtr],
}

impl DenseMatrix {
    /// Packs `src` (`[rows, cols]`, checked) into `format`; `max_tier` caps the kernel tier.
    pub fn new(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        src: &SourceTensor<'_>,
        max_tier: Option<CpuTier>,
    ) -> Result<DenseMatrix, DenseError> {
        format.check_group()?;
        check_source("weight", src, rows, cols)?;
        if format == WeightFormat::Fp8Block && !matches!(src, SourceTensor::Fp8E4M3 { .. }) {
            return Err(PackError::NotFp8 { name: "weight" }.into());
        }
        let l = MatLayout::new(format, rows, cols);
        let mode = if l.bytes() >= HUGEPAGE_MIN_BYTES {
            HugepageMode::Auto
        } else {
            HugepageMode::Off
        };
        let mut buf = HugeBuffer::new(l.bytes(), mode, None);
        {
            let (w, rest) = buf.split_at_mut(l.w_bytes);
            // SAFETY: the scales start at a multiple of 512 bytes of a page-aligned mapping (4-byte
            // aligned) and `rest` holds at least `4 · s_len` bytes (`MatLayout::bytes`).
            let s = unsafe { std::slice::from_raw_parts_mut(rest.as_mut_ptr().cast(), l.s_len) };
            pack_matrix(&l, src, w, s);
        }
        Ok(DenseMatrix {
            l,
            buf,
            tier: max_tier.unwrap_or(CpuTier::Amx).clamp_to_cpu(),
            grouped: GroupedInput::default_for(format),
            amx_int_min_rows: match GroupedCodes::of(format) {
                Some(c) if c.int4 => amx_int4_min_rows(),
                _ => amx_int_min_rows(),
            },
            amx_int_kernel: AmxIntKernel::from_env(),
            scratch: Mutex::new(Scratch::default()),
        })
    }

    pub fn rows(&self) -> usize {
        self.l.n
    }

    pub fn cols(&self) -> usize {
        self.l.k
    }

    pub fn format(&self) -> WeightFormat {
        self.l.format
    }

    pub fn tier(&self) -> CpuTier {
        self.tier
    }

    /// Lowers (or raises, up to the CPU's best) the kernel tier: tests, benchmarks.
    pub fn set_max_tier(&mut self, t: CpuTier) {
        self.tier = t.clamp_to_cpu();
    }

    /// Sets what few-row calls feed grouped int weights ([`GroupedInput`]): tests, benchmarks.
    pub fn set_grouped_input(&mut self, g: GroupedInput) {
        self.grouped = g;
    }

    /// Sets from how many rows a call runs on AMX-INT8 when the tier has it (tests, benchmarks).
    pub fn set_amx_int_min_rows(&mut self, rows: usize) {
        self.amx_int_min_rows = rows.max(1);
    }

    /// Sets which AMX-INT8 kernel runs this matrix (tests, benchmarks).
    pub fn set_amx_int_kernel(&mut self, k: AmxIntKernel) {
        self.amx_int_kernel = k;
    }

    /// Whether a call of `tokens` rows runs on AMX-INT8 ([`gemm_int_tiles`]).
    fn amx_int(&self, tokens: usize) -> bool {
        self.tier == CpuTier::Amx
            && tokens >= self.amx_int_min_rows
            && amx_int_supports(self.l.format)
            && matches!(self.input_kind(tokens), ActKind::I8 { .. })
    }

    pub fn grouped_input(&self) -> GroupedInput {
        self.grouped
    }

    /// Bytes of packed weights and scales.
    pub fn bytes(&self) -> usize {
        self.l.bytes()
    }

    /// The activation kind a call of `tokens` rows converts its input to.
    fn input_kind(&self, tokens: usize) -> ActKind {
        if widened(self.tier, self.l.format, self.grouped, tokens) {
            ActKind::Bf16
        } else {
            act_kind(self.tier, self.l.format, self.l.k_pad)
        }
    }

    /// With a call of `tokens` rows feeding each token as two int8 rows (codes, then the residual in
    /// the groups whose amax is above this ratio times the row's RMS): the ratio.
    fn residual_ratio(&self, tokens: usize) -> Option<f32> {
        if !matches!(self.input_kind(tokens), ActKind::I8 { .. }) {
            return None;
        }
        match self.grouped {
            GroupedInput::Int8Pair => Some(OUTLIER_RMS_RATIO),
            GroupedInput::Int8PairAll => Some(0.0),
            GroupedInput::Int8 | GroupedInput::Bf16 => None,
        }
    }

    fn mat(&self) -> MatRef<'_> {
        let w = &self.buf[..self.l.w_bytes];
        let sb = &self.buf[self.l.w_bytes..self.l.w_bytes + 4 * self.l.s_len];
        // SAFETY: 4-byte aligned (see `new`) and in bounds; any bit pattern is an f32.
        let s = unsafe { std::slice::from_raw_parts(sb.as_ptr().cast::<f32>(), self.l.s_len) };
        MatRef { l: self.l, w, s }
    }

    /// Row `r` of W as f32 (embedding lookups): the packed values exactly, no rounding.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let m = self.mat();
        for (c, o) in out.iter_mut().enumerate().take(self.l.k) {
            *o = m.weight(r, c);
        }
    }

    /// `y[t] = W·x[t] (+ bias)` for `tokens` rows of `x` (`[tokens, cols]`) into `y` (`[tokens, rows]`).
    pub fn forward(
        &self,
        pool: &WorkerPool,
        x: &[f32],
        tokens: usize,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), DenseError> {
        forward_group(pool, &mut [DenseCall { w: self, bias, y }], x, tokens)
    }

    /// [`forward`](Self::forward) into one new vector per token (`rows` values each), written by the
    /// kernels in place: a batch's logits without a copy of every row out of one `[tokens, rows]`
    /// block (an lm_head of 49152 rows: 1.5 MiB a step for 8 tokens, on the calling thread).
    pub fn forward_rows(
        &self,
        pool: &WorkerPool,
        x: &[f32],
        tokens: usize,
        bias: Option<&[f32]>,
    ) -> Result<Vec<Vec<f32>>, DenseError> {
        let n = self.l.n;
        let mut ys: Vec<Vec<f32>> = (0..tokens).map(|_| Vec::with_capacity(n)).collect();
        let rows = ys.iter_mut().map(|y| SyncPtr(y.as_mut_ptr())).collect();
        let out = Out {
            w: self,
            bias,
            rows,
        };
        forward_input(pool, vec![out], Input::Rows(x), tokens)?;
        for y in ys.iter_mut() {
            // SAFETY: capacity `n` (above); the call wrote all `n` values of every token's row (its
            // chunks cover every column) or returned an error before writing any.
            unsafe { y.set_len(n) };
        }
        Ok(ys)
    }

    /// [`forward`](Self::forward) of rows that `make(t, row)` computes (`cols` values each) where
    /// the call converts its input: in the conversion's pool region when there is one (several
    /// tokens), so the work that makes a row (an MLP's gated activation, say) runs in parallel
    /// instead of on the calling thread before the call.
    pub fn forward_made(
        &self,
        pool: &WorkerPool,
        make: &MakeRow<'_>,
        tokens: usize,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), DenseError> {
        let out = Out::of(&mut DenseCall { w: self, bias, y }, tokens)?;
        forward_input(pool, vec![out], Input::Made(make), tokens)
    }

    /// Whether this matrix and `o` read the same converted activations (same tier, width, and
    /// activation kind at every row count), so [`forward_group`] can run them together.
    pub fn shares_input_with(&self, o: &DenseMatrix) -> bool {
        self.tier == o.tier
            && self.l.k == o.l.k
            && self.l.k_pad == o.l.k_pad
            && [1, amx_min_rows()].iter().all(|&t| {
                self.input_kind(t) == o.input_kind(t)
                    && self.residual_ratio(t) == o.residual_ratio(t)
            })
    }
}

/// What a call of fewer than [`AMX_MIN_ROWS`] rows feeds grouped int weights (Q4_0 / Q4_1 / Q8_0 / Q6_K
/// codes) on AVX-512. Calls of more rows on AMX always widen to bf16 (AMX-BF16 tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupedInput {
    /// int8 codes per scale group of the weights, with the group's scale (llama.cpp's q8_0 / q8_1
    /// activations): one `vpdpbusd` per 64 weight bytes, so a decode GEMV runs at DRAM bandwidth. An
    /// outlier channel coarsens the other 31 values of its group (step amax/127).
    Int8,
    /// Two int8 rows per token: the codes of `Int8`, then, in the groups that hold an outlier, the codes
    /// of what they left over (the residual, with its own group scales); the dots are summed. Outlier
    /// groups get ~amax/32000 per value, the rest amax/254 as with `Int8`; the kernels skip the residual
    /// row's other groups (zero scale), so it costs about one int8 row plus the outlier groups (see
    /// `ActWriter::write_row_split`). Same kernel on twice the rows, weights read once, no widening.
    Int8Pair,
    /// `Int8Pair` with the residual in every group: ~int16 precision (SmolLM2-135M Q4_1's logits
    /// within 0.02–0.09% of the f32 path, against 0.7–2.6% with `Int8Pair`), for twice the dot work
    /// of `Int8`.
    Int8PairAll,
    /// Weights widened to bf16 per chunk, bf16 activations: 2⁻⁹ relative per element whatever the
    /// outliers, for ~20 more instructions per 64 weight bytes (`dense_widen`).
    Bf16,
}

impl std::str::FromStr for GroupedInput {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "int8" => Ok(GroupedInput::Int8),
            "int8pair" => Ok(GroupedInput::Int8Pair),
            "int8pairall" => Ok(GroupedInput::Int8PairAll),
            "bf16" => Ok(GroupedInput::Bf16),
            _ => Err(format!("{s:?} is not int8, int8pair, int8pairall or bf16")),
        }
    }
}

impl GroupedInput {
    /// The default for `format`: `Int8PairAll` for 8-bit codes (Q8_0, Q5_K, Q6_K, int8), `Int8Pair`
    /// for 4-bit codes. One int8 row per token (llama.cpp's scheme) is not enough for small models'
    /// outlier channels: on the real SmolLM2-135M Q4_1 the first greedy token of "What is the capital
    /// of France?" has a 0.086 logit margin in f32, and int8 rows into the Q8_0 lm_head alone turned
    /// it the other way; pairs with the residual in outlier groups only left it at the mercy of
    /// rounding order (−0.001 to 0.084 across builds); the lm_head's input decides the logits
    /// directly, so its weights' precision gets matching activations (`generate --expert-activations
    /// bf16 --logits-out`). `MOE_CPU_DENSE_INPUT=int8|int8pair|int8pairall|bf16` overrides it for
    /// every format (A/B runs).
    pub fn default_for(format: WeightFormat) -> GroupedInput {
        static FORCED: std::sync::OnceLock<Option<GroupedInput>> = std::sync::OnceLock::new();
        let forced = *FORCED.get_or_init(|| {
            std::env::var("MOE_CPU_DENSE_INPUT")
                .ok()
                .and_then(|v| v.parse().ok())
        });
        forced.unwrap_or(match format {
            WeightFormat::Int8 | WeightFormat::Int8Group { .. } | WeightFormat::Int8Min { .. } => {
                GroupedInput::Int8PairAll
            }
            _ => GroupedInput::Int8Pair,
        })
    }
}

/// Whether a call of `tokens` rows widens a matrix of `format` to bf16 per chunk on `tier` (see
/// `dense_widen`).
fn widened(tier: CpuTier, format: WeightFormat, grouped: GroupedInput, tokens: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && tier >= CpuTier::Avx512
        && widens(format)
        && (grouped == GroupedInput::Bf16 || (tier == CpuTier::Amx && tokens >= amx_min_rows()))
}

#[cfg(target_arch = "x86_64")]
use crate::cpu::dense_widen::{widen_tiles, widens};
#[cfg(not(target_arch = "x86_64"))]
fn widens(_: WeightFormat) -> bool {
    false
}

/// Runs N-tiles `nt0 .. nt0 + nts` of a widened matrix: two N-tiles at a time widened to bf16 (L1),
/// then the bf16 kernel over every row.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn gemm_widened(
    tier: CpuTier,
    amx: bool,
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    // SAFETY: the tier (≥ Avx512, checked by `widened`) is present and the format is one `widens`
    // accepts; activations are bf16 for widened matrices.
    unsafe { crate::cpu::moe::gemm::gemm_widened(tier, amx, widen_tiles, w, nt0, nts, a, y, ldy) }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
fn gemm_widened(
    _: CpuTier,
    _: bool,
    _: &MatRef<'_>,
    _: usize,
    _: usize,
    _: &ActRef<'_>,
    _: &mut [f32],
    _: usize,
) {
    unreachable!("only x86_64 widens")
}

/// Grouped int weights × int8 rows on AMX-INT8: `kernel` when this CPU has AMX and the call is one
/// it takes (group size, consecutive rows stored to a multiple of 16), else the experts' kernel
/// (which falls back to VNNI). Same contract as the other kernels (`moe::gemm::gemm`).
fn gemm_int_tiles(
    kernel: AmxIntKernel,
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &mut [f32],
    ldy: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if kernel == AmxIntKernel::Pipelined && takes_tiles(w, nt0, nts, a, y, ldy) {
        // SAFETY: AMX present (tier detected, permission taken by the detection); codes, group,
        // row order, storage and shapes checked by `takes_tiles`.
        return unsafe { crate::cpu::dense_amx_int::gemm(w, nt0, nts, a, y, ldy) };
    }
    gemm_amx_int(w, nt0, nts, a, y, ldy)
}

/// Whether `dense_amx_int::gemm` can run this call (its safety contract).
#[cfg(target_arch = "x86_64")]
fn takes_tiles(
    w: &MatRef<'_>,
    nt0: usize,
    nts: usize,
    a: &ActRef<'_>,
    y: &[f32],
    ldy: usize,
) -> bool {
    let (m, l) = (a.rows.len(), &w.l);
    let Some(codes) = GroupedCodes::of(l.format) else {
        return false;
    };
    if m == 0
        || nts == 0
        || CpuTier::Amx.clamp_to_cpu() != CpuTier::Amx
        || !crate::cpu::dense_amx_int::supports(codes)
        || a.kind != (ActKind::I8 { group: codes.group })
        || a.k_pad != l.k_pad
    {
        return false;
    }
    let r0 = a.rows[0] as usize;
    let consecutive = a
        .rows
        .iter()
        .enumerate()
        .all(|(i, &r)| r as usize == r0 + i);
    let stored = a.q.len() >= (r0 + m.div_ceil(16) * 16) * a.k_pad;
    consecutive
        && stored
        && nt0 + nts <= l.n_tiles
        && 16 * nts <= ldy
        && y.len() >= (m - 1) * ldy + 16 * nts
}

/// One matrix of a [`forward_group`] call and where its output goes (`[tokens, rows]`).
pub struct DenseCall<'a> {
    pub w: &'a DenseMatrix,
    pub bias: Option<&'a [f32]>,
    pub y: &'a mut [f32],
}

/// Computes input row `t` into the slice (the matrix's `cols` values): [`DenseMatrix::forward_made`].
pub type MakeRow<'a> = dyn Fn(usize, &mut [f32]) + Sync + 'a;

/// A call's input rows: given, or made where they are converted.
#[derive(Clone, Copy)]
enum Input<'a> {
    Rows(&'a [f32]),
    Made(&'a MakeRow<'a>),
}

thread_local! {
    /// Per thread: the made input row being converted.
    static MADE_ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One matrix of a call and where each token's output row starts (`rows` values from there).
struct Out<'a> {
    w: &'a DenseMatrix,
    bias: Option<&'a [f32]>,
    rows: Vec<SyncPtr>,
}

impl<'a> Out<'a> {
    /// The rows of `c.y` (`[tokens, rows]`, length checked).
    fn of(c: &mut DenseCall<'a>, tokens: usize) -> Result<Out<'a>, DenseError> {
        let n = c.w.l.n;
        if c.y.len() != tokens * n {
            let (got, want) = (c.y.len(), tokens * n);
            return Err(DenseError::Len {
                what: "y",
                got,
                want,
            });
        }
        let base = c.y.as_mut_ptr();
        Ok(Out {
            w: c.w,
            bias: c.bias,
            // in bounds: t · n < tokens · n = y.len()
            rows: (0..tokens)
                .map(|t| SyncPtr(base.wrapping_add(t * n)))
                .collect(),
        })
    }
}

/// Several matrices over the same input `x` (`[tokens, cols]`), e.g. q/k/v or gate/up: activations
/// converted once, one pool region over all their N-tiles. The matrices must share their input
/// ([`DenseMatrix::shares_input_with`]).
pub fn forward_group(
    pool: &WorkerPool,
    calls: &mut [DenseCall<'_>],
    x: &[f32],
    tokens: usize,
) -> Result<(), DenseError> {
    let outs = calls
        .iter_mut()
        .map(|c| Out::of(c, tokens))
        .collect::<Result<Vec<_>, _>>()?;
    forward_input(pool, outs, Input::Rows(x), tokens)
}

/// [`forward_group`] over given or made input rows, into the rows of `outs` (which the caller keeps
/// borrowed and of the matrices' widths).
fn forward_input(
    pool: &WorkerPool,
    outs: Vec<Out<'_>>,
    x: Input<'_>,
    tokens: usize,
) -> Result<(), DenseError> {
    let Some(first) = outs.first().map(|c| c.w) else {
        return Ok(());
    };
    for c in outs.iter() {
        let n = c.w.l.n;
        let x_len = match x {
            Input::Rows(x) => x.len(),
            Input::Made(_) => tokens * c.w.l.k,
        };
        for (what, got, want) in [
            ("x", x_len, tokens * c.w.l.k),
            ("y rows", c.rows.len(), tokens),
            ("bias", c.bias.map_or(n, <[f32]>::len), n),
        ] {
            if got != want {
                return Err(DenseError::Len { what, got, want });
            }
        }
        if !first.shares_input_with(c.w) {
            return Err(DenseError::Mixed);
        }
    }
    if tokens == 0 {
        return Ok(());
    }
    let mut guard = first.scratch.lock().unwrap_or_else(|e| e.into_inner());
    let s = &mut *guard;
    let (k, k_pad, tier) = (first.l.k, first.l.k_pad, first.tier);
    let kind = first.input_kind(tokens);
    let rows = RowLayout::of(first.residual_ratio(tokens));
    let act_rows = rows.act_rows(tokens);
    // AMX loads 16 rows per A tile from a view's first row: storage rounded up past the last view's
    // start (the extra rows' results are discarded).
    s.act.reserve(kind, act_rows.div_ceil(16) * 16 + 16, k_pad);
    s.rows.clear();
    s.rows.extend(0..act_rows as u32);
    convert_rows(pool, &mut s.act, kind, k_pad, (x, k), tokens, rows);
    // The rows the kernels run, and for `Blocks` the residual rows as a second view.
    // The residual rows run only over the groups some of them has codes in, and not at all when
    // none has: a pass over every tile to skip every group cost a decode token ~20% of its
    // projections' time.
    if let (RowLayout::Blocks(_), ActKind::I8 { group }) = (rows, kind) {
        let groups = k_pad / group;
        let scales = &s.act.scale[tokens * groups..2 * tokens * groups];
        s.live.clear();
        s.live.extend(
            (0..groups as u16).filter(|&g| scales.chunks(groups).any(|r| r[g as usize] != 0.0)),
        );
    }
    let (a, a_rest) = match rows {
        RowLayout::Blocks(_) => (
            s.act.view(kind, k_pad, &s.rows[..tokens]),
            (!s.live.is_empty()).then(|| {
                s.act
                    .view(kind, k_pad, &s.rows[tokens..])
                    .with_live(&s.live)
            }),
        ),
        _ => (s.act.view(kind, k_pad, &s.rows), None),
    };
    // Whether the residual rows' dots are in the tile buffer (not for `Blocks` without live groups).
    let with_rest = !matches!(rows, RowLayout::Blocks(_)) || a_rest.is_some();

    // Work items: chunks of N-tiles of every matrix, in order.
    let mut items: Vec<(usize, usize, usize)> = Vec::new(); // (call, first tile, tiles)
    let total_tiles: usize = outs.iter().map(|c| c.w.l.n_tiles).sum();
    // Several chunks per thread so a slow core does not hold the call; ≥ 2 tiles for AMX's 2×2.
    let per_chunk = total_tiles.div_ceil(4 * pool.threads()).max(2);
    for (ci, c) in outs.iter().enumerate() {
        let nt = c.w.l.n_tiles;
        let mut t0 = 0;
        while t0 < nt {
            items.push((ci, t0, per_chunk.min(nt - t0)));
            t0 += per_chunk;
        }
    }
    let targets: Vec<Target<'_>> = outs
        .iter()
        .map(|c| {
            let wide = widened(tier, c.w.l.format, c.w.grouped, tokens);
            let amx = c.w.tier == CpuTier::Amx
                && (wide || amx_supports(c.w.l.format))
                && tokens >= amx_min_rows();
            Target {
                mat: c.w.mat(),
                wide,
                amx,
                amx_int: c.w.amx_int(tokens).then_some(c.w.amx_int_kernel),
                bias: c.bias,
                rows: &c.rows,
            }
        })
        .collect();
    let groups = pool.groups();
    let per_group: Vec<usize> = (0..groups)
        .map(|g| (items.len() + groups - 1 - g) / groups)
        .collect();
    pool.run(&per_group, &|g, i, _| {
        let (ci, nt0, nts) = items[i * groups + g];
        let Target {
            mat,
            wide,
            amx,
            amx_int,
            bias,
            rows: y_rows,
        } = &targets[ci];
        let n = mat.l.n;
        let ld = 16 * nts;
        TILE_OUT.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < act_rows * ld {
                buf.resize(act_rows * ld, 0.0);
            }
            if *wide {
                gemm_widened(tier, *amx, mat, nt0, nts, &a, &mut buf[..], ld);
            } else {
                let run = |a: &ActRef<'_>, out: &mut [f32]| match *amx_int {
                    // a residual view stays on VNNI, which visits its live groups only
                    Some(kernel) if a.live.is_empty() => {
                        gemm_int_tiles(kernel, mat, nt0, nts, a, out, ld)
                    }
                    _ => gemm(tier, *amx, mat, nt0, nts, a, out, ld),
                };
                run(&a, &mut buf[..]);
                if let Some(r) = &a_rest {
                    run(r, &mut buf[tokens * ld..]);
                }
            }
            let col0 = 16 * nt0;
            let cols = ld.min(n - col0);
            for t in 0..tokens {
                let (main, rest) = rows.rows_of(t, tokens);
                let rest = rest.filter(|_| with_rest);
                let src = &buf[main * ld..main * ld + cols];
                // SAFETY: columns col0 .. col0 + cols of token t's output row (`n` values from
                // `y_rows[t]`, the caller's) belong to this chunk alone; the rows outlive the region.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(y_rows[t].get().add(col0), cols) };
                // plain slice loops per case: a 64-token prefill copies ~330K outputs per layer here
                match (rest.map(|r| &buf[r * ld..r * ld + cols]), bias) {
                    (None, None) => dst.copy_from_slice(src),
                    (None, Some(b)) => {
                        for ((d, &v), &b) in dst.iter_mut().zip(src).zip(&b[col0..col0 + cols]) {
                            *d = v + b;
                        }
                    }
                    // the residual row's dot, for split tokens
                    (Some(r), None) => {
                        for ((d, &v), &r) in dst.iter_mut().zip(src).zip(r) {
                            *d = v + r;
                        }
                    }
                    (Some(r), Some(b)) => {
                        let b = &b[col0..col0 + cols];
                        for (((d, &v), &r), &b) in dst.iter_mut().zip(src).zip(r).zip(b) {
                            *d = v + r + b;
                        }
                    }
                }
            }
        })
    });
    Ok(())
}

/// Where a call's activation rows live. A token is one int8 row, or with a residual ratio
/// ([`GroupedInput::Int8Pair`], [`GroupedInput::Int8PairAll`]) two: its codes and the codes of what
/// they leave over.
#[derive(Clone, Copy)]
enum RowLayout {
    /// Row `t` per token.
    Single,
    /// Rows `2t`, `2t + 1` side by side (a residual in every group): each weight load of the VNNI
    /// kernels serves both; on AMX-INT8 a batch of 8 fills one 16-row tile.
    Interleaved(f32),
    /// Residual in outlier groups only (ratio): codes in rows `0 .. T`, residuals in rows `T .. 2T`,
    /// run as a second view so the kernels see whole blocks of residual rows and skip the groups
    /// none of them needs (on VNNI also when the code rows run on AMX-INT8, as one 8-row tile of
    /// `dense_amx_int` for 8 tokens: the VNNI kernel skips a residual row per group it has no codes in).
    Blocks(f32),
}

impl RowLayout {
    fn of(residual: Option<f32>) -> RowLayout {
        match residual {
            None => RowLayout::Single,
            Some(r) if r > 0.0 => RowLayout::Blocks(r),
            Some(r) => RowLayout::Interleaved(r),
        }
    }

    fn act_rows(self, tokens: usize) -> usize {
        match self {
            RowLayout::Single => tokens,
            _ => 2 * tokens,
        }
    }

    /// The rows of token `t`'s codes and residual codes.
    fn rows_of(self, t: usize, tokens: usize) -> (usize, Option<usize>) {
        match self {
            RowLayout::Single => (t, None),
            RowLayout::Interleaved(_) => (2 * t, Some(2 * t + 1)),
            RowLayout::Blocks(_) => (t, Some(tokens + t)),
        }
    }

    fn ratio(self) -> f32 {
        match self {
            RowLayout::Blocks(r) | RowLayout::Interleaved(r) => r,
            RowLayout::Single => 0.0,
        }
    }
}

/// Converts the `tokens` rows of `x` (`cols` wide) into `act` as `kind`, laid out as `rows`, in
/// parallel when there are several blocks of rows and the conversion is more than a copy (or the
/// rows are made: one row per item then, as making one may cost more than converting it).
fn convert_rows(
    pool: &WorkerPool,
    act: &mut ActBuf,
    kind: ActKind,
    k_pad: usize,
    (x, cols): (Input<'_>, usize),
    tokens: usize,
    rows: RowLayout,
) {
    let writer = act.writer(kind, k_pad);
    let per_item = match x {
        Input::Rows(_) => CONVERT_ROWS,
        Input::Made(_) => 1,
    };
    let write = |t: usize, src: &[f32]| {
        // SAFETY: rows were reserved by the caller; each item writes its own rows.
        unsafe {
            match rows.rows_of(t, tokens) {
                (main, Some(rest)) => writer.write_row_split(main, rest, src, rows.ratio()),
                (main, None) => writer.write_row(main, src),
            }
        };
    };
    let convert = |first: usize| {
        for t in first..(first + per_item).min(tokens) {
            match x {
                Input::Rows(x) => write(t, &x[t * cols..(t + 1) * cols]),
                Input::Made(make) => MADE_ROW.with(|row| {
                    let mut row = row.borrow_mut();
                    row.clear();
                    row.resize(cols, 0.0);
                    make(t, &mut row[..]);
                    write(t, &row[..]);
                }),
            }
        }
    };
    let items = tokens.div_ceil(per_item);
    if items > 1 && (!matches!(kind, ActKind::F32) || matches!(x, Input::Made(_))) {
        let groups = pool.groups();
        let per_group: Vec<usize> = (0..groups)
            .map(|g| (items + groups - 1 - g) / groups)
            .collect();
        pool.run(&per_group, &|g, i, _| convert((i * groups + g) * per_item));
    } else {
        (0..items).for_each(|i| convert(i * per_item));
    }
}

#[cfg(test)]
#[path = "dense_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "dense_q4k_tests.rs"]
mod q4k_tests;
