//! Kernels of hybrid-attention models (`hybrid.cu`): KDA linear attention ([`super::linear_attention`]),
//! hyper-connections ([`super::hyper`]), the sparse-attention indexer and MLA over selected positions
//! ([`super::indexer`]). A separate NVRTC module, compiled only when a model needs it (~100 ms), and the
//! step layout those kernels share: [`SegmentIndex`] (which rows belong to which sequence) and
//! [`StateTable`] (each sequence's recurrent-state buffer).
use super::{GpuDevice, GpuError};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;
use std::marker::PhantomData;

pub const SOURCE: &str = concat!(include_str!("common.cuh"), include_str!("hybrid.cu"));

/// Entry points of `hybrid.cu`, by name.
pub const ENTRIES: [&str; 17] = [
    "kda_conv",
    "kda_conv_tail",
    "kda_prepare",
    "kda_recurrent",
    "kda_chunk_prep",
    "kda_chunk_scan",
    "gated_rms_norm",
    "hc_broadcast",
    "hc_mean",
    "hc_collapse",
    "hc_expand",
    "idx_layer_norm",
    "idx_write_rows",
    "idx_pool_complete",
    "idx_scores",
    "idx_topk",
    "mla_attention_selected",
];

/// The loaded kernels; launch them through the typed methods of the sibling modules.
pub struct HybridKernels {
    pub(super) kda_conv: CudaFunction,
    pub(super) kda_conv_tail: CudaFunction,
    pub(super) kda_prepare: CudaFunction,
    pub(super) kda_recurrent: CudaFunction,
    pub(super) kda_chunk_prep: CudaFunction,
    pub(super) kda_chunk_scan: CudaFunction,
    pub(super) gated_rms_norm: CudaFunction,
    pub(super) hc_broadcast: CudaFunction,
    pub(super) hc_mean: CudaFunction,
    pub(super) hc_collapse: CudaFunction,
    pub(super) hc_expand: CudaFunction,
    pub(super) idx_layer_norm: CudaFunction,
    pub(super) idx_write_rows: CudaFunction,
    pub(super) idx_pool_complete: CudaFunction,
    pub(super) idx_scores: CudaFunction,
    pub(super) idx_topk: CudaFunction,
    pub(super) mla_attention_selected: CudaFunction,
}

impl HybridKernels {
    /// Compiles and loads the module for `dev`'s architecture.
    pub fn load(dev: &GpuDevice) -> Result<Self, GpuError> {
        let module = super::load_source(&dev.ctx, dev.capability, SOURCE)?;
        let f = |n: &str| module.load_function(n);
        Ok(Self {
            kda_conv: f("kda_conv")?,
            kda_conv_tail: f("kda_conv_tail")?,
            kda_prepare: f("kda_prepare")?,
            kda_recurrent: f("kda_recurrent")?,
            kda_chunk_prep: f("kda_chunk_prep")?,
            kda_chunk_scan: f("kda_chunk_scan")?,
            gated_rms_norm: f("gated_rms_norm")?,
            hc_broadcast: f("hc_broadcast")?,
            hc_mean: f("hc_mean")?,
            hc_collapse: f("hc_collapse")?,
            hc_expand: f("hc_expand")?,
            idx_layer_norm: f("idx_layer_norm")?,
            idx_write_rows: f("idx_write_rows")?,
            idx_pool_complete: f("idx_pool_complete")?,
            idx_scores: f("idx_scores")?,
            idx_topk: f("idx_topk")?,
            mla_attention_selected: f("mla_attention_selected")?,
        })
    }
}

/// Fails with a shape error unless `ok`.
pub(super) fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::Shape(what()))
    }
}

