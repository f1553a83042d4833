//! Elementwise ops: residual adds, biases, embedding rows, f32 → bf16.
use super::{grid, int, per_elem};
use crate::cuda::{GpuDevice, GpuError};
use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

impl GpuDevice {
    /// `y[i] += x[i]` for the first `n` elements.
    pub fn add_inplace(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), GpuError> {
        const OP: &str = "add_inplace";
        if n == 0 {
            return Ok(());
        }
        int(OP, "n", n)?;
        let yp = self.output(OP, "y", y, n)?;
        let xp = self.input(OP, "x", x, n)?;
        let mut l = self.stream.launch_builder(&self.k.add_inplace);
        l.arg(&yp).arg(&xp).arg(&n);
        // SAFETY: argument order and types as kernels.cu's `add_inplace` (n is a size_t); thread i < n
        // reads x[i] and updates y[i] (both checked).
        unsafe { l.launch(per_elem(n)) }?;
        Ok(())
    }

    /// `y[r, c] += bias[c]` over `rows` rows of `cols`.
    pub fn add_bias(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        bias: &impl DevicePtr<f32>,
        (rows, cols): (usize, usize),
    ) -> Result<(), GpuError> {
        const OP: &str = "add_bias";
        let total = rows * cols;
        if total == 0 {
            return Ok(());
        }
        int(OP, "rows·cols", total)?;
        let cols_i = int(OP, "cols", cols)?;
        let yp = self.output(OP, "y", y, total)?;
        let bp = self.input(OP, "bias", bias, cols)?;
        let mut l = self.stream.launch_builder(&self.k.add_bias);
        l.arg(&yp).arg(&bp).arg(&cols_i).arg(&total);
        // SAFETY: argument order and types as kernels.cu's `add_bias` (n is a size_t); thread i < total
        // reads bias[i % cols] and updates y[i] (both checked).
        unsafe { l.launch(per_elem(total)) }?;
        Ok(())
    }

    /// `x[t] = table[ids[t]]` as f32 for `rows` ids (trusted: token ids below the table's rows — the
    /// scheduler refuses others) of a bf16 `[vocab, dim]` table.
    pub fn embed_rows(
        &self,
        table: &impl DevicePtr<bf16>,
        ids: &impl DevicePtr<i32>,
        (rows, dim): (usize, usize),
        x: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "embed_rows";
        if rows == 0 {
            return Ok(());
        }
        int(OP, "rows", rows)?;
        let dim_i = int(OP, "dim", dim)?;
        let tp = self.input(OP, "table", table, dim)?;
        let ip = self.input(OP, "ids", ids, rows)?;
        let xp = self.output(OP, "x", x, rows * dim)?;
        let mut l = self.stream.launch_builder(&self.k.embed_rows);
        l.arg(&tp).arg(&ip).arg(&dim_i).arg(&xp);
        // SAFETY: argument order and types as kernels.cu's `embed_rows`; block t reads ids[t] (checked)
        // and the table row it names (trusted), and writes row t of x (checked).
        unsafe { l.launch(grid((rows, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `y[i] = bf16(x[i])` (round to nearest even) for the first `n` elements.
    pub fn f32_to_bf16(
        &self,
        x: &impl DevicePtr<f32>,
        n: usize,
        y: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "f32_to_bf16";
        if n == 0 {
            return Ok(());
        }
        int(OP, "n", n)?;
        let xp = self.input(OP, "x", x, n)?;
        let yp = self.output(OP, "y", y, n)?;
        let mut l = self.stream.launch_builder(&self.k.f32_to_bf16);
        l.arg(&xp).arg(&n).arg(&yp);
        // SAFETY: argument order and types as kernels.cu's `f32_to_bf16` (n is a size_t); thread i < n
        // reads x[i] and writes y[i] (both checked).
        unsafe { l.launch(per_elem(n)) }?;
        Ok(())
    }
}
