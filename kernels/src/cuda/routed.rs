//! Routed experts of a small step (decode: a few rows) computed from the routing the router left on
//! the device (`routed.cu`), so that an MoE layer whose chosen experts are GPU-resident needs no host
//! round trip: no wait for the routing, no dispatch plan, no launch that depends on it. The resident
//! experts' weights are found through a per-layer device table ([`RoutedTable`]: gate_up and down
//! addresses per expert, 0 where the expert is not resident), which the caller rewrites between steps
//! when residency changes; CUDA graphs bake only the table's address.
//!
//! Each chosen expert's weights are read once per step however many rows chose it (rows grouped by
//! expert on the device), so the launches stay memory bound like cuBLAS's GEMMs of the host-planned
//! path; at decode they replace a dozen host launches and copies per layer by four launches.
//! A separate NVRTC module (~50 ms), compiled when the engine first uses it.
use super::ops::{ensure, grid, int, GateActivation};
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};
use half::bf16;

pub const SOURCE: &str = concat!(include_str!("common.cuh"), include_str!("routed.cu"));

/// Entry points of `routed.cu`.
pub const ENTRIES: [&str; 4] = [
    "routed_group",
    "routed_gate_up",
    "routed_down",
    "routed_combine",
];

/// Most (row, slot) pairs of one step (`routed_group`'s shared arrays).
pub const MAX_PAIRS: usize = 1024;
/// Warps per block of the GEMV kernels (`ROUTED_WARPS`): one output row each.
const WARPS: usize = 8;

/// The loaded kernels.
pub struct RoutedKernels {
    group: CudaFunction,
    gate_up: CudaFunction,
    down: CudaFunction,
    combine: CudaFunction,
}

/// One layer's routed experts as the device sees them: `[2 · experts]` addresses, gate_up `[2I, H]`
/// of expert e at e and down `[H, I]` at experts + e (bf16, row-major); 0: not resident.
pub struct RoutedTable {
    pub addrs: CudaSlice<u64>,
    pub experts: usize,
}

/// The step's shape: `rows` tokens choosing `top_k` experts each, hidden width `hidden`, expert
/// intermediate width `inter`.
#[derive(Debug, Clone, Copy)]
pub struct RoutedShape {
    pub rows: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub inter: usize,
}

/// Scratch of the routed experts (allocated once for the most pairs of a step; graphs bake them).
pub struct RoutedScratch {
    /// The pairs grouped by expert: `3 · pairs + 2` ints (see `routed.cu`).
    pub groups: CudaSlice<i32>,
    /// Activations `[pairs, inter]`.
    pub act: CudaSlice<bf16>,
    /// Each pair's expert output `[pairs, hidden]`.
    pub y: CudaSlice<f32>,
}

impl RoutedScratch {
    /// Scratch for `pairs` (row, slot) pairs of `hidden` / `inter` wide experts.
    pub fn new(
        dev: &GpuDevice,
        pairs: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Self, GpuError> {
        let s = &dev.stream;
        Ok(Self {
            groups: s.alloc_zeros::<i32>(3 * pairs + 2)?,
            act: s.alloc_zeros::<bf16>(pairs * inter)?,
            y: s.alloc_zeros::<f32>(pairs * hidden)?,
        })
    }
}

/// The expert widths the kernels take: 16-byte rows (multiples of 8 bf16 values).
pub fn supported_widths(hidden: usize, inter: usize) -> bool {
    hidden.is_multiple_of(8) && inter.is_multiple_of(8) && hidden > 0 && inter > 0
}

impl RoutedKernels {
    /// Compiles and loads the module for `dev`'s architecture.
    pub fn load(dev: &GpuDevice) -> Result<Self, GpuError> {
        let module = super::load_source(&dev.ctx, dev.capability, SOURCE)?;
        let f = |n: &str| module.load_function(n);
        Ok(Self {
            group: f("routed_group")?,
            gate_up: f("routed_gate_up")?,
            down: f("routed_down")?,
            combine: f("routed_combine")?,
        })
    }