/// `grid` blocks of `block` threads with `smem` bytes of dynamic shared memory.
pub(super) fn cfg(grid: (usize, usize, usize), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

impl GpuDevice {
    /// `y[..n]` ← `x[..n]` rounded to bf16 (GEMM inputs from f32 intermediates).
    pub fn round_to_bf16(
        &self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<bf16>,
        n: usize,
    ) -> Result<(), GpuError> {
        check(x.len() >= n && y.len() >= n, || {
            format!(
                "round_to_bf16: {n} values into buffers of {} and {}",
                x.len(),
                y.len()
            )
        })?;
        if n == 0 {
            return Ok(());
        }
        let mut l = self.stream.launch_builder(&self.k.f32_to_bf16);
        l.arg(x).arg(&n).arg(y);
        // SAFETY: both buffers hold n elements (checked above).
        unsafe { l.launch(super::ops::per_elem(n)) }?;
        Ok(())
    }
}

/// Which rows of a step belong to which sequence (segments of consecutive rows), on the device.
///
/// The device arrays are allocated once for `capacity` rows and rewritten by [`SegmentIndex::set`] before
/// each step, so kernels captured into a CUDA graph keep reading the current step's layout.
pub struct SegmentIndex {
    pub rows: usize,
    pub segments: usize,
    /// Longest segment (rows).
    pub max_len: usize,
    pub capacity: usize,
    pub(super) row0: CudaSlice<i32>,
    pub(super) len: CudaSlice<i32>,
    pub(super) seg_of_row: CudaSlice<i32>,
}

impl SegmentIndex {
    /// `lens[s]` rows per segment, in row order (segment s starts where s - 1 ends); every segment has
    /// at least one row.
    pub fn new(dev: &GpuDevice, lens: &[usize]) -> Result<Self, GpuError> {
        let mut seg = Self::with_capacity(dev, lens.iter().sum::<usize>().max(1))?;
        seg.set(dev, lens)?;
        Ok(seg)
    }

    /// Device arrays for steps of up to `capacity` rows (and as many segments); empty until [`Self::set`].
    pub fn with_capacity(dev: &GpuDevice, capacity: usize) -> Result<Self, GpuError> {
        let s = &dev.stream;
        let n = capacity.max(1);
        Ok(Self {
            rows: 0,
            segments: 0,
            max_len: 0,
            capacity: n,
            row0: s.alloc_zeros(n)?,
            len: s.alloc_zeros(n)?,
            seg_of_row: s.alloc_zeros(n)?,
        })
    }

    /// Rewrites the layout for a step of `lens[s]` rows per segment (stream-ordered copies).
    pub fn set(&mut self, dev: &GpuDevice, lens: &[usize]) -> Result<(), GpuError> {
        check(!lens.is_empty() && lens.iter().all(|&l| l > 0), || {
            format!("segments need at least one row each: {lens:?}")
        })?;
        let rows: usize = lens.iter().sum();
        check(rows <= self.capacity, || {
            format!(
                "a step of {rows} rows in a segment index for {}",
                self.capacity
            )
        })?;
        let mut row0 = Vec::with_capacity(lens.len());
        let mut seg_of_row = Vec::with_capacity(rows);
        for (s, &l) in lens.iter().enumerate() {
            row0.push(seg_of_row.len() as i32);
            seg_of_row.extend(std::iter::repeat_n(s as i32, l));
        }
        let len: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let s = &dev.stream;
        s.memcpy_htod(&row0, &mut self.row0.slice_mut(..lens.len()))?;
        s.memcpy_htod(&len, &mut self.len.slice_mut(..lens.len()))?;
        s.memcpy_htod(&seg_of_row, &mut self.seg_of_row.slice_mut(..rows))?;
        self.rows = rows;
        self.segments = lens.len();
        self.max_len = lens.iter().copied().max().unwrap_or(0);
        Ok(())
    }

    /// Each row's segment (its sequence's row of the block tables).
    pub fn seg_of_row(&self) -> &CudaSlice<i32> {
        &self.seg_of_row
    }
}

/// The recurrent-state buffers of a step's sequences (one per segment, in segment order), as a device
/// table of addresses written into a table buffer the caller keeps (a CUDA graph bakes the table's
/// address; the table holds the current step's states). It borrows every state buffer mutably for as
/// long as it lives, so nothing else can read, write or free them while kernels launched with the
/// table may still run (the owner keeps the borrow until the step's final synchronisation). The table
/// buffer itself is only read by kernels, in stream order with its writes and its free.
pub struct StateTable<'a> {
    /// Device address of the table.
    pub(super) addrs: u64,
    /// Floats every buffer holds at least.
    pub per_sequence: usize,
    pub segments: usize,
    _borrow: PhantomData<&'a mut CudaSlice<f32>>,
}

impl<'a> StateTable<'a> {
    /// Writes the buffers' addresses into `table`; fails unless every buffer holds at least
    /// `per_sequence` floats and the table has room for them.
    pub fn new(
        dev: &GpuDevice,
        table: &mut CudaSlice<u64>,
        buffers: Vec<&'a mut CudaSlice<f32>>,
        per_sequence: usize,
    ) -> Result<Self, GpuError> {
        check(buffers.iter().all(|b| b.len() >= per_sequence), || {
            format!("a recurrent-state buffer holds fewer than {per_sequence} floats")
        })?;
        check(buffers.len() <= table.len(), || {
            format!(
                "{} recurrent states for a table of {}",
                buffers.len(),
                table.len()
            )
        })?;
        let addrs: Vec<u64> = buffers.iter().map(|b| dev.addr(&**b)).collect();
        dev.stream
            .memcpy_htod(&addrs, &mut table.slice_mut(..addrs.len()))?;
        Ok(Self {
            addrs: dev.addr(&*table),
            per_sequence,
            segments: buffers.len(),
            _borrow: PhantomData,
        })
    }

    /// Fails unless floats `offset .. offset + len` lie in every buffer and the table has a buffer per
    /// segment of `seg`.
    pub(super) fn check_part(
        &self,
        seg: &SegmentIndex,
        offset: usize,
        len: usize,
    ) -> Result<(), GpuError> {
        check(
            self.segments == seg.segments && offset + len <= self.per_sequence,
            || {
                format!(
                    "state table of {} buffers × {} floats, step of {} segments wants floats {offset}..{}",
                    self.segments,
                    self.per_sequence,
                    seg.segments,
                    offset + len
                )
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_declares_every_entry() {
        for name in ENTRIES {
            assert!(
                SOURCE.contains(&format!("__global__ void {name}(")),
                "{name} missing from hybrid.cu"
            );
        }
    }
}
