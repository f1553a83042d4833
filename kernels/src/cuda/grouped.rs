//! Grouped expert GEMMs: every item of [`GpuDevice::gemm_bf16_items`] in ONE cuBLAS call
//! (`cublasGemmGroupedBatchedEx`, cuBLAS ≥ 12.5), whatever its row count, instead of one batched call per
//! distinct row count. In a long prompt every expert has its own row count, so the batched path costs one
//! launch (and one heuristic lookup per new shape) per expert, and the host's launches hold the GPU back
//! (docs/PERF.md, the long-prefill stream profile). Which of the two runs is chosen by measurement per
//! use (`gemm_path`). If cuBLAS refuses the call (an older library, or a type combination it does not
//! group), the first refusal is logged and every later call takes the batched path.
use super::{GemmItem, GpuDevice, GpuError};
use cudarc::cublas::sys as cublas_sys;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once cuBLAS refused a grouped call: later calls take the batched path.
static REFUSED: AtomicBool = AtomicBool::new(false);

/// Whether cuBLAS refused a grouped call in this process (later calls take the batched path).
pub fn grouped_gemm_refused() -> bool {
    REFUSED.load(Ordering::Relaxed)
}

/// Records a refusal (logged once).
pub(super) fn refused(e: &GpuError) {
    if !REFUSED.swap(true, Ordering::Relaxed) {
        eprintln!(
            "grouped expert GEMM refused by cuBLAS ({e}); using one batched call per row count"
        );
    }
}

/// The groups of items sharing a row count, in `order` (sorted by rows): (rows, count) each.
pub(super) fn row_groups(items: &[GemmItem], order: &[usize]) -> Vec<(usize, usize)> {
    let mut groups: Vec<(usize, usize)> = Vec::new();
    for &i in order {
        match groups.last_mut() {
            Some((rows, count)) if *rows == items[i].rows => *count += 1,
            _ => groups.push((items[i].rows, 1)),
        }
    }
    groups
}

impl GpuDevice {
    /// `y_i = x_i · w_iᵀ` for the items in `order` as one grouped call; `table` (device address) holds
    /// the weights', inputs' and outputs' pointers in `order`, as `gemm_bf16_items` uploaded them.
    ///
    /// # Safety
    /// As [`GpuDevice::gemm_bf16_items`]; `table` holds `3 · order.len()` pointers of live buffers.
    pub(super) unsafe fn gemm_bf16_grouped(
        &self,
        items: &[GemmItem],
        order: &[usize],
        (m, k): (usize, usize),
        table: u64,
    ) -> Result<(), GpuError> {
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use cublas_sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
        let groups = row_groups(items, order);
        let g = groups.len();
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| GpuError::Blas(format!("grouped GEMM size {v} over i32")))
        };
        // Row-major y[rows, m] = x·wᵀ is column-major yᵀ[m, rows] = op(W)[m, k]·xᵀ, as in `gemm_ex`.
        let (ta, tb) = (vec![CUBLAS_OP_T; g], vec![CUBLAS_OP_N; g]);
        let (mi, ki) = (vec![int(m)?; g], vec![int(k)?; g]);
        let ni = groups
            .iter()
            .map(|&(rows, _)| int(rows))
            .collect::<Result<Vec<_>, _>>()?;
        let sizes = groups
            .iter()
            .map(|&(_, count)| int(count))
            .collect::<Result<Vec<_>, _>>()?;
        let (alpha, beta) = (vec![1.0f32; g], vec![0.0f32; g]);
        let n = order.len() as u64;
        let part = |p: u64| table + 8 * p * n;
        // SAFETY: host arrays of `g` entries each, alive for the call (cuBLAS reads them before it
        // returns); the device pointer arrays and the buffers they name are the caller's contract.
        unsafe {
            cublas_sys::cublasGemmGroupedBatchedEx(
                *self.blas.handle(),
                ta.as_ptr(),
                tb.as_ptr(),
                mi.as_ptr(),
                ni.as_ptr(),
                ki.as_ptr(),
                alpha.as_ptr().cast(),
                part(0) as *const *const _,
                CUDA_R_16BF,
                ki.as_ptr(),
                part(1) as *const *const _,
                CUDA_R_16BF,
                ki.as_ptr(),
                beta.as_ptr().cast(),
                part(2) as *const *mut _,
                CUDA_R_32F,
                mi.as_ptr(),
                int(g)?,
                sizes.as_ptr(),
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        }
        .result()
        .map_err(|e| GpuError::Blas(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_with_equal_row_counts_share_a_group() {
        let it = |rows| GemmItem {
            x: 0,
            w: 0,
            y: 0,
            rows,
        };
        let items = [it(5), it(3), it(5), it(7), it(3)];
        let order = [1, 4, 0, 2, 3]; // sorted by rows, as gemm_bf16_items orders them
        assert_eq!(row_groups(&items, &order), vec![(3, 2), (5, 2), (7, 1)]);
        assert!(row_groups(&items, &[]).is_empty());
    }
}
