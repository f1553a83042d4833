//! MoE ops: router top-k, gathering and scattering expert rows, gated activations, shared-expert gate,
//! and unpacking the CPU kernels' packed experts for layerwise prefill.
use super::{ensure, grid, grid_dim, input_on, int, output_on, per_elem, rows_cols, smem};
use crate::cpu::moe::{PackedGeometry, WeightFormat};
use crate::cuda::{GpuDevice, GpuError};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

/// How a router turns logits into top-k experts and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterKind {
    /// Softmax over all experts, top-k of it; weights renormalised over the k when `renormalize`
    /// (Mixtral, Qwen-MoE).
    Softmax { renormalize: bool },
    /// Sigmoid scores; selection on score + correction bias among the best `topk_group` of `n_group`
    /// expert groups (group score: its top-2 biased scores); weights are the unbiased scores,
    /// renormalised when asked, times `scaling` (DeepSeek-V3, GLM-4.5).
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
        scaling: f32,
    },
}

/// `router_topk`'s (kind, renorm, n_group, topk_group, scaling) arguments.
type RouterArgs = (i32, i32, i32, i32, f32);

/// The router kernels keep kept groups in a 64-bit mask.
const MAX_GROUPS: usize = 64;
/// `router_topk`'s block: one per token, this many threads (its final renormalisation uses thread j
/// for choice j, so k ≤ this).
const ROUTER_THREADS: usize = 128;
/// `router_topk_serial`: one thread per token, in blocks of this many.
const SERIAL_ROUTER_THREADS: usize = 64;

impl RouterKind {
    /// The kernel's arguments, after checking the kind fits `experts` and `k`.
    pub(super) fn args(&self, op: &str, experts: usize, k: usize) -> Result<RouterArgs, GpuError> {
        ensure(op, k >= 1 && k <= experts && k <= ROUTER_THREADS, || {
            format!("top-{k} of {experts} experts")
        })?;
        Ok(match *self {
            RouterKind::Softmax { renormalize } => (0, renormalize as i32, 1, 1, 1.0),
            RouterKind::SigmoidGrouped {
                n_group,
                topk_group,
                renormalize,
                scaling,
            } => {
                ensure(
                    op,
                    (1..=MAX_GROUPS).contains(&n_group)
                        && experts.is_multiple_of(n_group)
                        && (1..=n_group).contains(&topk_group),
                    || format!("{topk_group} of {n_group} groups over {experts} experts"),
                )?;
                (
                    1,
                    renormalize as i32,
                    n_group as i32,
                    topk_group as i32,
                    scaling,
                )
            }
        })
    }
}

/// The gate activation of gated MLPs: `out = f(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// SwiGLU.
    Silu,
    GeluTanh,
    /// ReGLU (SmallThinker).
    Relu,
}

impl GateActivation {
    /// `gated_mul`'s `act` argument.
    pub(crate) fn code(self) -> i32 {
        match self {
            GateActivation::Silu => 0,
            GateActivation::GeluTanh => 1,
            GateActivation::Relu => 2,
        }
    }
}

/// Packed expert formats `unpack_experts` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnpackFormat {
    Bf16,
    /// E4M3 bytes with 128×128 block scales.
    Fp8Block,
    /// int8 with one scale per row.
    Int8,
    /// int4 codes with an f16 scale per `group` inputs of a row ((u − 8)·d: GGUF Q4_0,
    /// `--expert-dtype int4`).
    Int4 {
        group: usize,
    },
    /// int4 codes with an f16 scale and minimum per `group` inputs (u·d + m: GGUF Q4_1 / Q4_K).
    Int4Min {
        group: usize,
    },
}

