//! Element types of the CPU backend's KV rows. Attention reads every cached row once per step and
//! layer, so decode at long context is bound by these bytes: f16 halves them against f32 and keeps
//! 11 mantissa bits (2⁻¹² relative rounding, far inside the engine's 1e-3 tolerance against
//! transformers); bf16 keeps f32's range with 8 bits. Rows are written once (rounded then) and
//! widened to f32 in blocks when read.
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Element type of the CPU KV rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "bf16" => Ok(KvDtype::Bf16),
            _ => Err(format!(
                "unknown KV cache dtype {s:?} (expected f32, f16 or bf16)"
            )),
        }
    }
}

/// One row kind's values for every slot, `width` per slot, in one element type.
#[derive(Debug)]
pub enum RowBuf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Default for RowBuf {
    fn default() -> Self {
        RowBuf::F32(Vec::new())
    }
}

impl RowBuf {
    pub fn new(dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F32 => RowBuf::F32(Vec::new()),
            KvDtype::F16 => RowBuf::F16(Vec::new()),
            KvDtype::Bf16 => RowBuf::Bf16(Vec::new()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            RowBuf::F32(v) => v.len(),
            RowBuf::F16(v) => v.len(),
            RowBuf::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        match self {
            RowBuf::F32(v) => v.len() * 4,
            RowBuf::F16(v) => v.len() * 2,
            RowBuf::Bf16(v) => v.len() * 2,
        }
    }

    /// Grows (zero-filled) to at least `len` values.
    pub fn grow(&mut self, len: usize) {
        match self {
            RowBuf::F32(v) if v.len() < len => v.resize(len, 0.0),
            RowBuf::F16(v) if v.len() < len => v.resize(len, f16::ZERO),
            RowBuf::Bf16(v) if v.len() < len => v.resize(len, bf16::ZERO),
            _ => {}
        }
    }

    /// Stores `src` at values `at .. at + src.len()`, rounded to the element type.
    pub fn write(&mut self, at: usize, src: &[f32]) {
        let end = at + src.len();
        match self {
            RowBuf::F32(v) => v[at..end].copy_from_slice(src),
            RowBuf::F16(v) => v[at..end].convert_from_f32_slice(src),
            RowBuf::Bf16(v) => v[at..end].convert_from_f32_slice(src),
        }
    }

    /// Values `at .. at + dst.len()` widened to f32.
    pub fn read(&self, at: usize, dst: &mut [f32]) {
        let end = at + dst.len();
        match self {
            RowBuf::F32(v) => dst.copy_from_slice(&v[at..end]),
            RowBuf::F16(v) => moe_kernels::cpu::f16_to_f32(v[at..end].reinterpret_cast(), dst),
            RowBuf::Bf16(v) => moe_kernels::cpu::bf16_to_f32(v[at..end].reinterpret_cast(), dst),
        }
    }

    /// Copies values `from .. from + len` to `to ..` (copy-on-write of a block).
    pub fn copy_within(&mut self, from: usize, len: usize, to: usize) {
        match self {
            RowBuf::F32(v) => v.copy_within(from..from + len, to),
            RowBuf::F16(v) => v.copy_within(from..from + len, to),
            RowBuf::Bf16(v) => v.copy_within(from..from + len, to),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounding once on write: f16 within 2⁻¹¹ relative (normal range), bf16 within 2⁻⁸, f32 exact.
    #[test]
    fn rows_round_once_and_read_back() {
        let src: Vec<f32> = (0..37).map(|i| (i as f32 - 18.3) * 0.731).collect();
        for (dtype, rel) in [
            (KvDtype::F32, 0.0),
            (KvDtype::F16, 2f32.powi(-11)),
            (KvDtype::Bf16, 2f32.powi(-8)),
        ] {
            let mut b = RowBuf::new(dtype);
            b.grow(100);
            b.write(50, &src);
            b.copy_within(50, 37, 5);
            let mut back = vec![0f32; 37];
            b.read(5, &mut back);
            for (x, y) in src.iter().zip(&back) {
                assert!((x - y).abs() <= x.abs() * rel, "{dtype:?}: {x} vs {y}");
            }
            assert_eq!(b.bytes(), 100 * dtype.bytes());
        }
        assert_eq!("bf16".parse::<KvDtype>(), Ok(KvDtype::Bf16));
        assert!("fp8".parse::<KvDtype>().is_err());
    }
}
