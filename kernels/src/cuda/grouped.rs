//! Grouped expert GEMMs: every item of [`GpuDevice::gemm_bf16_items`] in ONE launch of
//! `grouped_gemm.cu` (bf16 in, f32 out), whatever its row count, instead of one cuBLAS batched call per
//! distinct row count. In a long prompt every expert has its own row count, so the batched path costs
//! one launch (and one heuristic lookup per new shape) per expert, and the host's launches hold the GPU
//! back (docs/PERF.md, the long-prefill stream profile). cuBLAS's own grouped call
//! (`cublasGemmGroupedBatchedEx`) takes bf16 inputs only with bf16 outputs, which would round the
//! gate/up and down outputs that the batched path keeps in f32.
use super::ops::grid;
use super::{GemmItem, GpuDevice, GpuError};
use cudarc::driver::{CudaSlice, PushKernelArg};

/// Output rows and columns of one block's tile (`GG_BM`, `GG_BN` in `grouped_gemm.cu`).
const TILE_ROWS: usize = 64;
const TILE_COLS: usize = 64;
/// Threads per block.
const THREADS: usize = 128;

/// Table entries for up to `items` items of `rows` rows in all: four per item (weights, inputs,
/// outputs, rows) and one per 64-row tile (at most one partial tile per item).
pub(super) fn table_len(items: usize, rows: usize) -> usize {
    4 * items + rows / TILE_ROWS + items
}

/// Whether the grouped kernel takes these items: k a multiple of 8 and m even (its 16-byte loads and
/// 8-byte stores), every address 16-byte aligned, sizes within its 32-bit indices.
pub(super) fn takes(items: &[GemmItem], order: &[usize], m: usize, k: usize) -> bool {
    let fits = |v: usize| i32::try_from(v).is_ok();
    k.is_multiple_of(8)
        && m.is_multiple_of(2)
        && fits(m)
        && fits(k)
        && order.iter().all(|&i| {
            let g = &items[i];
            (g.x | g.w | g.y).is_multiple_of(16) && fits(g.rows)
        })
}

/// The grouped kernel's table for the items in `order`: weights, inputs, outputs, rows, then one
/// `item << 32 | first row` entry per 64-row tile of each item's output (item indices into `order`).
pub(super) fn table(items: &[GemmItem], order: &[usize]) -> Vec<u64> {
    let mut t: Vec<u64> = [
        |g: &GemmItem| g.w,
        |g: &GemmItem| g.x,
        |g: &GemmItem| g.y,
        |g: &GemmItem| g.rows as u64,
    ]
    .iter()
    .flat_map(|field| order.iter().map(|&i| field(&items[i])))
    .collect();
    for (j, &i) in order.iter().enumerate() {
        t.extend(
            (0..items[i].rows)
                .step_by(TILE_ROWS)
                .map(|r| (j as u64) << 32 | r as u64),
        );
    }
    t
}

impl GpuDevice {
    /// `y_i = x_i · w_iᵀ` for the items in `order` as one launch of `grouped_gemm_bf16`.
    ///
    /// # Safety
    /// As [`GpuDevice::gemm_bf16_items`]; [`takes`] holds for the items.
    pub(super) unsafe fn gemm_bf16_grouped(
        &self,
        items: &[GemmItem],
        order: &[usize],
        (m, k): (usize, usize),
        table: &mut CudaSlice<u64>,
    ) -> Result<(), GpuError> {
        const OP: &str = "grouped_gemm_bf16";
        let host = self::table(items, order);
        let n = order.len();
        let tiles = host.len() - 4 * n;
        let base = self.output(OP, "table", table, host.len())?;
        // from pageable memory: the driver stages the bytes before returning, so `host` may go
        self.stream
            .memcpy_htod(&host, &mut table.slice_mut(..host.len()))?;
        super::ops::grid_dim(OP, "column tiles", m.div_ceil(TILE_COLS))?;
        let (n_i, m_i, k_i) = (n as i32, m as i32, k as i32);
        let mut l = self.stream.launch_builder(&self.k.grouped_gemm_bf16);
        l.arg(&base).arg(&n_i).arg(&m_i).arg(&k_i);
        // SAFETY: argument order and types as `grouped_gemm_bf16`; the table just uploaded names
        // `n` items and `tiles` tiles, every tile inside its item's rows; each item's buffers cover
        // its rows (the caller's contract), and `takes` checked the kernel's alignment needs.
        unsafe { l.launch(grid((tiles, m.div_ceil(TILE_COLS), 1), THREADS, 0)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn it(rows: usize, at: u64) -> GemmItem {
        GemmItem {
            x: at,
            w: at + 16,
            y: at + 32,
            rows,
        }
    }

    #[test]
    fn the_table_names_every_tile_of_every_item() {
        let items = [it(5, 0), it(130, 1 << 20), it(64, 2 << 20)];
        let order = [0, 2, 1];
        let t = table(&items, &order);
        assert_eq!(t.len(), 4 * 3 + 1 + 1 + 3);
        assert!(t.len() <= table_len(3, 5 + 130 + 64));
        assert_eq!(
            &t[..3],
            &[16, (2 << 20) + 16, (1 << 20) + 16],
            "weights in order"
        );
        assert_eq!(&t[9..12], &[5, 64, 130], "rows in order");
        // item 0 (5 rows): one tile; item 1 in order (64 rows): one; item 2 (130 rows): three
        assert_eq!(
            &t[12..],
            &[0, 1 << 32, 2 << 32, (2 << 32) | 64, (2 << 32) | 128]
        );
    }

    #[test]
    fn shapes_and_addresses_the_kernel_takes() {
        let items = [it(3, 0), it(7, 4096)];
        assert!(takes(&items, &[0, 1], 96, 160));
        assert!(!takes(&items, &[0, 1], 96, 164), "k not a multiple of 8");
        assert!(!takes(&items, &[0, 1], 95, 160), "odd m");
        let skewed = [it(3, 8)];
        assert!(
            !takes(&skewed, &[0], 96, 160),
            "addresses not 16-byte aligned"
        );
    }
}