impl UnpackFormat {
    /// The unpacker for packed experts of `format`; `None` for formats it does not read (f16,
    /// grouped int8: those layers compute their DRAM experts on the CPU in long prompts too).
    pub fn of(format: WeightFormat) -> Option<UnpackFormat> {
        match format {
            WeightFormat::Bf16 => Some(UnpackFormat::Bf16),
            WeightFormat::Fp8Block => Some(UnpackFormat::Fp8Block),
            WeightFormat::Int8 => Some(UnpackFormat::Int8),
            WeightFormat::Int4 { group } => Some(UnpackFormat::Int4 { group }),
            WeightFormat::Int4Min { group } => Some(UnpackFormat::Int4Min { group }),
            // f16 and the grouped int8 formats (GGUF Q8_0 / Q5_K / Q6_K blocks)
            _ => None,
        }
    }

    /// The kernel's `fmt` and `group` (1 where the format has no groups).
    fn code(self) -> (i32, usize) {
        match self {
            UnpackFormat::Bf16 => (0, 1),
            UnpackFormat::Fp8Block => (1, 1),
            UnpackFormat::Int8 => (2, 1),
            UnpackFormat::Int4 { group } => (3, group),
            UnpackFormat::Int4Min { group } => (4, group),
        }
    }
}

/// Which router kernel runs: the production one (a block per token) or its serial reference.
#[derive(Clone, Copy)]
enum RouterImpl {
    BlockPerToken,
    ThreadPerToken,
}