    /// `x[r] += Σ_slot w[r, slot] · down(act(gate_up(xb[r])))` of expert `ids[r, slot]`, for the slots
    /// whose expert `table` holds (the others are left to whoever computes them), summed per row in
    /// slot order. `ids`, `w`: the router's `[rows, top_k]` output; `xb` the layer's normalised rows
    /// `[rows, hidden]` in bf16; `limit` the SwiGLU clamp. Trusts the table's addresses to be whole
    /// bf16 matrices of the shape's widths (the caller builds it from the resident experts).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        dev: &GpuDevice,
        shape: RoutedShape,
        (ids, w): (&CudaSlice<i32>, &CudaSlice<f32>),
        table: &RoutedTable,
        xb: &CudaSlice<bf16>,
        (act, limit): (GateActivation, Option<f32>),
        scratch: &mut RoutedScratch,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "routed_experts";
        let RoutedShape {
            rows,
            top_k,
            hidden,
            inter,
        } = shape;
        let pairs = rows * top_k;
        if pairs == 0 {
            return Ok(());
        }
        ensure(OP, pairs <= MAX_PAIRS, || {
            format!("{rows} rows × {top_k} experts exceed {MAX_PAIRS} pairs")
        })?;
        ensure(OP, supported_widths(hidden, inter), || {
            format!("widths {hidden} / {inter} are not multiples of 8")
        })?;
        let experts = table.experts;
        ensure(OP, experts > 0, || "a table of no experts".into())?;
        let (nk, k_i, e_i) = (
            int(OP, "pairs", pairs)?,
            int(OP, "top_k", top_k)?,
            int(OP, "experts", experts)?,
        );
        let (h_i, i_i) = (int(OP, "hidden", hidden)?, int(OP, "inter", inter)?);
        let idp = dev.input(OP, "ids", ids, pairs)?;
        let wp = dev.input(OP, "w", w, pairs)?;
        let tp = dev.input(OP, "table", &table.addrs, 2 * experts)?;
        let xbp = dev.input(OP, "xb", xb, rows * hidden)?;
        let gp = dev.output(OP, "groups", &mut scratch.groups, 3 * pairs + 2)?;
        let ap = dev.output(OP, "act", &mut scratch.act, pairs * inter)?;
        let yp = dev.output(OP, "y", &mut scratch.y, pairs * hidden)?;
        let xp = dev.output(OP, "x", x, rows * hidden)?;
        // the most expert groups a step can have: every pair its own expert, or every expert chosen
        let most = pairs.min(experts);
        let block = 32 * WARPS;
        let code = act.code();
        let lim = limit.unwrap_or(f32::INFINITY);
        let s = &dev.stream;

        let mut l = s.launch_builder(&self.group);
        l.arg(&idp).arg(&nk).arg(&e_i).arg(&tp).arg(&gp);
        // SAFETY: argument order and types as `routed_group`; nk ≤ MAX_PAIRS (its shared arrays); it
        // reads ids[..nk] and table[..experts] and writes groups[..3nk+2] (all checked above).
        unsafe { l.launch(grid((1, 1, 1), 256, 0)) }?;

        let mut l = s.launch_builder(&self.gate_up);
        l.arg(&gp).arg(&nk).arg(&k_i).arg(&tp).arg(&xbp);
        l.arg(&h_i).arg(&i_i).arg(&code).arg(&lim).arg(&ap);
        // SAFETY: as `routed_gate_up`; group u < groups[0] ≤ most; members are pairs < nk, so rows
        // p / k < rows of xb and act rows < pairs; weights are whole [2I, H] matrices (the table's
        // contract); hidden % 8 == 0 keeps the 16-byte loads inside each row.
        unsafe { l.launch(grid((inter.div_ceil(WARPS), most, 1), block, 0)) }?;

        let mut l = s.launch_builder(&self.down);
        l.arg(&gp).arg(&nk).arg(&tp).arg(&e_i).arg(&ap);
        l.arg(&h_i).arg(&i_i).arg(&yp);
        // SAFETY: as `routed_down`; the same groups; down weights are whole [H, I] matrices; inter % 8
        // == 0; writes y rows of member pairs (< pairs).
        unsafe { l.launch(grid((hidden.div_ceil(WARPS), most, 1), block, 0)) }?;

        let mut l = s.launch_builder(&self.combine);
        l.arg(&idp).arg(&wp).arg(&k_i).arg(&e_i).arg(&tp);
        l.arg(&yp).arg(&h_i).arg(&xp);
        // SAFETY: as `routed_combine`; block r < rows reads pairs r·k.. < nk of ids, w, y (the rows
        // that routed_down wrote for exactly the resident pairs it checks) and writes x row r.
        unsafe { l.launch(grid((rows, hidden.div_ceil(256), 1), 256, 0)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths() {
        assert!(supported_widths(2048, 768));
        assert!(supported_widths(48, 40));
        assert!(!supported_widths(2048, 44));
        assert!(!supported_widths(0, 8));
    }

    #[test]
    fn source_declares_every_entry() {
        for name in ENTRIES {
            assert!(
                SOURCE.contains(&format!("__global__ void {name}(")),
                "{name} missing from routed.cu"
            );
        }
    }
}