impl GpuDevice {
    /// Top-`k` experts and their weights for each of `tokens` rows of f32 `logits` (`[tokens,
    /// experts]`) into `ids` and `weights` (`[tokens, k]`), by `kind`; `bias` is the selection-only
    /// correction bias of sigmoid routers. One block of 128 threads per token.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk(
        &self,
        logits: &impl DevicePtr<f32>,
        (tokens, experts, k): (usize, usize, usize),
        kind: &RouterKind,
        bias: Option<&CudaSlice<f32>>,
        ids: &mut impl DevicePtrMut<i32>,
        weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        self.router(
            RouterImpl::BlockPerToken,
            logits,
            (tokens, experts, k),
            kind,
            bias,
            ids,
            weights,
        )
    }

    /// [`GpuDevice::router_topk`] computed by one thread per token: the simpler reference the GPU
    /// tests compare the production kernel with.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk_serial(
        &self,
        logits: &impl DevicePtr<f32>,
        (tokens, experts, k): (usize, usize, usize),
        kind: &RouterKind,
        bias: Option<&CudaSlice<f32>>,
        ids: &mut impl DevicePtrMut<i32>,
        weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        self.router(
            RouterImpl::ThreadPerToken,
            logits,
            (tokens, experts, k),
            kind,
            bias,
            ids,
            weights,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn router(
        &self,
        which: RouterImpl,
        logits: &impl DevicePtr<f32>,
        (tokens, experts, k): (usize, usize, usize),
        kind: &RouterKind,
        bias: Option<&CudaSlice<f32>>,
        ids: &mut impl DevicePtrMut<i32>,
        weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "router_topk";
        let Some((n_i, e_i)) = rows_cols(OP, ("tokens", "experts"), (tokens, experts))? else {
            return Ok(());
        };
        let (kind_i, renorm, n_group, topk_group, scaling) = kind.args(OP, experts, k)?;
        let k_i = int(OP, "k", k)?;
        let lp = self.input(OP, "logits", logits, tokens * experts)?;
        let bp = self.optional(OP, "bias", bias, experts)?;
        let ip = self.output(OP, "ids", ids, tokens * k)?;
        let wp = self.output(OP, "weights", weights, tokens * k)?;
        let (f, cfg) = match which {
            RouterImpl::BlockPerToken => (
                &self.k.router_topk,
                // selection scores and pre-renormalisation weights of every expert
                grid((tokens, 1, 1), ROUTER_THREADS, smem(OP, 2 * experts * 4)?),
            ),
            RouterImpl::ThreadPerToken => (
                &self.k.router_topk_serial,
                grid(
                    (tokens.div_ceil(SERIAL_ROUTER_THREADS), 1, 1),
                    SERIAL_ROUTER_THREADS,
                    0,
                ),
            ),
        };
        let mut l = self.stream.launch_builder(f);
        l.arg(&lp)
            .arg(&n_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&kind_i)
            .arg(&renorm);
        l.arg(&bp)
            .arg(&n_group)
            .arg(&topk_group)
            .arg(&scaling)
            .arg(&ip)
            .arg(&wp);
        // SAFETY: argument order and types as kernels.cu's `router_topk` / `router_topk_serial` (same
        // signature); token t reads its logits row and the bias (checked, or null) and writes its k
        // ids and weights (checked); the kind's groups fit the 64-bit mask and divide the experts.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// Rows `idx` (trusted: each < the rows of `src`) of bf16 `src` (`[*, dim]`) into `dst`
    /// (`[idx.len(), dim]`); `rows` rows.
    pub fn gather_rows(
        &self,
        src: &impl DevicePtr<bf16>,
        idx: &impl DevicePtr<i32>,
        (rows, dim): (usize, usize),
        dst: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "gather_rows";
        let Some((_, dim_i)) = rows_cols(OP, ("rows", "dim"), (rows, dim))? else {
            return Ok(());
        };
        let sp = self.input(OP, "src", src, dim)?;
        let ip = self.input(OP, "idx", idx, rows)?;
        let dp = self.output(OP, "dst", dst, rows * dim)?;
        let mut l = self.stream.launch_builder(&self.k.gather_rows);
        l.arg(&sp).arg(&ip).arg(&dim_i).arg(&dp);
        // SAFETY: argument order and types as kernels.cu's `gather_rows`; block r reads idx[r]
        // (checked) and the src row it names (trusted), and writes row r of dst (checked).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `out[t] += Σ w[r] · y[r]` over the expert rows r of token t, `token_rows[offsets[t] ..
    /// offsets[t + 1]]` (CSR; trusted: offsets ascending within `token_rows`, rows < `y`'s rows), in
    /// that fixed order (deterministic, no atomics). One block per token.
    #[allow(clippy::too_many_arguments)]
    pub fn scatter_add_weighted(
        &self,
        y: &impl DevicePtr<f32>,
        offsets: &impl DevicePtr<i32>,
        token_rows: &impl DevicePtr<i32>,
        w: &impl DevicePtr<f32>,
        (tokens, expert_rows, dim): (usize, usize, usize),
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "scatter_add_weighted";
        let Some((_, dim_i)) = rows_cols(OP, ("tokens", "dim"), (tokens, dim))? else {
            return Ok(());
        };
        let yp = self.input(OP, "y", y, expert_rows * dim)?;
        let op = self.input(OP, "offsets", offsets, tokens + 1)?;
        let rp = self.input(OP, "token_rows", token_rows, expert_rows)?;
        let wp = self.input(OP, "w", w, expert_rows)?;
        let outp = self.output(OP, "out", out, tokens * dim)?;
        let mut l = self.stream.launch_builder(&self.k.scatter_add_weighted);
        l.arg(&yp).arg(&op).arg(&rp).arg(&wp).arg(&dim_i).arg(&outp);
        // SAFETY: argument order and types as kernels.cu's `scatter_add_weighted`; block t reads
        // offsets[t..=t+1] (checked), the rows they name (trusted CSR, see above) and adds into row t
        // of out (checked).
        unsafe { l.launch(grid((tokens, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `y[t] *= sigmoid(gate_w · x[t])` for `rows` rows of `dim` (Qwen2-MoE's shared-expert gate).
    pub fn sigmoid_gate_rows(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        gate_w: &impl DevicePtr<f32>,
        (rows, dim): (usize, usize),
    ) -> Result<(), GpuError> {
        const OP: &str = "sigmoid_gate_rows";
        let Some((_, dim_i)) = rows_cols(OP, ("rows", "dim"), (rows, dim))? else {
            return Ok(());
        };
        let yp = self.output(OP, "y", y, rows * dim)?;
        let xp = self.input(OP, "x", x, rows * dim)?;
        let gp = self.input(OP, "gate_w", gate_w, dim)?;
        let mut l = self.stream.launch_builder(&self.k.sigmoid_gate_rows);
        l.arg(&yp).arg(&xp).arg(&gp).arg(&dim_i);
        // SAFETY: argument order and types as kernels.cu's `sigmoid_gate_rows`; block t reads row t of
        // x and gate_w and scales row t of y (all checked).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `out = f(gate) · up` to bf16 for `rows` rows of `gate_up` (`[rows, 2·inter]`, gate first),
    /// after GLM's SwiGLU clamp when `limit` is set (gate ≤ limit, up within ±limit).
    pub fn gated_mul(
        &self,
        gate_up: &impl DevicePtr<f32>,
        (rows, inter): (usize, usize),
        act: GateActivation,
        limit: Option<f32>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "gated_mul";
        let Some((rows_i, inter_i)) = rows_cols(OP, ("rows", "inter"), (rows, inter))? else {
            return Ok(());
        };
        if inter == 0 {
            return Ok(());
        }
        // one thread per output element
        int(OP, "rows·inter", rows * inter)?;
        // No clamp is an infinite limit.
        let lim = limit.unwrap_or(f32::INFINITY);
        let code = act.code();
        let gp = self.input(OP, "gate_up", gate_up, rows * 2 * inter)?;
        let outp = self.output(OP, "out", out, rows * inter)?;
        let mut l = self.stream.launch_builder(&self.k.gated_mul);
        l.arg(&gp)
            .arg(&inter_i)
            .arg(&rows_i)
            .arg(&code)
            .arg(&lim)
            .arg(&outp);
        // SAFETY: argument order and types as kernels.cu's `gated_mul`; thread i < rows·inter (the
        // kernel returns beyond) reads gate and up of its element and writes out[i] (checked).
        unsafe { l.launch(per_elem(rows * inter)) }?;
        Ok(())
    }

    /// `count` packed experts laid out back to back in `packed` (`g.expert_bytes` each, as the CPU
    /// kernels pack them) → dense bf16 in `dense` (`g.dense_elems()` each: gate_up `[2I, H]` then down
    /// `[H, I]`), on the engine stream.
    pub fn unpack_experts(
        &self,
        g: &PackedGeometry,
        packed: &impl DevicePtr<u8>,
        count: usize,
        dense: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        self.expert_unpacker()
            .unpack_on(&self.stream, g, packed, count, dense)
    }

    /// `unpack_experts` for another stream (live re-placement unpacks on a side stream).
    pub fn expert_unpacker(&self) -> ExpertUnpacker {
        ExpertUnpacker(self.k.unpack_experts.clone())
    }
}

/// The `unpack_experts` kernel, to launch on a stream of the caller's choice.
#[derive(Clone)]
pub struct ExpertUnpacker(CudaFunction);

impl ExpertUnpacker {
    /// As [`GpuDevice::unpack_experts`], on `stream`.
    pub fn unpack_on(
        &self,
        stream: &CudaStream,
        g: &PackedGeometry,
        packed: &impl DevicePtr<u8>,
        count: usize,
        dense: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "unpack_experts";
        let fmt = UnpackFormat::of(g.format).ok_or_else(|| {
            GpuError::Shape(format!(
                "{OP}: {:?} experts are not unpacked on the GPU",
                g.format
            ))
        })?;
        if count == 0 {
            return Ok(());
        }
        grid_dim(OP, "count", count)?;
        let (fmt, group) = fmt.code();
        let (eb, group, inter, hidden) = (
            g.expert_bytes as i64,
            int(OP, "group", group)?,
            int(OP, "inter", g.inter)?,
            int(OP, "hidden", g.hidden)?,
        );
        let (gkt, gwb, gb) = (
            int(OP, "gate k_tiles", g.gate.k_tiles)?,
            g.gate.w_bytes as i64,
            g.gate.bytes as i64,
        );
        let (dkt, dwb) = (
            int(OP, "down k_tiles", g.down.k_tiles)?,
            g.down.w_bytes as i64,
        );
        let pp = input_on(stream, (OP, "packed"), packed, count * g.expert_bytes)?;
        let dp = output_on(stream, (OP, "dense"), dense, count * g.dense_elems())?;
        let mut l = stream.launch_builder(&self.0);
        l.arg(&pp)
            .arg(&eb)
            .arg(&fmt)
            .arg(&group)
            .arg(&inter)
            .arg(&hidden)
            .arg(&gkt)
            .arg(&gwb);
        l.arg(&gb).arg(&dkt).arg(&dwb).arg(&dp);
        // SAFETY: argument order and types as kernels.cu's `unpack_experts`; block (x, e, m) reads
        // matrix m of packed expert e < count (checked: count · expert_bytes, offsets from the same
        // geometry that packed them) and writes its dense rows (checked: count · dense_elems).
        unsafe { l.launch(grid((256, count, 3), 256, 0)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_kinds_map_to_the_kernel_codes() {
        let softmax = RouterKind::Softmax { renormalize: true };
        assert_eq!(softmax.args("r", 128, 8).unwrap(), (0, 1, 1, 1, 1.0));
        let grouped = RouterKind::SigmoidGrouped {
            n_group: 8,
            topk_group: 4,
            renormalize: false,
            scaling: 2.5,
        };
        assert_eq!(grouped.args("r", 256, 8).unwrap(), (1, 0, 8, 4, 2.5));
    }

    #[test]
    fn router_shapes_the_kernels_cannot_take_are_refused() {
        let g = |n_group, topk_group| RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            renormalize: true,
            scaling: 1.0,
        };
        assert!(
            g(65, 1).args("r", 130, 8).is_err(),
            "65 groups: mask overflow"
        );
        assert!(
            g(3, 1).args("r", 128, 8).is_err(),
            "groups must divide experts"
        );
        assert!(
            g(8, 9).args("r", 256, 8).is_err(),
            "more kept groups than groups"
        );
        assert!(g(8, 0).args("r", 256, 8).is_err());
        let s = RouterKind::Softmax { renormalize: false };
        assert!(s.args("r", 4, 5).is_err(), "k above experts");
        assert!(s.args("r", 512, 129).is_err(), "k above the block");
        assert!(s.args("r", 4, 0).is_err());
    }

    #[test]
    fn kinds_map_to_kernel_codes() {
        assert_eq!(
            [
                GateActivation::Silu,
                GateActivation::GeluTanh,
                GateActivation::Relu
            ]
            .map(|a| a.code()),
            [0, 1, 2]
        );
        assert_eq!(
            UnpackFormat::of(WeightFormat::Bf16).map(|f| f.code()),
            Some((0, 1))
        );
        assert_eq!(
            UnpackFormat::of(WeightFormat::Fp8Block).map(|f| f.code()),
            Some((1, 1))
        );
        assert_eq!(
            UnpackFormat::of(WeightFormat::Int8).map(|f| f.code()),
            Some((2, 1))
        );
        assert_eq!(
            UnpackFormat::of(WeightFormat::Int4 { group: 32 }).map(|f| f.code()),
            Some((3, 32))
        );
        assert_eq!(
            UnpackFormat::of(WeightFormat::Int4Min { group: 32 }).map(|f| f.code()),
            Some((4, 32))
        );
        assert_eq!(
            UnpackFormat::of(WeightFormat::Int8Group { group: 32 }),
            None
        );
        assert_eq!(UnpackFormat::of(WeightFormat::F16), None);
    }
}
